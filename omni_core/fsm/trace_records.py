"""Trace records: what the cores did, as typed values (one tagged union, no IO).

The cores return these with every step (`StageStep.records`, `WorkerStep.records`), in
program order; a shell only stamps and writes them (`omni_core.trace`). Each record kind
is one action of the TLA+ trace spec (tla/trace/OmniTrace.tla) or a fact the spec does not
model; `omni_core.formal.trace_export` maps kinds to actions one to one (P-17's weight
commands: tla/trace/OmniWeights.tla):

| record | TLA+ (OmniTrace) | OmniSleep action |
|---|---|---|
| StageIssued | issue | IssueSleep / IssueWake / IssueReload / IssueProfile; P-17's IssueUpdate / IssueWeightTask |
| StageDispatched | dispatch | IssueExecute |
| StageSent | send | (check: a command the last step put on the network) |
| StageReceived | recv | StageReceive (a weight task's reply: StageTake) |
| StageChanged | state | (check: the stage change the last step made) |
| StageDeadline | deadline | Deadline |
| StageRestarted | restart | Restart |
| RankDied | died | RankDied (after the hidden Crash) |
| WorkerStarted | start | Loaded / LoadFailed |
| WorkerReceived | wrecv | WorkerReceive (a weight command: RankTake) |
| EffectDone / EffectFailed / EffectRefused | done / error / refused | Done / EffectError / Refused (Weight*) |
| WorkerChanged | wstate | (check: the worker change its last step made) |
| ReplySent | wsend | (check: such a reply left the rank) |

Not modelled, kept for readers and for per-process checks of deadlines and answers:
StageStarting, StageStopped (ends a stage's replay), RequestSubmitted, RequestAnswered,
TaskEnded, AdmissionChanged, BadMessage (the admission records, the answers and a wake's
wait for memory are checked by `omni_core.formal.trace_admission`); and the shells' own IO
facts, which no core sees: RankSpawned, PeerRefused, IncomingHeld and IncomingFreed (a swap's
hold of its devices, checked there too), LinkPlanned (a Sleep's or Wake's links and incoming
bytes as sent, checked by `omni_core.formal.trace_links`), ParentGone.

Every line of the file is a `TraceLine`: the record plus who wrote it (stage, rank, the
process's epoch, pid), its per-process sequence number (program order) and the process's
monotonic clock (`time.monotonic()`, one clock for every process of a host: the stage
core's `now`, and so every `deadline_at_s`, is on it too). A deadline names the task or
request whose issue set it (`StageDeadline.task_id`; "" for the start's), and the issue
says the timeout its call asked for (`StageIssued.timeout_s`), so the check can hold the
clock across records. A new command (Profile, ...) needs no new kind: WorkerReceived /
EffectDone / ReplySent name the command; a fact only it has (a profile written) is one
more Struct in `TraceRecord`.
"""

from __future__ import annotations

import msgspec

MAX_TRACE_DETAIL_CHARS = 200  # a reason in a trace line, not the whole story: the log has it
ENGINE_RANK = -1  # TraceLine.rank of the engine's lines


def clip(text: str) -> str:
    """A detail cut to what a trace line carries (lines stay small: one write each)."""
    return text if len(text) <= MAX_TRACE_DETAIL_CHARS else text[: MAX_TRACE_DETAIL_CHARS - 3] + "..."


class _Record(msgspec.Struct, tag=True, tag_field="kind", forbid_unknown_fields=True, omit_defaults=True):
    """Base of every record; the tag is the class name (`"kind"` on the wire)."""


# ---------------------------------------------------------------------- stage core (engine)


class StageStarting(_Record):
    """Start: waiting for every rank's Hello until `deadline_at_s`."""

    epoch: int
    tags: tuple[str, ...]
    deadline_at_s: float
    policy: str = ""  # the admission policy it starts under ("": a trace of an older omni-core)


class AdmissionChanged(_Record):
    """The stage's admission policy changed (`Engine.set_admission`): `before` -> `after`."""

    epoch: int
    before: str
    after: str


class StageRestarted(_Record):
    """Restart: a new epoch, STARTING; fresh ranks say Hello until `deadline_at_s`."""

    epoch: int
    before: str
    after: str
    tags: tuple[str, ...]
    deadline_at_s: float
    # The version the fresh ranks start at (their start source's; 0: their checkpoint).
    weights_version: int = 0
    # Whether they start NEEDS_RELOAD (the version lived in memory only, or the runner's
    # weights are dummy), and the version the stage must not serve below until an update.
    needs_reload: bool = False
    version_floor: int = 0


