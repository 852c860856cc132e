"""What the worker core hands out and keeps: its step, its counters, the cached reply of a
task, the work in progress (`WorkInProgress`, a component with its own invariants), and the
one error that is a bug in omni-core itself."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec

from omni_core.fsm.effects import Effect
from omni_core.fsm.tags import SleepPlan
from omni_core.fsm.trace_records import ReplySent, WorkerRecord
from omni_core.fsm.worker_table import BESIDE_HELD
from omni_core.protocol import (
    Ack,
    Capability,
    Command,
    Execute,
    Hello,
    HoldRequests,
    Nack,
    Reply,
    Result,
    Status,
    encode,
)
from omni_core.protocol import WorkerState as W

# Epochs grow by one per restart, and a restart spawns fresh ranks: a live rank never needs
# to jump far ahead. A bounded window stops one command (epoch 2**64-1) from fencing the
# rank off from every normal epoch for good.
MAX_EPOCH_AHEAD = 64
# Requests one rank may hold at once: StageSpec's max_in_flight bound (each request goes to
# every rank of its stage, so a stage's in-flight requests are each rank's).
MAX_IN_FLIGHT_PER_RANK = 4096

ALL_CAPABILITIES: tuple[Capability, ...] = (
    Capability.LEVEL2,
    Capability.PARTIAL_WAKE,
    Capability.SWAP,
    Capability.WEIGHT_UPDATE,
    Capability.ADAPTERS,
    Capability.SAVE_WEIGHTS,
)
HELLO_TASK_ID = "hello"  # the task id every Hello carries
_REPLY_KINDS = {Ack: "ack", Nack: "nack", Result: "result", Hello: "hello"}


def _sent(reply: Reply, *, to_bad_bytes: bool = False) -> ReplySent:
    info = reply.status.value if isinstance(reply, Ack) else reply.reason.value if isinstance(reply, Nack) else ""
    state = reply.state.value if isinstance(reply, (Ack, Nack)) else ""
    version = getattr(reply, "weights_version", 0)
    return ReplySent(reply.epoch, reply.task_id, _REPLY_KINDS[type(reply)], state, info, to_bad_bytes, version)


@dataclass(frozen=True)
class WorkerStep:
    """Output of one core call: replies to send now, at most one effect to perform, and the
    trace records of what happened (the shell writes them before sending the replies)."""

    replies: tuple[Reply, ...] = ()
    effect: Effect | None = None
    records: tuple[WorkerRecord, ...] = field(default=(), compare=False, repr=False)


@dataclass
class WorkerCounters:
    duplicates_answered_from_cache: int = 0
    duplicates_in_flight_ignored: int = 0
    stale_epoch_refused: int = 0
    epoch_ahead_refused: int = 0
    bad_messages: int = 0
    replies_not_kept: int = 0  # answered, but too large to keep for a duplicate


@dataclass(frozen=True)
class _CachedReply:
    """What a duplicate needs: a digest of the command (never the command: an Execute payload
    may be 100 MB) and the reply, or None when the reply was too large to keep."""

    command_digest: bytes
    command_name: str
    reply: Reply | None


def command_digest(command: Command) -> bytes:
    """Identity of a command regardless of its epoch: a retry across an epoch bump is the same."""
    return hashlib.blake2b(encode(msgspec.structs.replace(command, epoch=0)), digest_size=16).digest()


@dataclass(frozen=True)
class PendingEffect:
    """The effect the shell performs now: its command and what completing it needs."""

    command: Command
    sleep_plan: SleepPlan | None = None  # Sleep: what to offload and discard
    wake_tags: frozenset[str] = frozenset()  # Wake: the tags it maps back
    state_before: W | None = None  # ReloadWeights, Wake: where a refusal returns to
    evict: tuple[str, ...] = ()  # AddAdapter: the adapters its load evicts (P-20)


# Digest, names and bookkeeping of one cache entry, counted against the byte budget.
_ENTRY_OVERHEAD_BYTES = 256


class InvariantViolation(AssertionError):
    """The core reached a state its invariants forbid: a bug in omni-core, not in the caller."""


class WorkInProgress:
    """What a rank has taken on and not yet completed: one lifecycle effect (`pending`), or a
    batch of requests (`running`, in arrival order, at most `max_in_flight`), never both:
    nothing moves memory under a running request, and beside a batch only more requests run.

    `busy_with` says why a command must wait (the rank's BUSY); `begin` and `run` take work
    on, `take` hands back the work an effect completion names."""

    def __init__(self, max_in_flight: int = 1) -> None:
        if not 1 <= max_in_flight <= MAX_IN_FLIGHT_PER_RANK:
            raise ValueError(f"max_in_flight must be in 1..{MAX_IN_FLIGHT_PER_RANK}, got {max_in_flight!r}")
        # Requests this rank holds at once (the stage's max_in_flight): the shell hands them
        # to the runner together, and nothing else runs beside them.
        self.max_in_flight = max_in_flight
        self.pending: PendingEffect | None = None
        self.running: dict[str, Execute] = {}
        # Pause mode keep (HoldRequests): the batch is frozen where it is; beside it only the
        # commands of BESIDE_HELD run (an in-flight refit), and the release lets it go on.
        self.held = False

    @property
    def busy(self) -> bool:
        return self.pending is not None or bool(self.running)

    @property
    def task_ids(self) -> tuple[str, ...]:
        """The lifecycle effect's task, or the batch's requests in arrival order."""
        pending = (self.pending.command.task_id,) if self.pending is not None else ()
        return pending + tuple(self.running)

    def command(self, task_id: str) -> Command | None:
        """The command of this task whose effect is under way (lifecycle or request), if any."""
        if self.pending is not None and self.pending.command.task_id == task_id:
            return self.pending.command
        return self.running.get(task_id)

    def busy_with(self, command: Command) -> str:
        """Why `command` must wait (BUSY), or "": one lifecycle effect at a time, and beside a
        batch of requests only more requests, up to max_in_flight. A Status never waits."""
        if isinstance(command, Status):
            return ""
        if self.pending is not None:
            return f"task {self.pending.command.task_id!r} is in progress; retry after its reply"
        if self.running and self.held and not isinstance(command, (HoldRequests, *BESIDE_HELD)):
            first = next(iter(self.running))
            beside = " or ".join(kind.__name__ for kind in BESIDE_HELD)
            return (
                f"{len(self.running)} requests are held on this rank (first {first!r}, pause mode keep); "
                f"{type(command).__name__} waits until HoldRequests(hold=false) releases them: only "
                f"{beside} runs beside them"
            )
        if self.running and self.beside_batch(command):
            return ""
        if self.running and not isinstance(command, Execute):
            first = next(iter(self.running))
            return (
                f"{len(self.running)} requests are running on this rank (first {first!r}); "
                f"{type(command).__name__} waits until they are answered: retry after their replies"
            )
        if len(self.running) >= self.max_in_flight:
            first = next(iter(self.running))
            return (
                f"request {first!r} and {len(self.running) - 1} more are in progress, this rank's "
                f"max_in_flight ({self.max_in_flight}); retry after a reply or raise the stage's max_in_flight"
            )
        return ""

    def beside_batch(self, command: Command) -> bool:
        """Whether `command`'s effect may run beside the batch: a hold freezing it, or (BESIDE_HELD)
        an update of the weights under it once it is held."""
        return isinstance(command, HoldRequests) or (self.held and isinstance(command, BESIDE_HELD))

    def begin(self, pending: PendingEffect) -> None:
        """Take on one lifecycle effect (or a Status): only while nothing else is under way,
        but for a hold or an update beside a held batch (`beside_batch`)."""
        if self.pending is not None or (self.running and not self.beside_batch(pending.command)):
            raise InvariantViolation(f"{pending.command!r} taken on while {list(self.task_ids)} are in progress")
        self.pending = pending

    def run(self, command: Execute) -> None:
        """Add a request to the batch in progress."""
        if self.pending is not None or len(self.running) >= self.max_in_flight:
            raise InvariantViolation(f"request {command.task_id!r} taken on beside {list(self.task_ids)}")
        self.running[command.task_id] = command

    def take(self, task_id: str) -> PendingEffect:
        """The work whose effect completed: a request of the batch, or the lifecycle effect."""
        running = self.running.pop(task_id, None)
        if running is not None:
            return PendingEffect(running)
        if self.pending is None or self.pending.command.task_id != task_id:
            have = self.pending.command.task_id if self.pending else None
            raise InvariantViolation(f"effect completion for task {task_id!r}, pending is {have!r}")
        pending, self.pending = self.pending, None
        return pending

    def check_invariants(self) -> str:
        """What is wrong with the work in progress on its own, or "" (the core's check asks it)."""
        if self.running and self.pending is not None and not self.beside_batch(self.pending.command):
            return "a lifecycle effect beside a running batch"
        if len(self.running) > self.max_in_flight:
            return "more requests running than max_in_flight"
        return ""


@dataclass(frozen=True)
class WorkerSnapshot:
    """A worker core's state as `WorkerCore.restore` takes it: a case, not a path to it (the
    agreement rows of omni_core.formal, tests). The lifecycle state, the epoch, the residency,
    the weights version, the failure it reports, the work in progress and the profiler."""

    state: W
    epoch: int = 0
    asleep: frozenset[str] = frozenset()
    weights_valid: bool = True
    weights_version: int = 0
    failure: str = ""
    pending: PendingEffect | None = None  # the lifecycle effect in progress
    running: tuple[Execute, ...] = ()  # or the batch of requests, in arrival order
    profiling: bool = False
