"""What the worker core hands out and keeps: its step, its counters, the cached reply of a
task, the effect in progress, and the one error that is a bug in omni-core itself."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec

from omni_core.fsm.effects import Effect
from omni_core.fsm.tags import SleepPlan
from omni_core.fsm.trace_records import ReplySent, WorkerRecord
from omni_core.protocol import Ack, Capability, Command, Hello, Nack, Reply, Result, encode
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
class _Pending:
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