class StageIssued(_Record):
    """A lifecycle call became task `task_id` (Sleep, Wake, ReloadWeights): the stage went
    `before` -> `after` in one step (RUNNING -> TRANSITIONING when nothing had to drain).
    `already`: every tag was there already (ALREADY, nothing sent). `auto`: the stage's
    admission policy started it (a request waited), not a caller. `tags` None: every tag."""

    epoch: int
    task_id: str
    command: str
    before: str
    after: str
    deadline_at_s: float
    level: int = 0  # a Sleep's level; a Wake's 1 when it waits for free memory (P-16)
    tags: tuple[str, ...] | None = None
    already: bool = False
    auto: bool = False
    timeout_s: float = 0.0  # the deadline the call asked for: deadline_at_s is the now plus it
    version: int = 0  # the weights version the command installs (Command.installs_version, P-17)
    memory_wait_s: float | None = None  # a Wake's wait for free memory (P-16; None: 0, none)
    policy: str = ""  # an `auto` issue: the admission policy that started it


class StageDispatched(_Record):
    """Request `request_id` sent to every rank (its StageSent lines follow)."""

    epoch: int
    request_id: str
    state: str
    deadline_at_s: float


class StageSent(_Record):
    """A command for `rank`, in the order the core produced it, written before it leaves."""

    epoch: int
    rank: int
    task_id: str
    command: str
    state: str
    level: int = 0  # as StageIssued.level
    tags: tuple[str, ...] | None = None
    version: int = 0  # as StageIssued.version
    memory_wait_s: float | None = None  # as StageIssued.memory_wait_s


class StageReceived(_Record):
    """A reply or Hello the core took (after the shell authenticated its sender). `state`
    is the stage's before it; `reply` one of ack, nack, result, hello; `info` the Ack's
    status or the Nack's reason."""

    epoch: int
    rank: int
    task_id: str
    reply: str
    state: str
    worker_state: str = ""
    info: str = ""
    weights_version: int = 0  # the version the rank reported (P-17)


class StageChanged(_Record):
    """The change of state the step before it made (a commit, a failure, a start), with
    the ranks named when it is a failure."""

    epoch: int
    task_id: str
    before: str
    after: str
    failed_ranks: dict[int, str] = {}
    weights_version: int = 0  # the stage's committed weights version after the change (P-17)


class StageDeadline(_Record):
    """A deadline passed (`deadline_at_s`, seen at `now_s`): a start (`task_id` ""), a task,
    a drain or a request (its id); the stage went `before` -> `after`, naming `failed_ranks`."""

    epoch: int
    task_id: str
    before: str
    after: str
    deadline_at_s: float
    now_s: float
    failed_ranks: dict[int, str] = {}


class RankDied(_Record):
    """A rank process ended. `fenced`: it was of another epoch (`process_epoch`), ignored."""

    epoch: int
    rank: int
    process_epoch: int
    state: str
    detail: str
    fenced: bool = False


class StageStopped(_Record):
    """Shutdown: the stage's replay ends here (the spec does not model Shutdown)."""

    epoch: int
    before: str


class RequestSubmitted(_Record):
    """A request came in; `admission` is the table's decision in `state`."""

    request_id: str
    state: str
    admission: str
    deadline_at_s: float
    policy: str = ""  # the admission policy that decided ("": a trace of an older omni-core)


class RequestAnswered(_Record):
    """The caller of a request heard: its output (`error` empty) or why not."""

    request_id: str
    error: str = ""
    detail: str = ""


class TaskEnded(_Record):
    """A lifecycle task's outcome, as its callers hear it."""

    task_id: str
    command: str
    ok: bool
    state: str
    error: str = ""
    failed_ranks: dict[int, str] = {}


# ---------------------------------------------------------------------- worker core (rank)


class WorkerStarted(_Record):
    """The rank loaded (ACTIVE) or failed to (FAILED, `detail` says why); its Hello follows."""

    state: str
    tags: tuple[str, ...]
    backend: str = ""
    detail: str = ""


class WorkerReceived(_Record):
    """A command the core took; `state` is the worker's before it."""

    epoch: int
    task_id: str
    command: str
    state: str


class WorkerChanged(_Record):
    """The change of state the worker's step before it made."""

    task_id: str
    before: str
    after: str


class EffectDone(_Record):
    """The pending effect of `command` finished; `state` is the worker's after it, `path`
    how the backend did it (a sleep: vllm-sleep, per-allocation, fast, ...)."""

    task_id: str
    command: str
    state: str
    duration_s: float
    path: str = ""
    # The version the rank holds after it: a reload's is its source's (a save's index, P-21).
    weights_version: int = 0


