"""The worker core's effect completions: the shell performed the pending effect
(`EffectCompleted`), the runner refused it before it changed anything (`EffectDeclined`), or it
raised (`EffectRaised`). Each gives the task's one terminal reply."""

from __future__ import annotations

from omni_core.fsm.adapters import AdapterTable
from omni_core.fsm.settle import REFUSAL_REASON, settle_row
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import Residency
from omni_core.fsm.trace_records import EffectDone, EffectFailed, EffectRefused, clip
from omni_core.fsm.worker_adapters import ADAPTER_COMMANDS
from omni_core.fsm.worker_inputs import EffectCompleted, EffectDeclined, EffectRaised
from omni_core.fsm.worker_step import InvariantViolation, WorkerStep, _Pending
from omni_core.fsm.worker_table import REFUSED, WORKER_CALLS
from omni_core.protocol import (
    AckStatus,
    Execute,
    InitWeightGroup,
    NackReason,
    Profile,
    ReloadWeights,
    Reply,
    Result,
    ShareWeights,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
)
from omni_core.protocol import WorkerState as W

WEIGHT_WRITES = (ReloadWeights, UpdateWeights)


def _cache_names(output: object) -> tuple[str, ...]:
    """The derived caches a reload or an update dropped, as the shell reported them."""
    if output is None:
        return ()
    if not (isinstance(output, tuple) and all(isinstance(name, str) for name in output)):
        raise InvariantViolation(f"a weights write completes with the names of the caches it dropped, not {output!r}")
    return output


class WorkerEffects:
    """Mixed into WorkerCore: the end of each effect the shell performs."""

    rank: int
    epoch: int
    state: W
    lifecycle: Lifecycle[W]
    residency: Residency
    adapters: AdapterTable
    weights_version: int
    weight_group: InitWeightGroup | None
    profiling: bool
    failure: str

    def _on_done(self, done: EffectCompleted) -> WorkerStep:
        """The shell performed the pending effect."""
        task_id, duration_s = done.task_id, done.duration_s
        before = self.state
        pending = self._take_pending(task_id)
        command = pending.command
        match command:
            case Execute():
                # The core was busy with this request: the adapter it checked is the one served.
                adapter = self.adapters.get(command.adapter) if command.adapter is not None else None
                reply: Reply = Result(
                    task_id=task_id,
                    epoch=self.epoch,
                    rank=self.rank,
                    output=done.output,
                    duration_s=duration_s,
                    weights_version=self.weights_version,
                    adapter=command.adapter,
                    adapter_version=adapter.version if adapter is not None else 0,
                )
            case _ if isinstance(command, ADAPTER_COMMANDS):
                self._settle_adapter(command, pending.evict)
                reply = self._ack(
                    command, AckStatus.OK, memory=done.memory, duration_s=duration_s, adapters_evicted=pending.evict
                )
            case _:
                self._settle(pending)
                reply = self._ack(
                    command,
                    AckStatus.OK,
                    memory=done.memory,
                    duration_s=duration_s,
                    trace_paths=done.trace_paths if isinstance(command, Profile) else (),
                    shared=done.shared if isinstance(command, ShareWeights) else None,
                    caches_dropped=_cache_names(done.output) if isinstance(command, WEIGHT_WRITES) else (),
                )
        if not isinstance(command, Status):
            self._remember(command, reply)
        head = EffectDone(task_id, type(command).__name__, self.state.value, duration_s, done.path)
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)

    def _settle(self, pending: _Pending) -> None:
        """Where a completed effect leaves the rank: its residency, state, version, group, profiler."""
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
            case ReloadWeights() | UpdateWeights():
                self.residency.apply_reload()
                trigger = settle_row(self.residency.settled()).after_reload
                if trigger is None:
                    raise InvariantViolation(f"a reload cannot settle in {self.residency.settled().value}")
                self.lifecycle.fire(trigger)
                # A reload brings the runner's own weights back: no update's version stands for them.
                self.weights_version = command.version if isinstance(command, UpdateWeights) else 0
                self.adapters.rebased(self.weights_version)  # P-20: made for other weights: stale
            case InitWeightGroup():
                self.weight_group = command
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
        pending = self._take_pending(task_id)
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
        pending = self._take_pending(task_id)
        command = pending.command
        name = type(command).__name__
        what = f"{name} task {task_id!r} failed: {error}"
        match command:
            case Execute():
                # A request the runner rejects says nothing about the memory: stay ACTIVE.
                reply = self._nack(command, NackReason.EXECUTE_ERROR, what)
            case UpdateWeights():
                # Writing began: the weights are neither the old version nor the new one. They stay
                # mapped, so the rank waits in NEEDS_RELOAD for a reload or another update (P-17).
                self.residency.weights_valid = False
                self.lifecycle.fire("update_failed")
                reply = self._nack(
                    command,
                    NackReason.UPDATE_FAILED,
                    f"{what}; the weights are invalid, this rank is NEEDS_RELOAD and still at weights "
                    f"version {self.weights_version}: update again or reload",
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
                reply = self._adapter_failed(command, pending.evict, what)
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
        head = EffectFailed(task_id, name, self.state.value, clip(error))
        return self._traced(WorkerStep(replies=(reply,)), head, before, task_id)
