"""The stage core's trace records: what each input found, and what each phase of a step did
(the input's handler, then moving the queue on), in program order."""

from __future__ import annotations

from typing import Any, Protocol

from omni_core.fsm import admission
from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.inputs import RequestOutcome
from omni_core.fsm.stage_step import Outbound, StageRequest, TaskOutcome
from omni_core.fsm.stage_versions import StartWeights, VersionKeeper
from omni_core.fsm.trace_records import (
    AdmissionChanged,
    RankDied,
    RequestAnswered,
    RequestSubmitted,
    StageChanged,
    StageDeadline,
    StageDispatched,
    StageIssued,
    StageReceived,
    StageRecord,
    StageRestarted,
    StageSent,
    StageStarting,
    StageStopped,
    TaskEnded,
    clip,
)
from omni_core.protocol import Ack, Command, Execute, Hello, Nack, Profile, Sleep, Wake
from omni_core.protocol import StageState as S


class StageView(Protocol):
    """What the recorder reads of a stage core (StageCore is one), and never changes."""

    @property
    def state(self) -> S: ...
    @property
    def epoch(self) -> int: ...
    @property
    def ranks(self) -> tuple[int, ...]: ...
    @property
    def tags(self) -> tuple[str, ...]: ...
    @property
    def policy(self) -> AdmissionPolicy: ...
    @property
    def wake_deadline_s(self) -> float: ...
    @property
    def in_flight(self) -> dict[str, StageRequest]: ...
    @property
    def failed_ranks(self) -> dict[int, str]: ...
    @property
    def start_deadline_at_s(self) -> float: ...
    @property
    def weights_version(self) -> int: ...
    @property
    def task_id(self) -> str | None: ...
    @property
    def start_weights(self) -> StartWeights | None: ...
    @property
    def versions(self) -> VersionKeeper: ...


def level_tags(command: Command) -> tuple[int, tuple[str, ...] | None]:
    """What a trace record says of a command beyond its name: a Sleep's level (for a Wake, 1
    when it waits for free memory, P-16, as the spec marks it; for a Profile, 1 for a start),
    the tags."""
    match command:
        case Sleep():
            return command.level, command.tags
        case Wake():
            return (1 if command.memory_wait_s > 0 else 0), command.tags
        case Profile(start=True):
            return 1, None  # as the spec marks a Profile start on the wire
        case _:
            return 0, None


def _memory_wait_s(command: Command) -> float | None:
    """How long a Wake may wait for free memory (P-16); None when it may not (left off the
    line, as off the wire)."""
    return command.memory_wait_s if isinstance(command, Wake) and command.memory_wait_s > 0 else None


