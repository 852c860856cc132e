"""Memory pressure: how the suite takes a device's free memory away from a worker under test
and gives it back, to check a `Wake` that finds too little of it (P-16, `NO_MEMORY`).

Over the wire alone the suite cannot fill a worker's device, so the case that needs it asks a
*pressure hook*: an object made fresh for the case by a factory (`SuiteOptions.memory_pressure`,
CLI `--memory-pressure package.module:factory`) with

- `worker(address, rank, epoch)`: a worker factory (anything `targets.launch` accepts) whose
  worker runs on the device the hook controls;
- `squeeze(free_bytes)`: hold the device so that about `free_bytes` stay free; return a word
  the refusal's detail must contain to name the holder (e.g. `"pid 1234"`), or `""`;
- `relieve()`: give the memory back;
- `close()`: undo everything (the suite calls it whatever happened).

The built-in hook (`SimulatedPressure`, used for the `synthetic`/`reference` targets) runs
the worker on a simulated device in a fresh directory and squeezes it with a file of its own,
the suite's pid as its holder (`omni_core.workers.simulated_device`). A third party's worker
on a GPU can offer a hook that allocates (and frees) device memory in a helper process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from omni_core.conformance.targets import BUILTIN_TARGETS, TargetError, WorkerFactory, import_factory, reference_worker

if TYPE_CHECKING:  # the suite imports no worker code (tests/conformance/test_targets.py): only a hook that runs does
    from omni_core.workers.simulated_device import SimulatedDevice

# Far above the reference worker's 320 KiB, far below any real device: the squeeze, not the
# capacity, is what a case runs out of.
SIMULATED_CAPACITY_BYTES = 64 << 20
PRESSURE_STAGE = "conformance-pressure"  # the squeezing file's stage name, as holders list it


class MemoryPressure(Protocol):
    def worker(self, address: str, rank: int, epoch: int) -> Any: ...

    def squeeze(self, free_bytes: int) -> str: ...

    def relieve(self) -> None: ...

    def close(self) -> None: ...


PressureFactory = Callable[[], MemoryPressure]
# (address, rank, epoch, device) -> what `targets.launch` accepts, the worker on `device`
DeviceWorker = Callable[[str, int, int, "SimulatedDevice"], Any]


def reference_on_device(address: str, rank: int, epoch: int, device: SimulatedDevice) -> dict[str, Any]:
    """The reference worker's configuration, on the simulated `device`."""
    return {
        **reference_worker(address, rank, epoch),
        "simulated_device": {"directory": device.directory, "capacity_bytes": device.capacity_bytes},
    }


class SimulatedPressure:
    """A simulated device in a fresh private directory; `squeeze` writes one holder's file
    (this process's pid, stage `conformance-pressure`) sized to leave `free_bytes` free."""

    def __init__(
        self, start: DeviceWorker = reference_on_device, *, capacity_bytes: int = SIMULATED_CAPACITY_BYTES
    ) -> None:
        from omni_core.workers.simulated_device import SimulatedDevice

        self.directory = tempfile.mkdtemp(prefix="omni-conf-device-", dir="/tmp")
        self.device = SimulatedDevice(self.directory, capacity_bytes)
        self._start = start
        self._pid = os.getpid()

    def worker(self, address: str, rank: int, epoch: int) -> Any:
        return self._start(address, rank, epoch, self.device)

    def squeeze(self, free_bytes: int) -> str:
        self.relieve()  # measured without our own file
        held = max(0, self.device.free_bytes() - max(0, free_bytes))
        self.device.write(PRESSURE_STAGE, 0, self._pid, held)
        return f"pid {self._pid}"

    def relieve(self) -> None:
        self.device.remove(PRESSURE_STAGE, 0, self._pid)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.relieve()
        shutil.rmtree(self.directory, ignore_errors=True)


def pressure_for(target: str | WorkerFactory) -> PressureFactory | None:
    """The built-in hook for the built-in targets; None for any other (the user names one
    with `--memory-pressure`, or the case that needs it is skipped)."""
    if isinstance(target, str) and target.strip() in BUILTIN_TARGETS:
        return SimulatedPressure
    return None


def resolve_pressure(spec: str | PressureFactory) -> PressureFactory:
    """A factory of hooks from `SuiteOptions.memory_pressure`: a callable, or its import path."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise TargetError(f"memory_pressure must be 'package.module:factory' or a callable, got {spec!r}")
    return import_factory(spec.strip())  # type: ignore[return-value]
