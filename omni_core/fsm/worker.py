"""Worker lifecycle: the transition table of one rank process and its sans-IO core.

`WorkerCore.on_command` takes a decoded command and returns a `WorkerStep`: the replies to
send now and at most one effect for the shell to perform. When the effect is done the
shell calls `on_done` (or `on_error`) and gets the terminal reply. Same state and input,
same output: the core reads no clock and touches no memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from omni_core.fsm.effects import (
    Effect,
    ExecuteEffect,
    ProfileEffect,
    ReloadEffect,
    ShareEffect,
    ShutdownEffect,
    SleepEffect,
    StatusEffect,
    UpdateEffect,
    WakeEffect,
    WeightGroupEffect,
)
from omni_core.fsm.reply_cache import DEFAULT_REPLY_CACHE_BYTES, DEFAULT_REPLY_CACHE_ENTRIES, BoundedCache
from omni_core.fsm.settle import REFUSAL_REASON, settle_row
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import DEFAULT_TAGS, Residency, SleepPlan, UnknownTagError, plan_sleep, resolve_tags
from omni_core.fsm.trace_records import (
    BadMessage,
    EffectDone,
    EffectFailed,
    EffectRefused,
    ReplySent,
    WorkerChanged,
    WorkerReceived,
    WorkerRecord,
    WorkerStarted,
    clip,
)
from omni_core.fsm.worker_table import IDLE, REFUSED, WORKER_TRANSITIONS
from omni_core.protocol import (
    Ack,
    AckStatus,
    Capability,
    Command,
    Execute,
    Hello,
    InitWeightGroup,
    MemoryReport,
    Nack,
    NackReason,
    Profile,
    ProtocolError,
    ReloadWeights,
    Reply,
    Result,
    ShareWeights,
    Shutdown,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
    encode,
    profile_prefix_problem,
)
from omni_core.protocol import WorkerState as W

# Epochs grow by one per restart, and a restart spawns fresh ranks: a live rank never needs
# to jump far ahead. A bounded window stops one command (epoch 2**64-1) from fencing the
# rank off from every normal epoch for good.
MAX_EPOCH_AHEAD = 64

ALL_CAPABILITIES: tuple[Capability, ...] = (
    Capability.LEVEL2,
    Capability.PARTIAL_WAKE,
    Capability.SWAP,
    Capability.WEIGHT_UPDATE,
)
HELLO_TASK_ID = "hello"  # the task id every Hello carries
_NO_LINKS = (
    "this worker copies over its own host link only (capability 'multi_path' not declared); "
    "send the command without links"
)
_REPLY_KINDS = {Ack: "ack", Nack: "nack", Result: "result", Hello: "hello"}


def _sent(reply: Reply, *, to_bad_bytes: bool = False) -> ReplySent:
    info = reply.status.value if isinstance(reply, Ack) else reply.reason.value if isinstance(reply, Nack) else ""
    state = reply.state.value if isinstance(reply, (Ack, Nack)) else ""
    return ReplySent(reply.epoch, reply.task_id, _REPLY_KINDS[type(reply)], state, info, to_bad_bytes)


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


# Digest, names and bookkeeping of one cache entry, counted against the byte budget.
_ENTRY_OVERHEAD_BYTES = 256


class InvariantViolation(AssertionError):
    """The core reached a state its invariants forbid: a bug in omni-core, not in the caller."""


class WorkerCore:
    """Lifecycle of one worker rank: legality, idempotence, fencing. No IO."""

    def __init__(
        self,
        rank: int,
        *,
        tags: tuple[str, ...] = DEFAULT_TAGS,
        epoch: int = 0,
        capabilities: tuple[Capability, ...] = ALL_CAPABILITIES,
        reply_cache_entries: int = DEFAULT_REPLY_CACHE_ENTRIES,
        reply_cache_bytes: int = DEFAULT_REPLY_CACHE_BYTES,
        weights_version: int = 0,
    ) -> None:
        self.rank = rank
        # The version of the weights held (or, in NEEDS_RELOAD, held last): 0 is the runner's
        # own source; an update sets it once every bucket is written (P-17).
        self.weights_version = weights_version
        self.weight_group: InitWeightGroup | None = None  # the group joined, as asked
        self.tags = tags
        self.epoch = epoch
        self.capabilities = frozenset(capabilities)
        self.residency = Residency(tags)
        self.lifecycle: Lifecycle[W] = Lifecycle(W, WORKER_TRANSITIONS, W.LOADING)
        self.cache: BoundedCache[str, _CachedReply] = BoundedCache(reply_cache_entries, reply_cache_bytes)
        self.counters = WorkerCounters()
        self.failure: str = ""
        self._pending: _Pending | None = None
        self._handlers = {
            Sleep: self.on_sleep,
            Wake: self.on_wake,
            ReloadWeights: self.on_reload_weights,
            Execute: self.on_execute,
            Status: self.on_status,
            Shutdown: self.on_shutdown,
            Profile: self.on_profile,
            UpdateWeights: self.on_update_weights,
            InitWeightGroup: self.on_init_weight_group,
            ShareWeights: self.on_share_weights,
        }
        # Orthogonal to the lifecycle: a profile may span sleeps and wakes (P-15).
        self.profiling = False

    # ------------------------------------------------------------------ queries

    @property
    def state(self) -> W:
        return self.lifecycle.state

    @property
    def busy(self) -> bool:
        return self._pending is not None

    # ------------------------------------------------------------------ inputs

    def loaded(self, backend: str = "", capabilities: Iterable[Capability] | None = None) -> WorkerStep:
        """The shell finished loading the runner: LOADING -> ACTIVE. The records say so and
        that the Hello goes out (the shell builds it: pid, proof and device are its).
        `capabilities`, when given, are the ones the load settled (a backend chosen at load
        relays through peers or not; a loaded runner takes weight updates)."""
        if capabilities is not None:
            self.capabilities = frozenset(capabilities)
        self.lifecycle.fire("loaded")
        self._check_invariants()
        return self._started(backend, "")

    def load_failed(self, error: str, backend: str = "") -> WorkerStep:
        self.failure = f"load failed: {error}"
        self.lifecycle.fire("fail")
        self._check_invariants()
        return self._started(backend, error)

    def _started(self, backend: str, error: str) -> WorkerStep:
        hello = ReplySent(self.epoch, HELLO_TASK_ID, "hello", self.state.value)
        return WorkerStep(records=(WorkerStarted(self.state.value, self.tags, backend, clip(error)), hello))

    def on_bad_message(self, error: ProtocolError) -> WorkerStep:
        """Bytes that did not decode (P-10): refuse them and keep serving."""
        self.counters.bad_messages += 1
        nack = self._nack_raw(error)
        head = BadMessage(error.task_id or "", error.epoch if error.epoch is not None else -1, clip(error.detail))
        return WorkerStep(replies=(nack,), records=(head, _sent(nack, to_bad_bytes=True)))

    def on_command(self, command: Command) -> WorkerStep:
        before = self.state
        head = WorkerReceived(command.epoch, command.task_id, type(command).__name__, before.value)
        step = self._on_command(command)
        self._check_invariants()
        return self._traced(step, head, before, command.task_id)

    def _traced(self, step: WorkerStep, head: WorkerRecord, before: W, task_id: str) -> WorkerStep:
        """`step` with its records: what happened, the change of state it made, the replies."""
        changed = () if self.state is before else (WorkerChanged(task_id, before.value, self.state.value),)
        records = (head, *changed, *(_sent(r) for r in step.replies))
        return WorkerStep(step.replies, step.effect, records)

    def on_done(
        self,
        task_id: str,
        *,
        memory: MemoryReport | None = None,
        output: Any = None,
        duration_s: float = 0.0,
        path: str = "",
        trace_paths: tuple[str, ...] = (),
        shared: Any = None,
    ) -> WorkerStep:
        """The shell performed the pending effect (`path`: how the backend did it, traced;
        `trace_paths`: the files a Profile stop wrote)."""
        before = self.state
        pending = self._take_pending(task_id)
        command = pending.command
        if isinstance(command, Execute):
            reply: Reply = Result(
                task_id=task_id,
                epoch=self.epoch,
                rank=self.rank,
                output=output,
                duration_s=duration_s,
                weights_version=self.weights_version,
            )
        else:
            if isinstance(command, Sleep):
                assert pending.sleep_plan is not None
                self.residency.apply_sleep(pending.sleep_plan)
                self.lifecycle.fire("offloaded")
            elif isinstance(command, Wake):
                self.residency.apply_wake(pending.wake_tags)
                self.lifecycle.fire(settle_row(self.residency.settled()).after_wake)
            elif isinstance(command, (ReloadWeights, UpdateWeights)):
                self.residency.apply_reload()
                trigger = settle_row(self.residency.settled()).after_reload
                if trigger is None:
                    raise InvariantViolation(f"a reload cannot settle in {self.residency.settled().value}")
                self.lifecycle.fire(trigger)
                # A reload brings the runner's own weights back: no update's version stands for them.
                self.weights_version = command.version if isinstance(command, UpdateWeights) else 0
            elif isinstance(command, InitWeightGroup):
                self.weight_group = command
            elif isinstance(command, Profile):
                self.profiling = command.start
            reply = self._ack(
                command,
                AckStatus.OK,
                memory=memory,
                duration_s=duration_s,
                trace_paths=trace_paths if isinstance(command, Profile) else (),
                shared=shared if isinstance(command, ShareWeights) else None,
            )
        if not isinstance(command, Status):
            self._remember(command, reply)
        self._check_invariants()
        head = EffectDone(task_id, type(command).__name__, self.state.value, duration_s, path)
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)

    def on_refused(self, task_id: str, detail: str, reason: NackReason | None = None) -> WorkerStep:
        """The pending effect was refused before it changed anything, and the rank is back in
        the state the command started from: a ReloadWeights whose source the runner refused
        before writing (NACK INVALID_ARGUMENT), or a Wake that found too little free device
        memory in time and unmapped what it had mapped (NACK NO_MEMORY, P-16). Cached, like an
        EXECUTE_ERROR: the effect was attempted and this is its answer, so a copy of the task
        gets it again instead of passing through RELOADING once more (TLC found that a copy
        judged afresh moved a rank of a NEEDS_RELOAD stage back into RELOADING)."""
        before = self.state
        pending = self._take_pending(task_id)
        kind = type(pending.command)
        trigger = REFUSED.get((kind, pending.state_before))  # type: ignore[arg-type]
        if trigger is None:
            raise InvariantViolation(
                f"only a pending ReloadWeights, UpdateWeights or Wake can be refused, not "
                f"{pending.command!r} "
                f"(started in {pending.state_before})"
            )
        if reason is not None and reason is not REFUSAL_REASON[kind]:
            raise InvariantViolation(
                f"a {kind.__name__} is refused with {REFUSAL_REASON[kind].value}, not {reason.value}"
            )
        self.lifecycle.fire(trigger)
        name = kind.__name__
        effect = "nothing was written" if kind is not Wake else "nothing it mapped is kept, every tag is as before"
        reply = self._nack(
            pending.command, REFUSAL_REASON[kind], f"{name} task {task_id!r} refused, {effect}: {detail}"
        )
        self._remember(pending.command, reply)
        self._check_invariants()
        head = EffectRefused(task_id, name, self.state.value, clip(detail))
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)

    def on_error(self, task_id: str, error: str) -> WorkerStep:
        """The pending effect raised. A lifecycle effect leaves the worker FAILED, saying why
        in every later reply; a failed Execute is only that request's error."""
        before = self.state
        pending = self._take_pending(task_id)
        name = type(pending.command).__name__
        what = f"{name} task {task_id!r} failed: {error}"
        if isinstance(pending.command, Execute):
            # A request the runner rejects says nothing about the memory: stay ACTIVE.
            reply = self._nack(pending.command, NackReason.EXECUTE_ERROR, what)
            self._remember(pending.command, reply)
            head = EffectFailed(task_id, name, self.state.value, clip(error))
            return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)
        if isinstance(pending.command, UpdateWeights):
            # Writing began: the weights are neither the old version nor the new one. They stay
            # mapped, so the rank waits in NEEDS_RELOAD for a reload or another update (P-17).
            self.residency.weights_valid = False
            self.lifecycle.fire("update_failed")
            reply = self._nack(
                pending.command,
                NackReason.UPDATE_FAILED,
                f"{what}; the weights are invalid, this rank is NEEDS_RELOAD and still at weights "
                f"version {self.weights_version}: update again or reload",
            )
            self._remember(pending.command, reply)
            self._check_invariants()
            head = EffectFailed(task_id, name, self.state.value, clip(error))
            return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)
        if isinstance(pending.command, (InitWeightGroup, ShareWeights)):
            # No pool memory moved: the rank keeps its state (and has no group, or shares nothing).
            after = (
                "this rank joined no weight group"
                if isinstance(pending.command, InitWeightGroup)
                else "this rank shares no weights now"
            )
            reply = self._nack(pending.command, NackReason.INVALID_ARGUMENT, f"{what}; {after}")
            self._remember(pending.command, reply)
            head = EffectFailed(task_id, name, self.state.value, clip(error))
            return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)
        if isinstance(pending.command, Profile):
            # The profiler is not memory: the rank keeps its state and serves on. The shell
            # drops a profiler that failed, so none runs now, whichever way it failed.
            self.profiling = False
            reply = self._nack(
                pending.command, NackReason.PROFILE_ERROR, f"{what}; no profile is running on this rank now"
            )
            self._remember(pending.command, reply)
            self._check_invariants()
            head = EffectFailed(task_id, name, self.state.value, clip(error))
            return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)
        self.failure = what
        if self.lifecycle.allows("fail"):
            self.lifecycle.fire("fail")
        reply = self._nack(pending.command, NackReason.BACKEND_ERROR, self.failure)
        if not isinstance(pending.command, Status):  # Status is never cached (as in on_done)
            self._remember(pending.command, reply)
        self._check_invariants()
        head = EffectFailed(task_id, name, self.state.value, clip(error))
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)

    # ------------------------------------------------------------------ handlers

    def _on_command(self, command: Command) -> WorkerStep:
        if command.epoch < self.epoch:
            self.counters.stale_epoch_refused += 1
            return self._refuse(
                command,
                NackReason.STALE_EPOCH,
                f"command epoch {command.epoch} is older than this worker's "
                f"epoch {self.epoch}; a newer orchestrator has fenced it",
            )
        if command.epoch > self.epoch + MAX_EPOCH_AHEAD:
            self.counters.epoch_ahead_refused += 1
            return self._refuse(
                command,
                NackReason.EPOCH_AHEAD,
                f"command epoch {command.epoch} is more than {MAX_EPOCH_AHEAD} ahead of "
                f"this worker's epoch {self.epoch}; restart the rank under the new epoch",
            )
        self.epoch = command.epoch
        if self._pending is not None and self._pending.command.task_id == command.task_id:
            original = self._pending.command
            if msgspec.structs.replace(command, epoch=original.epoch) != original:
                return self._refuse(
                    command,
                    NackReason.TASK_ID_REUSED,
                    f"task_id {command.task_id!r} is in progress for {original!r}; use a fresh task_id per command",
                )
            # The terminal reply follows when the effect completes; answering now too
            # would be a second reply for the task (P-1).
            self.counters.duplicates_in_flight_ignored += 1
            return WorkerStep()
        # Before BUSY: an answered task keeps its one reply even while another runs (P-1, P-2).
        if not isinstance(command, Status):
            cached = self.cache.get(command.task_id)
            if cached is not None:
                if command_digest(command) != cached.command_digest:
                    return self._refuse(
                        command,
                        NackReason.TASK_ID_REUSED,
                        f"task_id {command.task_id!r} was already used for a different "
                        f"{cached.command_name}; use a fresh task_id per command",
                    )
                self.counters.duplicates_answered_from_cache += 1
                if cached.reply is None:
                    return self._refuse(
                        command,
                        NackReason.REPLY_NOT_KEPT,
                        f"task {command.task_id!r} was answered already; its reply was too "
                        "large for the reply cache, so the first reply is the only one",
                    )
                return WorkerStep(replies=(cached.reply,))
        if self._pending is not None and not isinstance(command, Status):
            step = self._refuse(
                command,
                NackReason.BUSY,
                f"task {self._pending.command.task_id!r} is in progress; retry after its reply",
            )
            if isinstance(command, (Execute, Profile)):
                # Recorded: the stage takes this BUSY as the rank's answer to the request (or
                # the Profile), so a copy arriving after the task in progress must get it again,
                # not run (P-1; TLC found the hole with an asynchronous shell, for Execute and
                # again for Profile: tla/README.md).
                self._remember(command, step.replies[0])
            return step
        if self.state is W.FAILED and not isinstance(command, (Shutdown, Status)):
            return self._refuse(
                command,
                NackReason.FAILED,
                f"worker is FAILED ({self.failure}); only Shutdown or a restart leaves FAILED",
            )
        return self._handlers[type(command)](command)

    def on_sleep(self, command: Sleep) -> WorkerStep:
        try:
            tags = resolve_tags(command.tags, self.tags)
        except UnknownTagError as exc:
            return self._refuse(command, NackReason.UNKNOWN_TAG, str(exc))
        if command.level == 2 and Capability.LEVEL2 not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker does not support level-2 sleep (capability 'level2' not declared); use level=1",
            )
        if command.links and Capability.MULTI_PATH not in self.capabilities:
            return self._refuse(command, NackReason.UNSUPPORTED, _NO_LINKS)
        to_sleep = tags - self.residency.asleep
        if not to_sleep and self.lifecycle.allows("sleep_already"):
            return self._already(command, "sleep_already")
        if not self.lifecycle.allows("sleep"):
            return self._refuse_state(command)
        plan = plan_sleep(command.level, to_sleep, weights_valid=self.residency.weights_valid)
        self.lifecycle.fire("sleep")
        self._pending = _Pending(command, sleep_plan=plan)
        return WorkerStep(effect=SleepEffect(command.task_id, command.level, plan.offload, plan.discard, command.links))

    def on_wake(self, command: Wake) -> WorkerStep:
        try:
            tags = resolve_tags(command.tags, self.tags)
        except UnknownTagError as exc:
            return self._refuse(command, NackReason.UNKNOWN_TAG, str(exc))
        to_wake = tags & self.residency.asleep
        if not to_wake and self.lifecycle.allows("wake_already"):
            return self._already(command, "wake_already")
        if to_wake != self.residency.asleep and Capability.PARTIAL_WAKE not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker does not support partial wake; wake every asleep tag (tags=None)",
            )
        if command.links and Capability.MULTI_PATH not in self.capabilities:
            return self._refuse(command, NackReason.UNSUPPORTED, _NO_LINKS)
        if command.wait_for_memory_s > 0 and Capability.SWAP not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker cannot wait for free device memory "
                "(capability 'swap' not declared); send the Wake with wait_for_memory_s=0",
            )
        if not self.lifecycle.allows("wake"):
            return self._refuse_state(command)
        before = self.state
        self.lifecycle.fire("wake")
        self._pending = _Pending(command, wake_tags=frozenset(to_wake), state_before=before)
        return WorkerStep(effect=WakeEffect(command.task_id, to_wake, command.wait_for_memory_s, command.links))

    def on_reload_weights(self, command: ReloadWeights) -> WorkerStep:
        if not self.lifecycle.allows("reload"):
            return self._refuse_state(
                command, "ReloadWeights needs NEEDS_RELOAD (after a level-2 sleep and a wake of 'weights') or ACTIVE"
            )
        state_before = self.state
        self.lifecycle.fire("reload")
        self._pending = _Pending(command, state_before=state_before)
        return WorkerStep(effect=ReloadEffect(command.task_id, command.source))

    def on_update_weights(self, command: UpdateWeights) -> WorkerStep:
        if Capability.WEIGHT_UPDATE not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker does not take weight updates (capability 'weight_update' not declared); use ReloadWeights",
            )
        if not self.lifecycle.allows("update") or not self.residency.weights_resident:
            return self._refuse_state(
                command,
                "UpdateWeights needs the weights resident: ACTIVE, PARTIAL "
                "with 'weights' awake, or NEEDS_RELOAD; wake 'weights' first",
            )
        if command.version <= self.weights_version:
            return self._refuse(
                command,
                NackReason.STALE_VERSION,
                f"weights version {command.version} is not above this rank's version "
                f"{self.weights_version}; send a higher version (nothing was written)",
            )
        state_before = self.state
        self.lifecycle.fire("update")
        self._pending = _Pending(command, state_before=state_before)
        return WorkerStep(effect=UpdateEffect(command.task_id, command.version, command.source))

    def on_init_weight_group(self, command: InitWeightGroup) -> WorkerStep:
        if Capability.WEIGHT_UPDATE not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker does not take weight updates (capability 'weight_update' not declared)",
            )
        joined = self.weight_group
        same = (
            joined is not None
            and msgspec.structs.replace(joined, task_id=command.task_id, epoch=command.epoch) == command
        )
        if same and self.lifecycle.allows("weight_group_already"):
            return self._already(command, "weight_group_already")
        if not self.lifecycle.allows("weight_group"):
            return self._refuse_state(command, "InitWeightGroup is legal in ACTIVE, SLEEPING, PARTIAL and NEEDS_RELOAD")
        if joined is not None:
            return self._refuse(
                command,
                NackReason.INVALID_ARGUMENT,
                f"this rank already joined weight group {joined.group!r} at "
                f"{joined.address}:{joined.port}; restart the stage to join another",
            )
        self.lifecycle.fire("weight_group")
        self._pending = _Pending(command)
        return WorkerStep(effect=WeightGroupEffect(command.task_id, command))

    def on_share_weights(self, command: ShareWeights) -> WorkerStep:
        if Capability.WEIGHT_UPDATE not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker does not share weights (capability 'weight_update' not declared)",
            )
        res = self.residency
        if not self.lifecycle.allows("share") or not (res.weights_resident and res.weights_valid):
            return self._refuse_state(
                command, "ShareWeights needs valid weights awake: ACTIVE, or PARTIAL with 'weights' awake"
            )
        self.lifecycle.fire("share")
        self._pending = _Pending(command)
        return WorkerStep(effect=ShareEffect(command.task_id, command.bucket_bytes))

    def on_execute(self, command: Execute) -> WorkerStep:
        if not self.lifecycle.allows("execute"):
            return self._refuse_state(
                command, "Execute runs only in ACTIVE, where every tag is resident and the weights are valid"
            )
        self.lifecycle.fire("execute")
        self._pending = _Pending(command)
        return WorkerStep(effect=ExecuteEffect(command.task_id, command.payload))

    def on_status(self, command: Status) -> WorkerStep:
        self.lifecycle.fire("status")  # legal in every state; firing keeps the table the source
        if self._pending is not None:
            # Busy: answer from what the core knows; the shell is inside an effect.
            return WorkerStep(replies=(self._ack(command, AckStatus.OK),))
        self._pending = _Pending(command)
        return WorkerStep(effect=StatusEffect(command.task_id))

    def on_profile(self, command: Profile) -> WorkerStep:
        if command.start:
            problem = profile_prefix_problem(command.prefix)
            if problem is not None:
                return self._refuse(command, NackReason.INVALID_ARGUMENT, problem)
        if command.start == self.profiling and self.lifecycle.allows("profile_already"):
            # Start while running keeps the running profile (and its prefix); stop while none
            # runs has nothing to write: the Ack's trace_paths is empty.
            return self._already(command, "profile_already")
        if not self.lifecycle.allows("profile"):
            return self._refuse_state(
                command,
                "Profile is legal in ACTIVE, SLEEPING, PARTIAL and "
                "NEEDS_RELOAD (a rank that is loading or stopped has no profile)",
            )
        self.lifecycle.fire("profile")
        self._pending = _Pending(command)
        return WorkerStep(effect=ProfileEffect(command.task_id, command.start, command.prefix))

    def on_shutdown(self, command: Shutdown) -> WorkerStep:
        if self.lifecycle.allows("shutdown_already"):
            return self._already(command, "shutdown_already")
        self.lifecycle.fire("shutdown")
        self.profiling = False  # the shell drops a running profile with the process
        self._pending = _Pending(command)
        return WorkerStep(effect=ShutdownEffect(command.task_id))

    # ------------------------------------------------------------------ replies

    def _already(self, command: Command, trigger: str) -> WorkerStep:
        self.lifecycle.fire(trigger)
        reply = self._ack(command, AckStatus.ALREADY)
        self._remember(command, reply)
        return WorkerStep(replies=(reply,))

    def _remember(self, command: Command, reply: Reply) -> None:
        """Keep the terminal reply for duplicates, within the cache's bytes: a reply larger
        than a quarter of the budget is kept as its digest only (REPLY_NOT_KEPT on a retry)."""
        size_bytes = len(encode(reply))
        kept: Reply | None = reply
        if size_bytes > self.cache.max_bytes // 4:
            kept, size_bytes = None, 0
            self.counters.replies_not_kept += 1
        entry = _CachedReply(command_digest(command), type(command).__name__, kept)
        self.cache.put(command.task_id, entry, size_bytes + _ENTRY_OVERHEAD_BYTES)

    def _refuse_state(self, command: Command, hint: str = "") -> WorkerStep:
        name = type(command).__name__
        detail = f"{name} is not allowed in state {self.state.value}"
        return self._refuse(command, NackReason.INVALID_STATE, f"{detail}; {hint}" if hint else detail)

    def _refuse(self, command: Command, reason: NackReason, detail: str) -> WorkerStep:
        # Refusals are not cached: they had no effect, and a retry after the state changed
        # (e.g. Execute after a wake) deserves a fresh answer. Stale epochs stay stale.
        return WorkerStep(replies=(self._nack(command, reason, detail),))

    def _ack(
        self,
        command: Command,
        status: AckStatus,
        *,
        memory: MemoryReport | None = None,
        duration_s: float = 0.0,
        trace_paths: tuple[str, ...] = (),
        shared: Any = None,
    ) -> Ack:
        return Ack(
            task_id=command.task_id,
            epoch=self.epoch,
            rank=self.rank,
            command=type(command).__name__,
            state=self.state,
            status=status,
            asleep_tags=tuple(sorted(self.residency.asleep)),
            memory=memory,
            duration_s=duration_s,
            detail=self.failure,
            trace_paths=trace_paths,
            weights_version=self.weights_version,
            shared=shared,
        )

    def _nack(self, command: Command, reason: NackReason, detail: str) -> Nack:
        return Nack(
            task_id=command.task_id,
            epoch=max(command.epoch, 0),
            rank=self.rank,
            command=type(command).__name__,
            reason=reason,
            detail=self._with_failure(detail),
            state=self.state,
            weights_version=self.weights_version,
        )

    def _nack_raw(self, error: ProtocolError) -> Nack:
        return Nack(
            task_id=error.task_id or "-",
            epoch=self.epoch if error.epoch is None else error.epoch,
            rank=self.rank,
            command="?",
            reason=error.reason,
            detail=self._with_failure(error.detail),
            state=self.state,
        )

    def _with_failure(self, detail: str) -> str:
        """After a failure every reply says what failed (P-11), whatever else it says."""
        if self.failure and self.failure not in detail:
            suffix = f"; worker failed earlier: {self.failure}"[:2048]
            detail = detail[: 4096 - len(suffix)] + suffix  # a long detail must not cut it off
        return detail[:4096]

    def _take_pending(self, task_id: str) -> _Pending:
        if self._pending is None or self._pending.command.task_id != task_id:
            have = self._pending.command.task_id if self._pending else None
            raise InvariantViolation(f"effect completion for task {task_id!r}, pending is {have!r}")
        pending, self._pending = self._pending, None
        return pending

    # ------------------------------------------------------------------ invariants

    def _check_invariants(self) -> None:
        """TigerBeetle-style: after every input, positive and negative space."""
        state, res = self.state, self.residency
        asleep = res.asleep

        def require(cond: bool, what: str) -> None:
            if not cond:
                raise InvariantViolation(f"worker rank {self.rank} in {state.value}: {what}")

        require(asleep <= set(self.tags), f"asleep tags {sorted(asleep)} not all known")
        require(len(self.cache) <= self.cache.max_entries, "reply cache over its bound")
        require(self.cache.size_bytes <= self.cache.max_bytes, "reply cache over its byte bound")
        transient = state in (W.OFFLOADING, W.RESTORING, W.RELOADING)
        if transient:
            require(self._pending is not None, "transient state without a pending effect")
        if state is W.ACTIVE:
            require(not asleep and res.weights_valid, "ACTIVE with tags asleep or weights invalid")
        if state is W.SLEEPING:
            require(bool(asleep), "SLEEPING with nothing asleep")
        if state is W.PARTIAL:
            require(bool(asleep), "PARTIAL with nothing asleep")
        if state is W.NEEDS_RELOAD:
            require(res.weights_resident and not res.weights_valid, "NEEDS_RELOAD needs resident, invalid weights")
        if self._pending is not None and isinstance(self._pending.command, Execute):
            require(state is W.ACTIVE, "Execute pending outside ACTIVE")
        if self._pending is not None and isinstance(self._pending.command, (Profile, InitWeightGroup)):
            require(state in IDLE, "Profile or InitWeightGroup pending outside ACTIVE/SLEEPING/PARTIAL/NEEDS_RELOAD")
        if self._pending is not None and isinstance(self._pending.command, ShareWeights):
            require(
                state in (W.ACTIVE, W.PARTIAL) and res.weights_valid and res.weights_resident,
                "ShareWeights pending without valid weights awake",
            )
        if self._pending is not None and isinstance(self._pending.command, UpdateWeights):
            require(state is W.RELOADING, "UpdateWeights pending outside RELOADING")
            require(self._pending.command.version > self.weights_version, "an update pending at or below the version")
        if self.profiling:
            require(state not in (W.LOADING, W.STOPPED), "a profile running in LOADING or STOPPED")
