"""Every input a stage core takes, as a typed value (etcd-raft's `Step(msg)`).

The orchestrator turns API calls, decoded replies, process exits and the passing of time
into these and hands each to `StageCore.step(input, now)`; the core returns a `StageStep`
(commands to send, outcomes to report). Because inputs are values, a run can be logged,
replayed and checked; none of them carries a callable.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from omni_core.fsm.admission import AdmissionPolicy
from omni_core.protocol import Command, Hello, Reply, VersionSpan


@dataclass(frozen=True)
class Start:
    """The shell spawned the ranks: wait for every Hello for `deadline_s`."""

    deadline_s: float


@dataclass(frozen=True)
class Restart:
    """The shell stopped the old ranks: new epoch, STARTING; it spawns fresh ranks next, from
    the core's `start_weights`. `from_checkpoint`: start over from the runner's checkpoint at
    version 0, whatever version the stage held (the caller's explicit reset)."""

    deadline_s: float
    from_checkpoint: bool = False


@dataclass(frozen=True)
class Stop:
    """Shutdown: end the task in flight and every request."""


@dataclass(frozen=True)
class Submit:
    """A request for the model; `request_id` names it in the outcome."""

    request_id: str
    payload: Any
    timeout_s: float
    adapter: str | None = None  # the LoRA adapter every rank runs it with (P-20)


@dataclass(frozen=True)
class SleepCall:
    task_id: str
    level: int
    tags: tuple[str, ...] | None
    deadline_s: float
    abort_in_flight: bool = False  # callers of running requests hear now; the drain still waits


@dataclass(frozen=True)
class WakeCall:
    task_id: str
    tags: tuple[str, ...] | None
    deadline_s: float
    memory_wait_s: float = 0.0  # each rank may wait this long for free device memory (a swap, P-16)


@dataclass(frozen=True)
class PauseCall:
    """Close admission keeping the memory (vLLM's pause); `mode` says what in-flight requests do."""

    task_id: str
    mode: str  # "abort" | "wait" | "keep" (omni_core.fsm.stage_pause.PAUSE_MODES)
    deadline_s: float  # the longest the in-flight requests may take to finish
    # keep: the held requests' KV is dropped instead (each restarts from its prompt at resume)
    clear_cache: bool = False


@dataclass(frozen=True)
class ResumeCall:
    """Open a PAUSED stage's admission again; its queue is served."""

    task_id: str
    deadline_s: float  # the longest the caller waits for its answer (the resume itself sends nothing)


@dataclass(frozen=True)
class ReloadCall:
    task_id: str
    source: str | None
    deadline_s: float


@dataclass(frozen=True)
class UpdateCall:
    """Replace the weights as `version` from `source` (an omni_core.protocol WeightSource, P-17).
    `flush_cache` False keeps the runner's caches keyed by version (the wire's flush_cache)."""

    task_id: str
    version: int
    source: Any
    deadline_s: float
    flush_cache: bool = True


@dataclass(frozen=True)
class WeightGroupCall:
    """Every rank joins the trainer's weight group (an omni_core.protocol InitWeightGroup's fields)."""

    task_id: str
    group: str
    address: str
    port: int
    world_size: int
    rank_offset: int
    backend: str
    deadline_s: float
    group_timeout_s: float = 300.0  # each rank's rendezvous and every later broadcast


@dataclass(frozen=True)
class ShareCall:
    """Every rank shares its weights in buckets of at most `bucket_bytes` (a trainer stage)."""

    task_id: str
    bucket_bytes: int
    deadline_s: float


@dataclass(frozen=True)
class ProfileCall:
    """Start (`start=True`) or stop every rank's profiler; the stage's state never changes."""

    task_id: str
    start: bool
    prefix: str | None
    deadline_s: float


@dataclass(frozen=True)
class CommandCall:
    """A call that is its wire command, for the commands whose row in `stage_calls.CALLS` is
    stateless: `command` goes to every rank as given (stamped with the stage's epoch; its
    `task_id` names the task), its own fields are the task's signature, and `deadline_s`
    bounds it. A new command of that kind needs no input of its own."""

    command: Command
    deadline_s: float

    @property
    def task_id(self) -> str:
        return self.command.task_id


@dataclass(frozen=True)
class SetAdmission:
    policy: AdmissionPolicy


@dataclass(frozen=True)
class Tick:
    """Time passed: deadlines of the task, the start, requests and the queue."""


@dataclass(frozen=True)
class Received:
    """A reply (or Hello) that arrived on a bound rank's socket; `message.rank` is that rank."""

    message: Reply | Hello


@dataclass(frozen=True)
class RankExited:
    """A rank process ended; `epoch` is the one it was started in (older ones are fenced)."""

    rank: int
    detail: str
    epoch: int


@dataclass(frozen=True)
class SendFailed:
    """The shell could not queue the command of `task_id` for `ranks` (its socket queue is full)."""

    task_id: str
    ranks: tuple[int, ...]


EngineInput = (
    Start
    | Restart
    | Stop
    | Submit
    | SleepCall
    | WakeCall
    | ReloadCall
    | ProfileCall
    | CommandCall
    | SetAdmission
    | Tick
    | Received
    | RankExited
    | SendFailed
    | UpdateCall
    | WeightGroupCall
    | ShareCall
    | PauseCall
    | ResumeCall
)


class RequestError(str, enum.Enum):
    """Why a request got no output; the shell picks the exception class from it."""

    REJECTED = "rejected"  # refused by admission, the queue bound or its deadline in the queue
    FAILED = "failed"  # a rank refused or raised, or gave no result in time
    ABORTED = "aborted"  # sleep(abort_in_flight=True), pause(mode="abort")
    OVERLOADED = "overloaded"  # the engine could not send it
    CLOSED = "closed"  # the stage stopped


@dataclass(frozen=True)
class RequestOutcome:
    """The answer to one Submit: rank 0's output and the weights version that produced it
    (every rank's, or the result is discarded), or an error and its kind."""

    request_id: str
    output: Any = None
    error: RequestError | None = None
    detail: str = ""
    weights_version: int = 0
    adapter: str | None = None  # the LoRA adapter it ran with, and that adapter's version (P-20)
    adapter_version: int = 0
    # Held through an update (pause mode keep): which version computed which tokens, and the
    # tokens a hold with clear_cache discarded (protocol.Result's fields, rank 0's).
    version_spans: tuple[VersionSpan, ...] = ()
    discarded_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None
