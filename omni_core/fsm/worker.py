"""Worker lifecycle: the sans-IO core of one rank process.

One door: `WorkerCore.step(input)` takes a typed input (`worker_inputs`: the runner loaded or
failed to, a command decoded or bytes that did not decode, the pending effect completed,
declined or raised) and returns a `WorkerStep`: the replies to send now, at most one effect
for the shell to perform, and the trace records. The invariants are checked after every
input. Same state and input, same output: the core reads no clock and touches no memory.

A command is fenced by epoch, answered from the reply cache and refused while busy before its
own handler (`worker_commands`) runs; the effect completions are in `worker_effects`, the
table in `worker_table`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from omni_core.fsm.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS, AdapterTable
from omni_core.fsm.reply_cache import DEFAULT_REPLY_CACHE_BYTES, DEFAULT_REPLY_CACHE_ENTRIES, BoundedCache
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import ADAPTERS_TAG, DEFAULT_TAGS, WEIGHTS_TAG, Residency
from omni_core.fsm.trace_records import (
    BadMessage,
    ReplySent,
    WorkerChanged,
    WorkerReceived,
    WorkerRecord,
    WorkerStarted,
    clip,
)
from omni_core.fsm.worker_adapters import ADAPTER_COMMANDS, WorkerAdapters
from omni_core.fsm.worker_commands import WorkerCommands
from omni_core.fsm.worker_effects import WorkerEffects
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
    MAX_IN_FLIGHT_PER_RANK,
    InvariantViolation,
    WorkerCounters,
    WorkerStep,
    _CachedReply,
    _Pending,
    _sent,
    command_digest,
)
from omni_core.fsm.worker_table import IDLE, WORKER_CALLS, WORKER_TRANSITIONS
from omni_core.protocol import (
    MAX_DETAIL_CHARS,
    Ack,
    AckStatus,
    AddAdapter,
    Capability,
    Command,
    Execute,
    InitWeightGroup,
    MemoryReport,
    Nack,
    NackReason,
    PinAdapter,
    Profile,
    ProtocolError,
    ReloadWeights,
    RemoveAdapter,
    Reply,
    ShareWeights,
    Shutdown,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
    encode,
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


class WorkerCore(WorkerCommands, WorkerAdapters, WorkerEffects):
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
        if not 1 <= max_in_flight <= MAX_IN_FLIGHT_PER_RANK:
            raise ValueError(f"max_in_flight must be in 1..{MAX_IN_FLIGHT_PER_RANK}, got {max_in_flight!r}")
        self.rank = rank
        # Requests this rank holds at once (the stage's max_in_flight): the shell hands them
        # to the runner together, and nothing else runs beside them.
        self.max_in_flight = max_in_flight
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
        self._pending: _Pending | None = None
        # The requests of the batch in progress, in arrival order (never beside `_pending`).
        self._running: dict[str, Execute] = {}
        # Orthogonal to the lifecycle: a profile may span sleeps and wakes (P-15).
        self.profiling = False

    @property
    def state(self) -> W:
        return self.lifecycle.state

    @property
    def busy(self) -> bool:
        return self._pending is not None or bool(self._running)

    @property
    def in_progress(self) -> tuple[str, ...]:
        """The tasks whose effects are under way, taken on and not yet completed: the
        lifecycle effect, or the requests of the batch in arrival order."""
        pending = (self._pending.command.task_id,) if self._pending is not None else ()
        return pending + tuple(self._running)

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
        original = self._in_progress(command.task_id)
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
        busy_with = self._busy_with(command)
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

    def _in_progress(self, task_id: str) -> Command | None:
        """The command of this task whose effect is under way (lifecycle or request), if any."""
        if self._pending is not None and self._pending.command.task_id == task_id:
            return self._pending.command
        return self._running.get(task_id)

    def _busy_with(self, command: Command) -> str:
        """Why `command` must wait (BUSY), or "": one lifecycle effect at a time, and beside a
        batch of requests only more requests, up to max_in_flight (nothing moves memory
        under a running request)."""
        if isinstance(command, Status):
            return ""
        if self._pending is not None:
            return f"task {self._pending.command.task_id!r} is in progress; retry after its reply"
        if self._running and not isinstance(command, Execute):
            first = next(iter(self._running))
            return (
                f"{len(self._running)} requests are running on this rank (first {first!r}); "
                f"{type(command).__name__} waits until they are answered: retry after their replies"
            )
        if len(self._running) >= self.max_in_flight:
            first = next(iter(self._running))
            return (
                f"request {first!r} and {len(self._running) - 1} more are in progress, this rank's "
                f"max_in_flight ({self.max_in_flight}); retry after a reply or raise the stage's max_in_flight"
            )
        return ""

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
            adapters=self.adapters.infos() if isinstance(command, ADAPTER_COMMANDS) else (),
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

    def _take_pending(self, task_id: str) -> _Pending:
        running = self._running.pop(task_id, None)
        if running is not None:
            return _Pending(running)
        if self._pending is None or self._pending.command.task_id != task_id:
            have = self._pending.command.task_id if self._pending else None
            raise InvariantViolation(f"effect completion for task {task_id!r}, pending is {have!r}")
        pending, self._pending = self._pending, None
        return pending

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
        if self._running:
            # P-7: a request runs only on resident, valid memory, and no effect moves it meanwhile.
            require(state is W.ACTIVE, f"{len(self._running)} requests running outside ACTIVE")
            require(self._pending is None, "a lifecycle effect beside a running batch")
            require(len(self._running) <= self.max_in_flight, "more requests running than max_in_flight")
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
        moving = (AddAdapter, RemoveAdapter, PinAdapter)
        if self._pending is not None and isinstance(self._pending.command, moving):
            require(
                state in (W.ACTIVE, W.PARTIAL)
                and res.weights_valid
                and res.weights_resident
                and self.adapters.home_tag not in asleep,
                "an adapter command pending without valid weights and their pool awake",
            )
        require(len(self.adapters.holding()) <= self.adapters.max_loras, "more adapters loaded than max_loras")
        if self._pending is not None and type(self._pending.command) in WORKER_CALLS:
            trigger = WORKER_CALLS[type(self._pending.command)].trigger
            require(self.lifecycle.allows(trigger), f"{type(self._pending.command).__name__} pending outside its row")
        if self.profiling:
            require(state not in (W.LOADING, W.STOPPED), "a profile running in LOADING or STOPPED")
