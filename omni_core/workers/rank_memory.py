"""The memory a rank may use, settled at start-up: its device, the budget its caches are
sized to under gpu_memory_fraction, the free-memory source a wake's gate asks, and the check
that the loaded model kept to its budget."""

from __future__ import annotations

import torch

from omni_core.runners.base import MemoryBudget
from omni_core.workers.accounting import ProcessMemory
from omni_core.workers.backends import MemoryBackend
from omni_core.workers.config import WorkerConfig, device_problem
from omni_core.workers.device_ledger import gpu_ledger_directory
from omni_core.workers.device_memory import CudaFreeMemory, FreeMemorySource
from omni_core.workers.simulated_device import SimulatedDevice, SimulatedResidency

# Kept out of what caches may take under gpu_memory_fraction: the CUDA context grows after
# the caches are sized (allocation granularity, cuBLAS workspaces at the first request).
# Seen on an H200: 90 MiB over a 42 GiB budget without it.
CACHE_HEADROOM_BYTES = 512 << 20


def resolve_device(name: str) -> torch.device:
    """The torch device of a configured name; a CUDA device without an index gets the current one."""
    problem = device_problem(name)
    if problem:  # torch's own words ("Torch not compiled with CUDA enabled") name no setting
        raise ValueError(
            f"device {problem}; set the stage's device (StageSpec.device, the TOML key `device` of "
            'its [[stages]] table) to "cpu", or start it where that device is'
        )
    device = torch.device(name)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def cache_budget(memory: ProcessMemory, fraction: float | None) -> MemoryBudget | None:
    """What the runner may size its caches to: none without a fraction (not on CUDA)."""
    if fraction is None:
        return None

    def available_bytes() -> int:
        # This process's own use only: stages starting side by side on one GPU each
        # get their fraction of the card, not of what the others left (vLLM's rule).
        available, _ = memory.determine_available_memory(fraction)
        return max(0, available - CACHE_HEADROOM_BYTES)

    return MemoryBudget(fraction, available_bytes)


def free_memory_source(
    config: WorkerConfig, backend: MemoryBackend, memory: ProcessMemory, device: torch.device
) -> FreeMemorySource | None:
    """What a wake's memory gate asks: the simulated device when configured (the backend
    reports its bytes there), the GPU's free memory on CUDA, else nothing (no gate)."""
    simulated = config.simulated_device
    if simulated is not None:
        report_to = getattr(backend, "report_to", None)
        if report_to is None:
            raise RuntimeError(
                f"simulated_device needs a backend that reports its bytes (portable); backend "
                f"{backend.name!r} does not: use backend='portable' on device='cpu'"
            )
        residency = SimulatedResidency(simulated, config.stage, config.rank)
        report_to(residency)
        return residency
    if device.type == "cuda":
        ledger = None
        if memory.physical is not None:  # the node's ledger of this GPU, shared across engines
            directory = gpu_ledger_directory(memory.physical.uuid)
            ledger = SimulatedResidency(SimulatedDevice(directory, memory.total_bytes()), config.stage, config.rank)
        return CudaFreeMemory(memory, ledger=ledger)
    return None


def ledger_directory(source: FreeMemorySource | None) -> str | None:
    """The node ledger's directory of the rank's device: the simulated device's own, or the
    GPU's; None where there is none (no gate, or NVML could not name the GPU)."""
    if isinstance(source, SimulatedResidency):
        return source.device.directory
    if isinstance(source, CudaFreeMemory):
        return source.ledger_directory
    return None


def check_budget(memory: ProcessMemory, fraction: float) -> None:
    """Raise, naming both figures and what to change, when the loaded rank holds more GPU
    memory than gpu_memory_fraction of the card."""
    figure = memory.measure()
    budget_bytes = int(memory.total_bytes() * fraction)
    if figure.process_bytes is not None and figure.process_bytes > budget_bytes:
        raise RuntimeError(
            f"this rank holds {figure.process_bytes / 2**30:.2f} GiB of GPU memory ({figure.source}), "
            f"over its budget gpu_memory_fraction={fraction} x {memory.total_bytes() / 2**30:.1f} GiB "
            f"= {budget_bytes / 2**30:.2f} GiB; shrink the model/caches or raise gpu_memory_fraction"
        )
