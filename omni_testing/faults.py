"""Fault injection for tests and the conformance suite: a runner and a backend that raise on
command, selected by import path like any user's own.

    WorkerConfig(runner="omni_testing.faults:FaultyRunner",
                 runner_args={"fail_on": ["reload"]}, ...)
    WorkerConfig(backend="omni_testing.faults:FailingWakeBackend", ...)
"""

from __future__ import annotations

from typing import Any

import torch

from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.memory_gate import MemoryGate

FAULT_POINTS = ("load", "reload", "execute", "reset")
MAX_CACHED_PREFIXES = 64


class InjectedFault(RuntimeError):
    pass


class FaultyRunner(SyntheticRunner):
    """SyntheticRunner that raises `InjectedFault` at the points named in `fail_on`."""

    def __init__(self, device: torch.device, *, fail_on: list[str] | tuple[str, ...] = (), **kwargs: Any) -> None:
        unknown = sorted(set(fail_on) - set(FAULT_POINTS))
        if unknown:
            raise ValueError(f"unknown fault point(s) {unknown}; choose from {list(FAULT_POINTS)}")
        super().__init__(device, **kwargs)
        self.fail_on = frozenset(fail_on)

    def _maybe_fail(self, point: str) -> None:
        if point in self.fail_on:
            raise InjectedFault(f"injected fault in {point} (FaultyRunner fail_on={sorted(self.fail_on)})")

    def load_weights(self) -> None:
        self._maybe_fail("load")
        super().load_weights()

    def reload_weights(self, source: str | None) -> None:
        self._maybe_fail("reload")
        super().reload_weights(source)

    def execute(self, payload: Any) -> dict[str, Any]:
        self._maybe_fail("execute")
        return super().execute(payload)


class PrefixCachingRunner(FaultyRunner):
    """FaultyRunner that keeps something across requests, as vLLM's prefix cache does: the seed
    of each request (at most MAX_CACHED_PREFIXES, oldest out first). `{"op": "prefix_cache"}`
    answers how many are kept and how many resets dropped; `reset_prefix_cache` empties it."""

    def __init__(self, device: torch.device, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.prefixes: dict[int, None] = {}
        self.dropped = 0

    def execute(self, payload: Any) -> dict[str, Any]:
        if payload == {"op": "prefix_cache"}:
            return {"entries": len(self.prefixes), "dropped": self.dropped}
        output = super().execute(payload)
        self.prefixes[int(payload.get("seed", 0))] = None
        while len(self.prefixes) > MAX_CACHED_PREFIXES:
            del self.prefixes[next(iter(self.prefixes))]
        return output

    def reset_prefix_cache(self) -> int:
        self._maybe_fail("reset")
        dropped = len(self.prefixes)
        self.prefixes.clear()
        self.dropped += dropped
        return dropped


class FailingWakeBackend(PortableBackend):
    """Portable backend whose wake raises after releasing nothing: a backend error."""

    name = "failing-wake"

    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None) -> None:
        raise InjectedFault(f"injected fault: cannot map tags {sorted(tags)} back")
