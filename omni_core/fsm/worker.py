"""Worker lifecycle: the sans-IO core of one rank process.

One door: `WorkerCore.step(input)` takes a typed input (`worker_inputs`: the runner loaded or
failed to, a command decoded or bytes that did not decode, the pending effect completed,
declined or raised) and returns a `WorkerStep`: the replies to send now, at most one effect
for the shell to perform, and the trace records. The invariants are checked after every
input. Same state and input, same output: the core reads no clock and touches no memory.

One class holds the rank's state, each field declared once in `__init__`; the reply cache
(`reply_cache.BoundedCache`) and the LoRA adapter table (`adapters.AdapterTable`) are
components with their own bounds. The methods come in the order an input meets them: the
door, the command's fence (epoch, reply cache, BUSY), one handler per command (each checking
legality against WORKER_TRANSITIONS and starting at most one effect), the adapter commands,
the effect completions, the replies, the invariants. The table is in `worker_table`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from omni_core.fsm.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, AdapterTable
from omni_core.fsm.effects import (
    AdapterEffect,
    CommandEffect,
    ExecuteEffect,
    HoldEffect,
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
from omni_core.fsm.settle import REFIT_ASLEEP, REFUSAL_REASON, settle_row
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import (
    ADAPTERS_TAG,
    DEFAULT_TAGS,
    WEIGHTS_TAG,
    Residency,
    UnknownTagError,
    plan_sleep,
    resolve_tags,
)
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
from omni_core.fsm.version_spans import VersionSpans
from omni_core.fsm.worker_inputs import (
    BadFrame,
    CommandReceived,
    EffectCompleted,
    EffectDeclined,
    EffectRaised,
    Loaded,
    LoadFailed,
    WorkerInput,
)
from omni_core.fsm.worker_step import (
    _ENTRY_OVERHEAD_BYTES,
    ALL_CAPABILITIES,
    HELLO_TASK_ID,
    MAX_EPOCH_AHEAD,
    InvariantViolation,
    PendingEffect,
    WorkerCounters,
    WorkerSnapshot,
    WorkerStep,
    WorkInProgress,
    _CachedReply,
    _sent,
    command_digest,
)
from omni_core.fsm.worker_table import BESIDE_HELD, IDLE, REFUSED, WORKER_CALLS, WORKER_TRANSITIONS
from omni_core.protocol import (
    MAX_DETAIL_CHARS,
    Ack,
    AckStatus,
    AddAdapter,
    Capability,
    Command,
    Execute,
    HoldRequests,
    InitWeightGroup,
    ListAdapters,
    MemoryReport,
    Nack,
    NackReason,
    PinAdapter,
    Profile,
    ProtocolError,
    ReloadWeights,
    RemoveAdapter,
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

__all__ = [
    "ALL_CAPABILITIES",
    "HELLO_TASK_ID",
    "MAX_EPOCH_AHEAD",
    "BadFrame",
    "CommandReceived",
    "EffectCompleted",
    "EffectDeclined",
    "EffectRaised",
    "InvariantViolation",
    "LoadFailed",
    "Loaded",
    "WorkerCore",
    "WorkerCounters",
    "WorkerInput",
    "WorkerStep",
    "command_digest",
]


_NO_LINKS = (
    "this worker copies over its own host link only (capability 'multi_path' not declared); "
    "send the command without links"
)


ADAPTER_COMMANDS = (AddAdapter, RemoveAdapter, PinAdapter, ListAdapters)
# Acks that list the adapters (P-20): the adapter commands', and those of the commands that
# change what the adapters are (a sleep offloads or discards them, a reload or update leaves
# them stale), so the engine's view of them follows the ranks'.
ADAPTER_REPORTS = (*ADAPTER_COMMANDS, Sleep, Wake, ReloadWeights, UpdateWeights)


_WHERE = (
    "adapters are loaded, unloaded and pinned with valid weights awake: ACTIVE, or PARTIAL with "
    "'weights' awake (and 'adapters', the pool they live in, when the rank has that tag)"
)


WEIGHT_WRITES = (ReloadWeights, UpdateWeights)


def _boundaries(output: object) -> dict[str, int]:
    """A hold's completion: each held request's output tokens so far, by task id."""
    if not (
        isinstance(output, dict) and all(isinstance(k, str) and type(v) is int and v >= 0 for k, v in output.items())
    ):
        raise InvariantViolation(f"a hold completes with each request's tokens so far by task id, not {output!r}")
    return output


def _cache_names(output: object) -> tuple[str, ...]:
    """The derived caches a reload or an update dropped, as the shell reported them."""
    if output is None:
        return ()
    if not (isinstance(output, tuple) and all(isinstance(name, str) for name in output)):
        raise InvariantViolation(f"a weights write completes with the names of the caches it dropped, not {output!r}")
    return output


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
        max_loras: int = DEFAULT_MAX_LORAS,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        max_in_flight: int = 1,
    ) -> None:
        self.rank = rank
        self.work = WorkInProgress(max_in_flight)  # the lifecycle effect, or the batch of requests
        self.spans = VersionSpans()  # which version computed which tokens of each request (pause keep)
        # The version of the weights held (or, in NEEDS_RELOAD, held last): 0 is the runner's
        # own source; an update sets it once every bucket is written (P-17).
        self.weights_version = weights_version
        self.weight_group: InitWeightGroup | None = None  # the group joined, as asked
        self.tags = tags
        self.epoch = epoch
        self.capabilities = frozenset(capabilities)
        self.residency = Residency(tags)
        # The LoRA adapters (P-20), in their own pool when the rank has one, else the weights'.
        home = ADAPTERS_TAG if ADAPTERS_TAG in tags else WEIGHTS_TAG
        self.adapters = AdapterTable(max_loras, max_lora_rank, home)
        self.lifecycle: Lifecycle[W] = Lifecycle(W, WORKER_TRANSITIONS, W.LOADING)
        self.cache: BoundedCache[str, _CachedReply] = BoundedCache(reply_cache_entries, reply_cache_bytes)
        self.counters = WorkerCounters()
        self.failure: str = ""
        # Orthogonal to the lifecycle: a profile may span sleeps and wakes (P-15).
        self.profiling = False

    @property
    def state(self) -> W:
        return self.lifecycle.state

    @property
    def busy(self) -> bool:
        return self.work.busy

    @property
    def in_progress(self) -> tuple[str, ...]:
        """The tasks whose effects are under way, taken on and not yet completed: the
        lifecycle effect, or the requests of the batch in arrival order."""
        return self.work.task_ids

    @property
    def holding(self) -> bool:
        """The running requests are held (HoldRequests, pause mode keep): not to be stepped."""
        return self.work.held

    @property
    def max_in_flight(self) -> int:
        return self.work.max_in_flight

    def restore(self, snapshot: WorkerSnapshot) -> None:
        """Put the core in `snapshot`'s state, as if it had got there (a case of the agreement
        rows, a test's starting point), with an empty reply cache; what the snapshot does not
        name (capabilities, adapters, weight group, counters) stays as it was. Raises
        InvariantViolation where the snapshot is no state a rank can hold."""
        self.lifecycle.place(snapshot.state)
        self.epoch = snapshot.epoch
        self.residency = Residency(self.tags)
        self.residency.asleep, self.residency.weights_valid = frozenset(snapshot.asleep), snapshot.weights_valid
        self.weights_version = snapshot.weights_version
        self.failure = snapshot.failure
        self.profiling = snapshot.profiling
        self.work = WorkInProgress(self.work.max_in_flight)
        if snapshot.pending is not None:
            self.work.begin(snapshot.pending)
        self.spans = VersionSpans()
        for command in snapshot.running:
            self.work.run(command)
            self.spans.started(command.task_id, self.weights_version)
        self.cache = BoundedCache(self.cache.max_entries, self.cache.max_bytes)
        self._check_invariants()

    def step(self, event: WorkerInput) -> WorkerStep:
        """The one door: what the shell saw or did, in; what to send and do next, out."""
        match event:
            case CommandReceived():
                step = self._receive(event.command)
            case EffectCompleted():
                step = self._on_done(event)
            case EffectDeclined():
                step = self._on_refused(event)
            case EffectRaised():
                step = self._on_error(event)
            case BadFrame():
                step = self._on_bad_message(event.error)
            case Loaded():
                step = self._loaded(event.backend, event.capabilities, event.needs_reload)
            case LoadFailed():
                step = self._load_failed(event.error, event.backend)
            case _:
                raise InvariantViolation(f"the worker core takes no input {event!r}")
        self._check_invariants()
        return step

    def _loaded(self, backend: str, capabilities: Iterable[Capability] | None, needs_reload: bool) -> WorkerStep:
        """LOADING -> ACTIVE (NEEDS_RELOAD when the loaded weights are not to be served). The
        records say so and that the Hello goes out (the shell builds it: pid, proof and device
        are its)."""
        if capabilities is not None:
            self.capabilities = frozenset(capabilities)
        if needs_reload:
            self.residency.weights_valid = False
            self.lifecycle.fire("loaded_needs_reload")
            return self._started(backend, "")
        self.lifecycle.fire("loaded")
        return self._started(backend, "")

    def _load_failed(self, error: str, backend: str) -> WorkerStep:
        self.failure = f"load failed: {error}"
        self.lifecycle.fire("fail")
        return self._started(backend, error)

    def _started(self, backend: str, error: str) -> WorkerStep:
        hello = ReplySent(self.epoch, HELLO_TASK_ID, "hello", self.state.value, weights_version=self.weights_version)
        return WorkerStep(records=(WorkerStarted(self.state.value, self.tags, backend, clip(error)), hello))

    def _on_bad_message(self, error: ProtocolError) -> WorkerStep:
        """Bytes that did not decode (P-10): refuse them and keep serving."""
        self.counters.bad_messages += 1
        nack = self._nack_raw(error)
        head = BadMessage(error.task_id or "", error.epoch if error.epoch is not None else -1, clip(error.detail))
        return WorkerStep(replies=(nack,), records=(head, _sent(nack, to_bad_bytes=True)))

    def _receive(self, command: Command) -> WorkerStep:
        before = self.state
        head = WorkerReceived(command.epoch, command.task_id, type(command).__name__, before.value)
        return self._traced(self._on_command(command), head, before, command.task_id)

    def _on_command(self, command: Command) -> WorkerStep:
        """Fence the epoch, answer a copy from the reply cache, refuse while busy or FAILED;
        then the command's own handler."""
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
        original = self.work.command(command.task_id)
        if original is not None:
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
        busy_with = self.work.busy_with(command)
        if busy_with:
            step = self._refuse(command, NackReason.BUSY, busy_with)
            if isinstance(command, (Execute, Profile, *ADAPTER_COMMANDS)) or type(command) in WORKER_CALLS:
                # Recorded: the stage takes this BUSY as the rank's answer to the request (or
                # the Profile, or a command of WORKER_CALLS), so a copy arriving after the task
                # in progress must get it again, not run (P-1; an asynchronous shell would
                # otherwise run it twice: tla/README.md).
                self._remember(command, step.replies[0])
            return step
        if self.state is W.FAILED and not isinstance(command, (Shutdown, Status)):
            return self._refuse(
                command,
                NackReason.FAILED,
                f"worker is FAILED ({self.failure}); only Shutdown or a restart leaves FAILED",
            )
        match command:
            case Sleep():
                return self._on_sleep(command)
            case Wake():
                return self._on_wake(command)
            case ReloadWeights():
                return self._on_reload_weights(command)
            case UpdateWeights():
                return self._on_update_weights(command)
            case InitWeightGroup():
                return self._on_init_weight_group(command)
            case ShareWeights():
                return self._on_share_weights(command)
            case Execute():
                return self._on_execute(command)
            case HoldRequests():
                return self._on_hold(command)
            case Status():
                return self._on_status(command)
            case Profile():
                return self._on_profile(command)
            case Shutdown():
                return self._on_shutdown(command)
            case _ if isinstance(command, ADAPTER_COMMANDS):
                return self._on_adapter(command)
            case _ if type(command) in WORKER_CALLS:
                return self._on_call(command)
            case _:
                raise InvariantViolation(f"the worker core has no handler for {command!r}")

    def _traced(self, step: WorkerStep, head: WorkerRecord, before: W, task_id: str) -> WorkerStep:
        """`step` with its records: what happened, the change of state it made, the replies."""
        changed = () if self.state is before else (WorkerChanged(task_id, before.value, self.state.value),)
        records = (head, *changed, *(_sent(r) for r in step.replies))
        return WorkerStep(step.replies, step.effect, records)

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
        caches_dropped: tuple[str, ...] = (),
        adapters_evicted: tuple[str, ...] = (),
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
            caches_dropped=caches_dropped,
            adapters=self.adapters.infos() if isinstance(command, ADAPTER_REPORTS) else (),
            adapters_evicted=adapters_evicted,
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
            suffix = f"; worker failed earlier: {self.failure}"[: MAX_DETAIL_CHARS // 2]
            detail = detail[: MAX_DETAIL_CHARS - len(suffix)] + suffix  # a long detail must not cut it off
        return detail[:MAX_DETAIL_CHARS]

    def _check_invariants(self) -> None:
        """TigerBeetle-style: after every input, positive and negative space."""
        state, res, pending = self.state, self.residency, self.work.pending
        asleep = res.asleep

        def require(cond: bool, what: str) -> None:
            if not cond:
                raise InvariantViolation(f"worker rank {self.rank} in {state.value}: {what}")

        problem = self.work.check_invariants()
        require(not problem, problem)
        problem = self.spans.check_invariants(self.work.running, self.weights_version, self.work.held)
        require(not problem, problem)

        require(asleep <= set(self.tags), f"asleep tags {sorted(asleep)} not all known")
        require(len(self.cache) <= self.cache.max_entries, "reply cache over its bound")
        require(self.cache.size_bytes <= self.cache.max_bytes, "reply cache over its byte bound")
        transient = state in (W.OFFLOADING, W.RESTORING, W.RELOADING)
        if transient:
            require(pending is not None, "transient state without a pending effect")
        if state is W.ACTIVE:
            require(not asleep and res.weights_valid, "ACTIVE with tags asleep or weights invalid")
        if state is W.SLEEPING:
            require(bool(asleep), "SLEEPING with nothing asleep")
        if state is W.PARTIAL:
            require(bool(asleep), "PARTIAL with nothing asleep")
        if state is W.NEEDS_RELOAD:
            require(res.weights_resident and not res.weights_valid, "NEEDS_RELOAD needs resident, invalid weights")
        if pending is not None and isinstance(pending.command, Execute):
            require(state is W.ACTIVE, "Execute pending outside ACTIVE")
        if self.work.running:
            # P-7: a request runs only on resident, valid memory, and no effect moves it meanwhile;
            # a held one (pause keep) waits, frozen, through an update of the weights under it.
            refit = state is W.RELOADING and self.work.held
            require(state is W.ACTIVE or refit, f"{len(self.work.running)} requests running outside ACTIVE")
        if pending is not None and isinstance(pending.command, (Profile, InitWeightGroup)):
            require(state in IDLE, "Profile or InitWeightGroup pending outside ACTIVE/SLEEPING/PARTIAL/NEEDS_RELOAD")
        if pending is not None and isinstance(pending.command, ShareWeights):
            require(
                state in (W.ACTIVE, W.PARTIAL) and res.weights_valid and res.weights_resident,
                "ShareWeights pending without valid weights awake",
            )
        if pending is not None and isinstance(pending.command, UpdateWeights):
            require(state is W.RELOADING, "UpdateWeights pending outside RELOADING")
            require(pending.command.version > self.weights_version, "an update pending at or below the version")
        moving = (AddAdapter, RemoveAdapter, PinAdapter)
        if pending is not None and isinstance(pending.command, moving):
            require(
                state in (W.ACTIVE, W.PARTIAL)
                and res.weights_valid
                and res.weights_resident
                and self.adapters.home_tag not in asleep,
                "an adapter command pending without valid weights and their pool awake",
            )
        require(len(self.adapters.holding()) <= self.adapters.max_loras, "more adapters loaded than max_loras")
        if pending is not None and type(pending.command) in WORKER_CALLS:
            trigger = WORKER_CALLS[type(pending.command)].trigger
            require(self.lifecycle.allows(trigger), f"{type(pending.command).__name__} pending outside its row")
        if self.profiling:
            require(state not in (W.LOADING, W.STOPPED), "a profile running in LOADING or STOPPED")

    # ------------------------------------------------------------------ one handler per command

    def _on_sleep(self, command: Sleep) -> WorkerStep:
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
        self.work.begin(PendingEffect(command, sleep_plan=plan))
        effect = SleepEffect(command.task_id, plan.offload, plan.discard, command.links, command.incoming_bytes)
        return WorkerStep(effect=effect)

    def _on_wake(self, command: Wake) -> WorkerStep:
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
        if command.memory_wait_s > 0 and Capability.SWAP not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker cannot wait for free device memory "
                "(capability 'swap' not declared); send the Wake with memory_wait_s=0",
            )
        if not self.lifecycle.allows("wake"):
            return self._refuse_state(command)
        before = self.state
        self.lifecycle.fire("wake")
        self.work.begin(PendingEffect(command, wake_tags=frozenset(to_wake), state_before=before))
        return WorkerStep(effect=WakeEffect(command.task_id, to_wake, command.memory_wait_s, command.links))

    def _on_reload_weights(self, command: ReloadWeights) -> WorkerStep:
        if not self.lifecycle.allows("reload"):
            return self._refuse_state(
                command, "ReloadWeights needs NEEDS_RELOAD (after a level-2 sleep and a wake of 'weights') or ACTIVE"
            )
        state_before = self.state
        self.lifecycle.fire("reload")
        self.work.begin(PendingEffect(command, state_before=state_before))
        return WorkerStep(effect=ReloadEffect(command.task_id, command.source))

    def _on_update_weights(self, command: UpdateWeights) -> WorkerStep:
        if Capability.WEIGHT_UPDATE not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                "this worker does not take weight updates (capability 'weight_update' not declared); use ReloadWeights",
            )
        into_host = self.lifecycle.allows("update_asleep") and not self.residency.weights_resident
        if into_host:
            refusal = self._host_refit_refusal(command)
            if refusal is not None:
                return refusal
        elif not self.lifecycle.allows("update") or not self.residency.weights_resident:
            return self._refuse_state(
                command,
                "UpdateWeights needs the weights resident: ACTIVE, PARTIAL "
                "with 'weights' awake, or NEEDS_RELOAD, or asleep at level 1 on a worker that "
                "declares 'host_refit'; wake 'weights' first",
            )
        if command.version <= self.weights_version:
            return self._refuse(
                command,
                NackReason.STALE_VERSION,
                f"weights version {command.version} is not above this rank's version "
                f"{self.weights_version}; send a higher version (nothing was written)",
            )
        state_before = self.state
        self.lifecycle.fire("update_asleep" if into_host else "update")
        self.work.begin(PendingEffect(command, state_before=state_before))
        effect = UpdateEffect(command.task_id, command.version, command.source, command.flush_cache, into_host)
        return WorkerStep(effect=effect)

    def _host_refit_refusal(self, command: UpdateWeights) -> WorkerStep | None:
        """Why this rank cannot write `command` into its host copy while its weights sleep (None: it can)."""
        if Capability.HOST_REFIT not in self.capabilities:
            return self._refuse_state(
                command,
                "UpdateWeights needs the weights resident here: this worker cannot write an update "
                "into its host copy while they sleep (capability 'host_refit' not declared: its "
                "backend or runner keeps no host copy it can write); wake 'weights' first, then update",
            )
        if not self.residency.weights_valid:
            return self._refuse_state(
                command,
                "a level-2 sleep discarded the weights: no host copy holds them to write; wake, "
                "then update (NEEDS_RELOAD takes it)",
            )
        return None

    def _on_init_weight_group(self, command: InitWeightGroup) -> WorkerStep:
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
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=WeightGroupEffect(command.task_id, command))

    def _on_share_weights(self, command: ShareWeights) -> WorkerStep:
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
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=ShareEffect(command.task_id, command.bucket_bytes))

    def _on_execute(self, command: Execute) -> WorkerStep:
        if not self.lifecycle.allows("execute"):
            return self._refuse_state(
                command, "Execute runs only in ACTIVE, where every tag is resident and the weights are valid"
            )
        if command.adapter is not None:
            problem = self.adapters.request_problem(command.adapter, self.weights_version)
            if problem is not None:  # P-20: never served without its adapter, nor on other weights
                return self._refuse(command, NackReason.ADAPTER_UNAVAILABLE, problem)
            self.adapters.touch(command.adapter)
        self.lifecycle.fire("execute")
        self.work.run(command)
        self.spans.started(command.task_id, self.weights_version)
        return WorkerStep(effect=ExecuteEffect(command.task_id, command.payload, command.adapter))

    def _on_hold(self, command: HoldRequests) -> WorkerStep:
        """Pause mode keep: freeze the batch where it is (the shell asks the runner for each
        request's tokens so far), or release it under the version held now. A hold with no
        request running holds nothing: an Ack at once, as a release of nothing held."""
        if not self.lifecycle.allows("hold_requests"):
            return self._refuse_state(command, "requests are held and released in ACTIVE, where they run")
        if command.hold == self.work.held:
            return self._already(command, "hold_requests")
        self.lifecycle.fire("hold_requests")
        if not command.hold:
            self.work.held = False
            over = self.spans.released(self.weights_version)
            failed = tuple(
                self._fail_request(t, "it was held through more updates than a Result records") for t in over
            )
            reply = self._ack(command, AckStatus.OK)
            self._remember(command, reply)
            return WorkerStep(replies=(reply, *failed))
        if not self.work.running:
            self.work.held = True
            reply = self._ack(command, AckStatus.OK)
            self._remember(command, reply)
            return WorkerStep(replies=(reply,))
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=HoldEffect(command.task_id, command.clear_cache))

    def _fail_request(self, task_id: str, why: str) -> Nack:
        """A running request the core ends itself (its weights lost under it, too many spans):
        its one reply, EXECUTE_ERROR; the shell drops what the runner still holds of it."""
        command = self.work.take(task_id).command
        self.spans.forget(task_id)
        reply = self._nack(command, NackReason.EXECUTE_ERROR, f"Execute task {task_id!r} failed: {why}")
        self._remember(command, reply)
        return reply

    def _on_status(self, command: Status) -> WorkerStep:
        self.lifecycle.fire("status")  # legal in every state; firing keeps the table the source
        if self.work.busy:
            # Busy: answer from what the core knows; the shell is inside an effect.
            return WorkerStep(replies=(self._ack(command, AckStatus.OK),))
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=StatusEffect(command.task_id))

    def _on_profile(self, command: Profile) -> WorkerStep:
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
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=ProfileEffect(command.task_id, command.start, command.prefix))

    def _on_shutdown(self, command: Shutdown) -> WorkerStep:
        if self.lifecycle.allows("shutdown_already"):
            return self._already(command, "shutdown_already")
        self.lifecycle.fire("shutdown")
        self.profiling = False  # the shell drops a running profile with the process
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=ShutdownEffect(command.task_id))

    def _on_call(self, command: Command) -> WorkerStep:
        """A command of WORKER_CALLS, by its row: the shell performs the command itself."""
        row = WORKER_CALLS[type(command)]
        if row.capability is not None and row.capability not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                f"this worker does not take {type(command).__name__} "
                f"(capability {row.capability.value!r} not declared)",
            )
        res = self.residency
        if not self.lifecycle.allows(row.trigger) or (
            row.weights_awake and not (res.weights_resident and res.weights_valid)
        ):
            return self._refuse_state(command, row.why)
        self.lifecycle.fire(row.trigger)
        self.work.begin(PendingEffect(command))
        return WorkerStep(effect=CommandEffect(command.task_id, command))

    # ------------------------------------------------------------------ the adapter commands (P-20)

    def _on_adapter(self, command: Command) -> WorkerStep:
        if Capability.ADAPTERS not in self.capabilities:
            return self._refuse(
                command,
                NackReason.UNSUPPORTED,
                f"this worker serves no LoRA adapters (capability 'adapters' not declared); "
                f"{type(command).__name__} needs a runner with adapter support",
            )
        if isinstance(command, ListAdapters):
            if not self.lifecycle.allows("list_adapters"):
                return self._refuse_state(command, "ListAdapters is legal in ACTIVE, SLEEPING, PARTIAL, NEEDS_RELOAD")
            self.lifecycle.fire("list_adapters")
            # Through the shell like every command (its runner may list its own), answered
            # from the table at completion and cached: a copy gets the same list (P-2).
            self.work.begin(PendingEffect(command))
            return WorkerStep(effect=AdapterEffect(command.task_id, command, ()))
        if self._adapter_already(command) and self.lifecycle.allows("adapter_already"):
            self.lifecycle.fire("adapter_already")
            reply = self._ack(command, AckStatus.ALREADY)
            self._remember(command, reply)
            return WorkerStep(replies=(reply,))
        trigger = {AddAdapter: "add_adapter", RemoveAdapter: "remove_adapter", PinAdapter: "pin_adapter"}
        res = self.residency
        awake = res.weights_resident and res.weights_valid and self.adapters.home_tag not in res.asleep
        if not self.lifecycle.allows(trigger[type(command)]) or not awake:
            return self._refuse_state(command, _WHERE)
        problem = self._adapter_problem(command)
        if problem is not None:
            return self._refuse(command, NackReason.INVALID_ARGUMENT, f"{problem} (nothing was loaded)")
        evict = self.adapters.evictions(command) if isinstance(command, AddAdapter) else ()
        self.lifecycle.fire(trigger[type(command)])
        self.work.begin(PendingEffect(command, evict=evict))
        return WorkerStep(effect=AdapterEffect(command.task_id, command, evict))

    def _adapter_already(self, command: Command) -> bool:
        match command:
            case AddAdapter():
                return self.adapters.is_already(command, self.weights_version)
            case RemoveAdapter():
                return self.adapters.get(command.name) is None
            case PinAdapter():
                held = self.adapters.get(command.name)
                return held is not None and held.pinned == command.pinned
        return False

    def _adapter_problem(self, command: Command) -> str | None:
        if isinstance(command, AddAdapter):
            return self.adapters.add_problem(command, self.weights_version)
        if isinstance(command, PinAdapter) and self.adapters.get(command.name) is None:
            return f"adapter {command.name!r} is not loaded on this rank: add it before pinning it"
        return None

    def _settle_adapter(self, command: Command, evicted: tuple[str, ...]) -> None:
        """The shell did the adapter command's work: the table says so now."""
        match command:
            case AddAdapter():
                self.adapters.commit_add(command, self.weights_version, evicted)
            case RemoveAdapter():
                self.adapters.remove(command.name)
            case PinAdapter():
                self.adapters.pin(command.name, command.pinned)

    def _adapter_failed(self, command: Command, evicted: tuple[str, ...], detail: str, raised: bool = False) -> Any:
        """The shell refused or failed the adapter command: the rank keeps its state and serves
        on. An add that failed after its evictions ran has lost those adapters too: unloaded,
        and the table (and so a ListAdapters) says so. An add that raised once loading began
        (`raised`) may have half-written the adapter of its name: the shell unloaded it, so the
        table drops it too and no request is served with it."""
        for name in evicted:
            self.adapters.remove(name)
        lost = f"; evicted before the load failed: {list(evicted)}" if evicted else "; nothing was loaded"
        if raised and isinstance(command, AddAdapter) and self.adapters.get(command.name) is not None:
            self.adapters.remove(command.name)
            lost = f"{lost.replace('; nothing was loaded', '')}; adapter {command.name!r} was unloaded (add it again)"
        return self._nack(
            command, NackReason.INVALID_ARGUMENT, f"{detail}{lost}; this rank is still {self.state.value}"
        )

    # ------------------------------------------------------------------ the effect completions

    def _on_done(self, done: EffectCompleted) -> WorkerStep:
        """The shell performed the pending effect."""
        task_id, duration_s = done.task_id, done.duration_s
        before = self.state
        pending = self.work.take(task_id)
        command = pending.command
        match command:
            case Execute():
                # The core was busy with this request: the adapter it checked is the one served.
                adapter = self.adapters.get(command.adapter) if command.adapter is not None else None
                spans, discarded = self.spans.finished(task_id)
                reply: Reply = Result(
                    task_id=task_id,
                    epoch=self.epoch,
                    rank=self.rank,
                    output=done.output,
                    duration_s=duration_s,
                    weights_version=self.weights_version,
                    adapter=command.adapter,
                    adapter_version=adapter.version if adapter is not None else 0,
                    version_spans=spans,
                    discarded_tokens=discarded,
                )
            case _ if isinstance(command, ADAPTER_COMMANDS):
                self._settle_adapter(command, pending.evict)
                reply = self._ack(
                    command, AckStatus.OK, memory=done.memory, duration_s=duration_s, adapters_evicted=pending.evict
                )
            case _:
                self._settle(pending, done.output, done.weights_version)
                reply = self._ack(
                    command,
                    AckStatus.OK,
                    memory=done.memory,
                    duration_s=duration_s,
                    trace_paths=done.trace_paths if isinstance(command, Profile) else (),
                    shared=done.shared if isinstance(command, ShareWeights) or _shares(command) else None,
                    caches_dropped=_cache_names(done.output) if isinstance(command, WEIGHT_WRITES) else (),
                )
        if not isinstance(command, Status):
            self._remember(command, reply)
        head = EffectDone(
            task_id, type(command).__name__, self.state.value, duration_s, done.path, self.weights_version
        )
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)

    def _settle(self, pending: PendingEffect, output: object = None, reloaded_version: int = 0) -> None:
        """Where a completed effect leaves the rank: its residency, state, version, group, profiler.
        `output`: the effect's (a hold's boundaries); `reloaded_version`: the version a
        ReloadWeights brought (a saved directory's, P-21)."""
        command = pending.command
        match command:
            case Sleep():
                assert pending.sleep_plan is not None
                self.residency.apply_sleep(pending.sleep_plan)
                self.adapters.discarded(pending.sleep_plan.discard)  # P-20: level 2 leaves them gone
                self.lifecycle.fire("offloaded")
            case Wake():
                self.residency.apply_wake(pending.wake_tags)
                self.lifecycle.fire(settle_row(self.residency.settled()).after_wake)
            case UpdateWeights() if pending.state_before is REFIT_ASLEEP.rank_state:
                # Written into the host copy: still asleep, and the next wake brings this version.
                self.lifecycle.fire(REFIT_ASLEEP.after_update)
                self.weights_version = command.version
                self.adapters.rebased(self.weights_version)  # P-20: made for other weights: stale
            case ReloadWeights() | UpdateWeights():
                self.residency.apply_reload()
                trigger = settle_row(self.residency.settled()).after_reload
                if trigger is None:
                    raise InvariantViolation(f"a reload cannot settle in {self.residency.settled().value}")
                self.lifecycle.fire(trigger)
                # A reload brings the weights of its source back: a saved directory's version
                # (its index names it), else the runner's own, which no update's version stands for.
                self.weights_version = command.version if isinstance(command, UpdateWeights) else reloaded_version
                self.adapters.rebased(self.weights_version)  # P-20: made for other weights: stale
            case InitWeightGroup():
                self.weight_group = command
            case HoldRequests():
                self.work.held = True
                self.spans.held(_boundaries(output), command.clear_cache)
            case Profile():
                self.profiling = command.start

    def _on_refused(self, declined: EffectDeclined) -> WorkerStep:
        """The pending effect was refused before it changed anything, and the rank is back in
        the state the command started from: a ReloadWeights whose source the runner refused
        before writing (NACK INVALID_ARGUMENT), or a Wake that found too little free device
        memory in time and unmapped what it had mapped (NACK NO_MEMORY, P-16). Cached, like an
        EXECUTE_ERROR: the effect was attempted and this is its answer, so a copy of the task
        gets it again instead of passing through RELOADING once more (a copy judged afresh
        would move a rank of a NEEDS_RELOAD stage back into RELOADING)."""
        task_id, detail, reason = declined.task_id, declined.detail, declined.reason
        before = self.state
        pending = self.work.take(task_id)
        kind = type(pending.command)
        if isinstance(pending.command, ADAPTER_COMMANDS):  # checked before anything was done
            refusal = self._adapter_failed(pending.command, (), detail)
            self._remember(pending.command, refusal)
            head = EffectRefused(task_id, kind.__name__, self.state.value, clip(detail))
            return self._traced(WorkerStep(replies=(refusal,)), head, before, task_id)
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
        head = EffectRefused(task_id, name, self.state.value, clip(detail))
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)

    def _on_error(self, raised: EffectRaised) -> WorkerStep:
        """The pending effect raised. A lifecycle effect leaves the worker FAILED, saying why
        in every later reply; a failed Execute is only that request's error."""
        task_id, error = raised.task_id, raised.error
        before = self.state
        pending = self.work.take(task_id)
        command = pending.command
        name = type(command).__name__
        what = f"{name} task {task_id!r} failed: {error}"
        match command:
            case Execute():
                # A request the runner rejects says nothing about the memory: stay ACTIVE.
                self.spans.forget(task_id)
                reply = self._nack(command, NackReason.EXECUTE_ERROR, what)
            case HoldRequests():
                # The runner failed to freeze them: where they are is unknown, so they end now.
                reply = self._nack(command, NackReason.EXECUTE_ERROR, f"{what}; the running requests failed with it")
            case UpdateWeights():
                # Writing began: the weights are neither the old version nor the new one. Mapped,
                # the rank waits in NEEDS_RELOAD for a reload or another update (P-17); written
                # into the host copy, it stays asleep and its wake lands NEEDS_RELOAD.
                asleep = pending.state_before is REFIT_ASLEEP.rank_state
                self.residency.weights_valid = False
                self.lifecycle.fire(REFIT_ASLEEP.after_failure if asleep else "update_failed")
                then = "update again or reload"
                then = f"its wake lands NEEDS_RELOAD, then {then}" if asleep else then
                reply = self._nack(
                    command,
                    NackReason.UPDATE_FAILED,
                    f"{what}; the weights are invalid, this rank is {self.state.value} and still at weights "
                    f"version {self.weights_version}: {then}",
                )
            case InitWeightGroup():
                # No pool memory moved: the rank keeps its state and has no group.
                reply = self._nack(command, NackReason.INVALID_ARGUMENT, f"{what}; this rank joined no weight group")
            case ShareWeights():
                # No pool memory moved: the rank keeps its state and shares nothing.
                reply = self._nack(command, NackReason.INVALID_ARGUMENT, f"{what}; this rank shares no weights now")
            case Profile():
                # The profiler is not memory: the rank keeps its state and serves on. The shell
                # drops a profiler that failed, so none runs now, whichever way it failed.
                self.profiling = False
                reply = self._nack(command, NackReason.PROFILE_ERROR, f"{what}; no profile is running on this rank now")
            case _ if isinstance(command, ADAPTER_COMMANDS):
                reply = self._adapter_failed(command, pending.evict, what, raised=True)
            case _ if type(command) in WORKER_CALLS:
                # No pool memory moved: the rank keeps its state.
                reason = WORKER_CALLS[type(command)].error
                reply = self._nack(command, reason, f"{what}; this rank is still {self.state.value}")
            case _:
                self.failure = what
                if self.lifecycle.allows("fail"):
                    self.lifecycle.fire("fail")
                reply = self._nack(command, NackReason.BACKEND_ERROR, self.failure)
        if not isinstance(command, Status):  # Status is never cached (as in _on_done)
            self._remember(command, reply)
        lost = self._fail_held(command, what)
        head = EffectFailed(task_id, name, self.state.value, clip(error))
        return self._traced(WorkerStep(replies=(reply, *lost)), head, before, task_id)

    def _fail_held(self, command: Command, what: str) -> tuple[Nack, ...]:
        """A hold that raised, or an update that failed beside held requests: the weights or
        the runner's state under them are gone, so each held request fails (once) and the
        hold ends; a request never resumes on weights its spans could not name."""
        if not isinstance(command, (HoldRequests, *BESIDE_HELD)) or not (self.work.held or self.work.running):
            return ()
        if isinstance(command, BESIDE_HELD) and not self.work.held:
            return ()
        self.work.held = False
        return tuple(self._fail_request(t, f"it was held when {what}") for t in list(self.work.running))


def _shares(command: Command) -> bool:
    """Whether `command` is a generic call whose output is the buckets the rank holds (P-22)."""
    row = WORKER_CALLS.get(type(command))
    return row is not None and row.shares
