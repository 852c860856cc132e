"""What the stage core hands out and keeps: its step, a task's outcome, its errors, the
bookkeeping of one task and one request, and the snapshot it is restored from."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from omni_core.fsm.inputs import RequestOutcome
from omni_core.fsm.trace_records import StageRecord
from omni_core.fsm.worker_step import InvariantViolation
from omni_core.protocol import Ack, AckStatus, Capability, Command, Nack, Result, WorkerState
from omni_core.protocol import StageState as S


class StageCommandError(ValueError):
    """A stage call refused before anything was sent: bad argument or wrong state."""


class StageBusyError(StageCommandError):
    """Another lifecycle task of this stage is in flight."""


@dataclass(frozen=True)
class Outbound:
    rank: int
    command: Command


@dataclass(frozen=True)
class TaskOutcome:
    """How a stage task ended. `failures` maps rank -> why, for every rank that failed it."""

    task_id: str
    command: str
    ok: bool
    status: AckStatus
    state: S
    acks: MappingProxyType[int, Ack]
    failures: MappingProxyType[int, str]
    error: str
    started_at: float
    finished_at: float
    refused: bool = False  # every rank refused the arguments; nothing changed (INVALID_ARGUMENT)
    # Profile: rank -> its NACK; those ranks are where they were, as is the stage.
    refusals: MappingProxyType[int, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at


@dataclass(frozen=True)
class StageStep:
    """What one input produced: commands to send, the lifecycle task's outcome, the answers to
    requests, and (`started`) the end of a start or restart: RUNNING or FAILED."""

    sends: tuple[Outbound, ...] = ()
    outcome: TaskOutcome | None = None
    requests: tuple[RequestOutcome, ...] = ()
    started: S | None = None
    # What happened, in program order (omni_core.fsm.trace_records); set by step() only.
    records: tuple[StageRecord, ...] = field(default=(), compare=False, repr=False)

    def then(self, later: StageStep) -> StageStep:
        """This step followed by `later` (one input may cause both, e.g. a reply and a dispatch)."""
        if self.outcome is not None and later.outcome is not None:
            raise InvariantViolation(f"two task outcomes in one step: {self.outcome} and {later.outcome}")
        return StageStep(
            self.sends + later.sends,
            self.outcome or later.outcome,
            self.requests + later.requests,
            later.started or self.started,
        )


@dataclass
class StageRequest:
    """One request: in the queue, or sent to every rank and waiting for all their answers."""

    request_id: str
    payload: Any
    deadline_at_s: float
    adapter: str | None = None  # P-20: the adapter it names
    replies: dict[int, Result | Nack | None] = field(default_factory=dict)  # None: never sent to it
    answered: bool = False  # the caller already heard (aborted, overloaded)
    # P-17, judged as each Result comes: rank -> its version where that was not the stage's
    # then (a request held through an update answers on the new version, committed by then).
    off_version: dict[int, int] = field(default_factory=dict)


@dataclass
class StageCounters:
    stale_replies_ignored: int = 0
    unknown_replies_ignored: int = 0
    late_results: int = 0  # request replies for requests no longer in flight
    acks_without_memory_report: int = 0
    duplicate_replies_ignored: int = 0
    retries: int = 0
    undeclared_counters_ignored: int = 0  # runner counters a rank's Hello did not declare


@dataclass
class StageTask:
    task_id: str
    signature: tuple[Any, ...]
    command: Command
    started_at: float
    deadline_at_s: float
    expect_state: WorkerState = WorkerState.SLEEPING
    expect_asleep: frozenset[str] = frozenset()
    commit_trigger: str = "slept"
    apply: Any = None  # callable(Residency) run on commit
    sent: bool = False
    acks: dict[int, Ack] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # rank -> INVALID_ARGUMENT / NO_MEMORY detail
    refused_trigger: str = ""  # where every rank refusing returns the stage (ReloadWeights, Wake)
    expect_version: int = 0  # the weights version every ACK must report (P-17)
    # A reload from a directory: the first ACK's version (a save's index names it, P-21) is the
    # one every other ACK must report.
    version_from_source: bool = False
    update_failures: dict[int, str] = field(default_factory=dict)  # rank -> UPDATE_FAILED detail
    # An update into the ranks' host copies (HOST_REFIT) goes out by its own trigger, and a rank
    # that fails it midway stays asleep instead of NEEDS_RELOAD.
    send_trigger: str = ""  # fired as the command goes out, where not its CallRow's trigger
    failed_state: WorkerState = WorkerState.NEEDS_RELOAD  # a rank's state after UPDATE_FAILED
    failed_trigger: str = "update_failed"  # fired when every rank failed the update


@dataclass(frozen=True)
class StageSnapshot:
    """A stage core's state as `StageCore.restore` takes it: a case, not a path to it (the
    agreement rows of omni_core.formal, tests). The lifecycle state, the residency the ranks
    hold, what each rank reported and declared, the committed weights version, a held pause,
    the task in flight and the requests queued and in flight (`holding`: those in flight are
    frozen on the ranks by a pause of mode keep, P-23)."""

    state: S
    asleep: frozenset[str] = frozenset()
    weights_valid: bool = True
    rank_state: Mapping[int, WorkerState] = field(default_factory=dict)
    rank_capabilities: Mapping[int, frozenset[Capability]] = field(default_factory=dict)
    weights_version: int = 0
    paused: bool = False
    task: StageTask | None = None
    queued: tuple[StageRequest, ...] = ()
    in_flight: tuple[StageRequest, ...] = ()
    holding: bool = False
