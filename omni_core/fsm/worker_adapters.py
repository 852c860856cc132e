"""The worker core's adapter commands (P-20): AddAdapter, RemoveAdapter, PinAdapter and
ListAdapters, judged against the rank's `AdapterTable` before anything goes to the shell, and
committed to it only when the shell has done the work. None changes the lifecycle state."""

from __future__ import annotations

from typing import Any

from omni_core.fsm.adapters import AdapterTable
from omni_core.fsm.effects import AdapterEffect
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import Residency
from omni_core.fsm.worker_step import WorkerStep, _Pending
from omni_core.protocol import (
    AckStatus,
    AddAdapter,
    Capability,
    Command,
    ListAdapters,
    NackReason,
    PinAdapter,
    RemoveAdapter,
)
from omni_core.protocol import WorkerState as W

ADAPTER_COMMANDS = (AddAdapter, RemoveAdapter, PinAdapter, ListAdapters)
_WHERE = (
    "adapters are loaded, unloaded and pinned with valid weights awake: ACTIVE, or PARTIAL with "
    "'weights' awake (and 'adapters', the pool they live in, when the rank has that tag)"
)


class WorkerAdapters:
    """Mixed into WorkerCore: the adapter commands and their completions."""

    state: W
    lifecycle: Lifecycle[W]
    residency: Residency
    capabilities: frozenset[Capability]
    weights_version: int
    adapters: AdapterTable
    _pending: _Pending | None

    # Provided by WorkerCore.
    _refuse: Any
    _refuse_state: Any
    _ack: Any
    _nack: Any
    _remember: Any

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
            self._pending = _Pending(command)
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
        self._pending = _Pending(command, evict=evict)
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

    def _adapter_failed(self, command: Command, evicted: tuple[str, ...], detail: str) -> Any:
        """The shell refused or failed the adapter command: the rank keeps its state and serves
        on. An add that failed after its evictions ran has lost those adapters too: unloaded,
        and the table (and so a ListAdapters) says so."""
        for name in evicted:
            self.adapters.remove(name)
        lost = f"; evicted before the load failed: {list(evicted)}" if evicted else "; nothing was loaded"
        return self._nack(
            command, NackReason.INVALID_ARGUMENT, f"{detail}{lost}; this rank is still {self.state.value}"
        )
