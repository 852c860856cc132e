"""The worker core's commands: fencing, the reply cache and BUSY first, then one handler per
command, each checking legality against WORKER_TRANSITIONS and starting at most one effect."""

from __future__ import annotations

import msgspec

from omni_core.fsm.adapters import AdapterTable
from omni_core.fsm.effects import (
    CommandEffect,
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
from omni_core.fsm.reply_cache import BoundedCache
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import Residency, UnknownTagError, plan_sleep, resolve_tags
from omni_core.fsm.worker_step import (
    WorkerCounters,
    WorkerStep,
    _CachedReply,
    _Pending,
)
from omni_core.fsm.worker_table import WORKER_CALLS
from omni_core.protocol import (
    AckStatus,
    Capability,
    Command,
    Execute,
    InitWeightGroup,
    NackReason,
    Profile,
    ReloadWeights,
    ShareWeights,
    Shutdown,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
    profile_prefix_problem,
)
from omni_core.protocol import WorkerState as W

_NO_LINKS = (
    "this worker copies over its own host link only (capability 'multi_path' not declared); "
    "send the command without links"
)


class WorkerCommands:
    """Mixed into WorkerCore: what each decoded command does."""

    epoch: int
    state: W
    lifecycle: Lifecycle[W]
    residency: Residency
    adapters: AdapterTable
    tags: tuple[str, ...]
    capabilities: frozenset[Capability]
    weights_version: int
    weight_group: InitWeightGroup | None
    profiling: bool
    failure: str
    counters: WorkerCounters
    cache: BoundedCache[str, _CachedReply]
    _pending: _Pending | None
    _running: dict[str, Execute]

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
        self._pending = _Pending(command, sleep_plan=plan)
        effect = SleepEffect(
            command.task_id, command.level, plan.offload, plan.discard, command.links, command.incoming_bytes
        )
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
        self._pending = _Pending(command, wake_tags=frozenset(to_wake), state_before=before)
        return WorkerStep(effect=WakeEffect(command.task_id, to_wake, command.memory_wait_s, command.links))

    def _on_reload_weights(self, command: ReloadWeights) -> WorkerStep:
        if not self.lifecycle.allows("reload"):
            return self._refuse_state(
                command, "ReloadWeights needs NEEDS_RELOAD (after a level-2 sleep and a wake of 'weights') or ACTIVE"
            )
        state_before = self.state
        self.lifecycle.fire("reload")
        self._pending = _Pending(command, state_before=state_before)
        return WorkerStep(effect=ReloadEffect(command.task_id, command.source))

    def _on_update_weights(self, command: UpdateWeights) -> WorkerStep:
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
        return WorkerStep(effect=UpdateEffect(command.task_id, command.version, command.source, command.flush_cache))

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
        self._pending = _Pending(command)
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
        self._pending = _Pending(command)
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
        self._running[command.task_id] = command
        return WorkerStep(effect=ExecuteEffect(command.task_id, command.payload, command.adapter))

    def _on_status(self, command: Status) -> WorkerStep:
        self.lifecycle.fire("status")  # legal in every state; firing keeps the table the source
        if self._pending is not None or self._running:
            # Busy: answer from what the core knows; the shell is inside an effect.
            return WorkerStep(replies=(self._ack(command, AckStatus.OK),))
        self._pending = _Pending(command)
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
        self._pending = _Pending(command)
        return WorkerStep(effect=ProfileEffect(command.task_id, command.start, command.prefix))

    def _on_shutdown(self, command: Shutdown) -> WorkerStep:
        if self.lifecycle.allows("shutdown_already"):
            return self._already(command, "shutdown_already")
        self.lifecycle.fire("shutdown")
        self.profiling = False  # the shell drops a running profile with the process
        self._pending = _Pending(command)
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
        if not self.lifecycle.allows(row.trigger):
            return self._refuse_state(command, row.why)
        self.lifecycle.fire(row.trigger)
        self._pending = _Pending(command)
        return WorkerStep(effect=CommandEffect(command.task_id, command))
