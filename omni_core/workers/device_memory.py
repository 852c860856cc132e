"""Free device memory and who holds it: what a rank's memory gate asks before each map.

Two sources answer the same two questions (`free_bytes`, `holders`):

- `CudaFreeMemory`: the driver's free bytes on the rank's GPU (`torch.cuda.mem_get_info`)
  and every process NVML lists there (through `ProcessMemory`, the one NVML reader);
- `SimulatedResidency` (omni_core.workers.simulated_device): a capacity and per-process
  files, for CPU runs.

`is_out_of_memory` recognises the driver's refusal of a map the gate admitted (a third
process allocated in between): the gate treats it as "not free yet", never as a failure.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from omni_core.workers.accounting import ProcessMemory
from omni_core.workers.ledger_files import LedgerError
from omni_core.workers.simulated_device import Holder, HolderList, SimulatedOutOfMemory, SimulatedResidency

log = logging.getLogger("omni_core.workers.device_memory")

# Kept free below what the driver reports, per map: cuMemCreate needs a little beyond the
# allocation's own bytes (page tables), and other processes' allocators round up. Enough
# for that, small against any allocation worth a swap.
CUDA_RESERVE_BYTES = 32 << 20
# The driver's words for an out-of-memory map: torch's OutOfMemoryError text, cuGetErrorString
# of CUDA_ERROR_OUT_OF_MEMORY (vLLM's extension raises RuntimeError with it), cudaErrorMemoryAllocation.
_OOM_MARKERS = ("out of memory", "cuda_error_out_of_memory", "cudaerrormemoryallocation")


class FreeMemorySource(Protocol):
    reserve_bytes: int  # bytes the gate keeps back from what free_bytes() reports

    def free_bytes(self) -> int: ...

    def holders(self) -> HolderList: ...

    def describe(self) -> str: ...  # which device, for messages


def is_out_of_memory(exc: BaseException) -> bool:
    """True when `exc` is the device refusing an allocation for lack of memory."""
    if isinstance(exc, SimulatedOutOfMemory):
        return True
    oom_error = _torch_oom_error()
    if oom_error is not None and isinstance(exc, oom_error):
        return True
    text = str(exc).lower()
    return isinstance(exc, (RuntimeError, MemoryError)) and any(m in text for m in _OOM_MARKERS)


def _torch_oom_error() -> type[BaseException] | None:
    import sys

    torch = sys.modules.get("torch")  # loaded by any backend that can OOM; never imported here
    return getattr(torch, "OutOfMemoryError", None) if torch is not None else None


class CudaFreeMemory:
    """The free bytes of one CUDA device and the processes holding the rest (NVML)."""

    def __init__(
        self,
        memory: ProcessMemory,
        *,
        reserve_bytes: int = CUDA_RESERVE_BYTES,
        ledger: SimulatedResidency | None = None,
    ) -> None:
        if memory.device.type != "cuda":
            raise ValueError(f"CudaFreeMemory needs a CUDA device, got {memory.device}")
        self.memory = memory
        self.device: Any = memory.device
        self.reserve_bytes = reserve_bytes
        # This rank's file in the node's ledger of the GPU (omni_core.workers.device_ledger):
        # where its bytes are reported and other engines' ranks are named.
        self.ledger = ledger
        self._ledger_problem = ""  # the last ledger problem logged

    @property
    def ledger_directory(self) -> str | None:
        return self.ledger.device.directory if self.ledger is not None else None

    def report(self, resident_bytes: int) -> None:
        """This rank's resident pool bytes, for the other engines' refusals. The GPU's own
        accounting does not depend on it (the driver refuses what does not fit), so a ledger
        that became unusable after the start is logged, not raised into the effect."""
        if self.ledger is None:
            return
        try:
            self.ledger.report(resident_bytes)
        except (OSError, LedgerError) as err:
            if str(err) != self._ledger_problem:  # once per distinct problem, not per effect
                self._ledger_problem = str(err)
                log.warning("the node ledger of %s did not take this rank's holdings: %s", self.describe(), err)

    def free_bytes(self) -> int:
        import torch

        return int(torch.cuda.mem_get_info(self.device)[0])

    def holders(self) -> HolderList:
        used, problem = self.memory.device_processes()
        ours = {self.memory.pid: "this rank"}
        if self.memory.own_entry is not None:  # NVML lists this rank under its host pid
            ours[self.memory.own_entry] = "this rank"
        # Ranks of omni-core engines on this GPU, named by their files in its node ledger.
        known, ledger_problem = self._ledger_holders()
        holders = tuple(
            Holder(pid, nbytes, ours.get(pid) or _label(known.get(pid)), _engine(known.get(pid)))
            for pid, nbytes in sorted(used.items(), key=lambda item: -item[1])
        )
        return HolderList(holders, problem="; ".join(p for p in (problem, ledger_problem) if p))

    def _ledger_holders(self) -> tuple[dict[int, Holder], str]:
        if self.ledger is None:
            return {}, ""
        try:
            return {h.pid: h for h in self.ledger.holders().holders}, ""
        except (OSError, LedgerError) as err:  # a refusal still names NVML's pids
            return {}, f"the node ledger is unreadable: {err}"

    def describe(self) -> str:
        physical = self.memory.physical
        return f"{self.device}" + (f" ({physical.uuid})" if physical is not None else "")


def _label(holder: Holder | None) -> str:
    return holder.label if holder is not None else ""


def _engine(holder: Holder | None) -> int | None:
    return holder.engine_pid if holder is not None else None