class StageRecorder:
    """The trace records of one step of a stage core, in program order: what the input found
    (`input`), then what each phase did (`phase`: the input's handler, then moving the queue
    on), then the requests answered and the task ended (`finish`). Between the phases the core
    notes what a record needs and its state does not keep: the task a phase issued (`issued`)
    and the deadline a tick found passed (`expired`). Each step starts empty (`begin`), and
    nothing of one step is left in the next. The records read the core, never change it."""

    def __init__(self) -> None:
        self._records: list[StageRecord] = []
        self._issued: tuple[Command, bool, float] | None = None  # command, already, deadline_at_s
        self._expired_at: float | None = None  # the deadline this step's tick found passed
        self._expired_task = ""  # the task or request whose deadline that was ("": the start's)

    def begin(self) -> None:
        self._records, self._issued, self._expired_at, self._expired_task = [], None, None, ""

    def issued(self, command: Command, already: bool, deadline_at_s: float) -> None:
        """This phase issued `command` (answered ALREADY at once when `already`)."""
        self._issued = (command, already, deadline_at_s)

    def expired(self, deadline_at_s: float, task_id: str = "") -> None:
        """A deadline this step found passed (the first one noted is the record's)."""
        if self._expired_at is None:
            self._expired_at, self._expired_task = deadline_at_s, task_id

    def finish(self, answers: tuple[RequestOutcome, ...], outcome: TaskOutcome | None) -> tuple[StageRecord, ...]:
        """The step's records, closed by the answers to requests and the task's end."""
        records = self._records
        records += [RequestAnswered(a.request_id, a.error.value if a.error else "", clip(a.detail)) for a in answers]
        if outcome is not None:
            o = outcome
            failures = {r: clip(why) for r, why in o.failures.items()}
            records.append(TaskEnded(o.task_id, o.command, o.ok, o.state.value, clip(o.error), failures))
        self.begin()
        return tuple(records)

    def input(self, core: StageView, event: Any, now: float) -> None:
        """The record of an input from outside, with the state it found: the step's first."""
        head = self._input(core, event, now)
        if head is not None:
            self._records.append(head)

    @staticmethod
    def _input(core: StageView, event: Any, now: float) -> StageRecord | None:
        state = core.state.value
        match event:
            case I.Received(message=m):
                info = m.status.value if isinstance(m, Ack) else m.reason.value if isinstance(m, Nack) else ""
                worker_state = m.state.value if isinstance(m, (Ack, Nack, Hello)) else ""
                version = getattr(m, "weights_version", 0)
                return StageReceived(
                    m.epoch, m.rank, m.task_id, type(m).__name__.lower(), state, worker_state, info, version
                )
            case I.RankExited():
                fenced = event.epoch != core.epoch or event.rank not in core.ranks
                return RankDied(core.epoch, event.rank, event.epoch, state, clip(event.detail), fenced)
            case I.Submit():
                decision = admission.admit(core.state, core.policy).decision.value
                deadline_at_s = now + event.timeout_s
                return RequestSubmitted(event.request_id, state, decision, deadline_at_s, core.policy.value)
            case I.SetAdmission(policy=policy) if AdmissionPolicy(policy) is not core.policy:
                return AdmissionChanged(core.epoch, core.policy.value, AdmissionPolicy(policy).value)
            case _:
                return None

    def phase(self, core: StageView, event: Any, before: S, sends: tuple[Outbound, ...], now: float) -> None:
        """The record of what one phase of a step did (the input's handler, or moving the
        queue on: `event` None), then one per command it sends. A change of state is the
        action that made it (issue, restart, deadline, stop) or, when it came from an input
        already recorded (a reply, a death), a StageChanged that logs it."""
        after, epoch = core.state, core.epoch
        issued, self._issued = self._issued, None
        if issued is not None:
            command, already, deadline_at_s = issued
            # The caller's timeout as the input gave it, not as the core used it: the trace
            # check compares the two (a deadline in the wrong unit fails there).
            timeout_s = core.wake_deadline_s if event is None else getattr(event, "deadline_s", 0.0)
            self._records.append(
                StageIssued(
                    epoch,
                    command.task_id,
                    type(command).__name__,
                    before.value,
                    after.value,
                    deadline_at_s,
                    *level_tags(command),
                    already,
                    event is None,
                    timeout_s,
                    command.installs_version,
                    _memory_wait_s(command),
                    core.policy.value if event is None else "",
                )
            )
        else:
            changed = self._change(core, event, before, now)
            if changed is not None:
                self._records.append(changed)
        dispatched: set[str] = set()
        for out in sends:
            command = out.command
            if isinstance(command, Execute) and command.task_id not in dispatched:
                dispatched.add(command.task_id)
                request = core.in_flight.get(command.task_id)
                deadline_at_s = request.deadline_at_s if request is not None else now
                self._records.append(StageDispatched(command.epoch, command.task_id, after.value, deadline_at_s))
            self._records.append(
                StageSent(
                    command.epoch,
                    out.rank,
                    command.task_id,
                    type(command).__name__,
                    after.value,
                    *level_tags(command),
                    command.installs_version,
                    _memory_wait_s(command),
                )
            )

    def _change(self, core: StageView, event: Any, before: S, now: float) -> StageRecord | None:
        """The record of a phase that issued no task: a start, a restart, a stop, a deadline, or
        a change of state another input made."""
        after, epoch = core.state, core.epoch
        failed = {r: clip(why) for r, why in core.failed_ranks.items()} if after is S.FAILED else {}
        match event:
            case I.Restart():
                plan = core.start_weights
                return StageRestarted(
                    epoch,
                    before.value,
                    after.value,
                    core.tags,
                    core.start_deadline_at_s,
                    core.weights_version,
                    needs_reload=plan is not None and plan.needs_reload,
                    version_floor=core.versions.floor,
                )
            case I.Start():
                return StageStarting(epoch, core.tags, core.start_deadline_at_s, core.policy.value)
            case I.Stop():
                return StageStopped(epoch, before.value) if after is not before else None
            case _ if after is before:
                return None
            case I.Tick():
                expired_at = self._expired_at if self._expired_at is not None else now
                return StageDeadline(epoch, self._expired_task, before.value, after.value, expired_at, now, failed)
            case _:
                return StageChanged(epoch, core.task_id or "", before.value, after.value, failed, core.weights_version)