class EffectFailed(_Record):
    """The pending effect raised; `state` is the worker's after it."""

    task_id: str
    command: str
    state: str
    detail: str


class EffectRefused(_Record):
    """The runner refused the effect's arguments before touching memory (a reload's source)."""

    task_id: str
    command: str
    state: str
    detail: str


class ReplySent(_Record):
    """A reply (ack, nack, result) or the Hello, written before it leaves. `to_bad_bytes`:
    the NACK BAD_MESSAGE of bytes that did not decode."""

    epoch: int
    task_id: str
    reply: str
    state: str
    info: str = ""
    to_bad_bytes: bool = False
    weights_version: int = 0  # the version the reply (or Hello) reports (P-17)


class BadMessage(_Record):
    """Bytes that did not decode (what could be read of them)."""

    task_id: str
    epoch: int
    detail: str


# ---------------------------------------------------------------------- shells (IO facts)


class RankSpawned(_Record):
    rank: int
    pid: int | None  # None: a rank started elsewhere (a Ray actor) reports its pid in its Hello
    node: str = ""  # where it was started or placed, as the launcher knows it then
    link_gpu: str = ""  # the GPU whose host link is the rank's own, as link plans name GPUs


class PeerRefused(_Record):
    """A frame the engine dropped before any core saw it: bad_reply, rank_mismatch,
    forged_hello, rebind_refused."""

    reason: str
    rank: int = -1
    detail: str = ""


class IncomingHeld(_Record):
    """A swap's incoming wake (task `task_id` of this stage, one that waits for memory) holds
    `devices` from here until its IncomingFreed: one incoming wake per device at a time
    (P-16; `engine/incoming.py`). Written before the wake is issued; no devices: a stage on
    none (a CPU without a simulated device)."""

    task_id: str
    devices: tuple[str, ...] = ()


class IncomingFreed(_Record):
    """The incoming wake of `task_id` ended (or was never sent): its devices are free."""

    task_id: str


class PlannedLink(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One link of a LinkPlanned: `peer` as LinkShare.peer (None: the own link), its `share`
    and the bytes that share is of the rank's pool bytes in the command's tags."""

    peer: int | None
    share: float
    nbytes: int


class LinkPlanned(_Record):
    """A Sleep or Wake for `rank` as the engine sent it, after its StageSent: the links the
    engine's plan gave it (P-18, `engine/link_plan.py`; none: the own link alone) and the
    swap's `incoming_bytes`. With what the plan was made from: the rank's GPUs by device
    index (`visible`, the link GPU of its RankSpawned at `own`), the peers its Hello reported
    (`relay_peers`), whether it may be sent links (`multi_path`: its Hello declared
    MULTI_PATH and its stage's spec allows them) or incoming bytes (`swap`: it declared
    SWAP), and `pool_bytes`, what its Hello's pools hold in the command's tags."""

    task_id: str
    rank: int
    command: str
    visible: tuple[str, ...] = ()
    own: int = 0
    relay_peers: tuple[int, ...] = ()
    multi_path: bool = False
    swap: bool = False
    pool_bytes: int = 0
    links: tuple[PlannedLink, ...] = ()
    incoming_bytes: int = 0


class ParentGone(_Record):
    parent_pid: int


class Truncated(_Record):
    """A record whose line would have exceeded the writer's limit (`of`: its kind)."""

    of: str
    size_bytes: int


StageRecord = (
    StageStarting
    | AdmissionChanged
    | StageRestarted
    | StageIssued
    | StageDispatched
    | StageSent
    | StageReceived
    | StageChanged
    | StageDeadline
    | RankDied
    | StageStopped
    | RequestSubmitted
    | RequestAnswered
    | TaskEnded
)
WorkerRecord = (
    WorkerStarted | WorkerReceived | WorkerChanged | EffectDone | EffectFailed | EffectRefused | ReplySent | BadMessage
)
TraceRecord = (
    StageRecord
    | WorkerRecord
    | RankSpawned
    | PeerRefused
    | IncomingHeld
    | IncomingFreed
    | LinkPlanned
    | ParentGone
    | Truncated
)


class TraceLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a trace file: who (stage, rank: ENGINE_RANK for the engine, the
    process's epoch, pid), when (`seq` in the process's program order, `mono_s` on its
    monotonic clock) and what (`record`)."""

    seq: int
    mono_s: float
    pid: int
    stage: str
    rank: int
    epoch: int
    record: TraceRecord

    @property
    def kind(self) -> str:
        return type(self.record).__name__

    @property
    def is_engine(self) -> bool:
        return self.rank == ENGINE_RANK
