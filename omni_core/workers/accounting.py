"""Process-scoped GPU memory accounting.

The figure a worker reports is *this process's* GPU memory, read from
`nvmlDeviceGetComputeRunningProcesses` on the physical device the process runs on. A
device-wide delta (total - free) counts every other process on the GPU too, so two stages
initialising side by side would each see the other's allocations as their own.

The physical device is resolved from CUDA_VISIBLE_DEVICES, whose entries may be indices
("0,1"), GPU UUIDs ("GPU-8f2e...", a unique prefix is enough, as for CUDA itself), MIG
UUIDs ("MIG-4b1c...") or the pre-R470 MIG form ("MIG-GPU-<uuid>/<gi>/<ci>").

When NVML is missing or does not list our PID (a container with its own PID namespace, the
Kubernetes default), the figure is never the device-wide used bytes (every neighbour's too,
which would size a stage's caches to nothing and refuse its start): NVML's entry for this
process is found by its growth since the rank started (NVML lists host PIDs), and failing
that the figure is the process's own tally: what torch's allocator reserved, less what the
memory backend unmapped under it, plus the CUDA context. The source string says which; on a
machine without CUDA there is no figure at all ("none: ...").
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

NVML = "nvml"
TALLY = "own-tally"
# The CUDA context's device memory before the rank's entry is found (driver, cuBLAS handles,
# kernel images): 0.5 GiB on the H100/H200 here with torch 2.11. Once NVML's entry for this
# process is known, the context is measured instead (its bytes less torch's reserved).
CONTEXT_ESTIMATE_BYTES = 512 << 20
# An NVML entry is this process's when it grew by what torch reserved since the rank started,
# within this much (the context grows by a few MiB at the first kernels)...
_MATCH_TOLERANCE_BYTES = 96 << 20
# ... and only after enough growth that a neighbour's coincidence is unlikely.
_MATCH_MIN_GROWTH_BYTES = 256 << 20
_UUID_BODY = r"[0-9A-Fa-f]{1,8}(?:-[0-9A-Fa-f]{1,12})*"
_GPU_RE = re.compile(rf"^GPU-{_UUID_BODY}$")
_MIG_RE = re.compile(rf"^MIG-{_UUID_BODY}$")
_MIG_LEGACY_RE = re.compile(rf"^MIG-(GPU-{_UUID_BODY})/(\d+)/(\d+)$")

EntryKind = Literal["index", "gpu_uuid", "mig_uuid", "mig_legacy"]


class DeviceResolutionError(ValueError):
    """CUDA_VISIBLE_DEVICES (or the requested device) names no device NVML can find."""


@dataclass(frozen=True)
class VisibleDevice:
    """One CUDA_VISIBLE_DEVICES entry, parsed."""

    kind: EntryKind
    value: str  # the index as text, or the UUID (for mig_legacy: the parent GPU UUID)
    gpu_instance: int | None = None  # mig_legacy only
    compute_instance: int | None = None  # mig_legacy only


def parse_cuda_visible_devices(value: str | None) -> list[VisibleDevice] | None:
    """Parse CUDA_VISIBLE_DEVICES. `None` (unset) means every device, in NVML order.

    CUDA itself silently stops at the first entry it cannot parse and hides everything
    after it; a worker that guessed the same way would account another GPU's memory. So an
    entry that is not an index or a UUID is an error here, naming the entry.
    """
    if value is None:
        return None
    text = value.strip()
    if text == "" or text == "-1":
        raise DeviceResolutionError(
            f"CUDA_VISIBLE_DEVICES={value!r} hides every GPU from this process; unset it or "
            "list the device to use (an index such as 0, GPU-<uuid> or MIG-<uuid>)"
        )
    entries: list[VisibleDevice] = []
    for raw in text.split(","):
        item = raw.strip()
        if item.isdigit():
            entries.append(VisibleDevice("index", str(int(item))))
        elif _GPU_RE.match(item):
            entries.append(VisibleDevice("gpu_uuid", item))
        elif m := _MIG_LEGACY_RE.match(item):
            entries.append(VisibleDevice("mig_legacy", m.group(1), int(m.group(2)), int(m.group(3))))
        elif _MIG_RE.match(item):
            entries.append(VisibleDevice("mig_uuid", item))
        else:
            raise DeviceResolutionError(
                f"CUDA_VISIBLE_DEVICES={value!r}: entry {item!r} is neither a device index "
                "(0, 1, ...) nor GPU-<uuid> nor MIG-<uuid> (nor MIG-GPU-<uuid>/<gi>/<ci>); "
                "`nvidia-smi -L` lists valid names"
            )
    seen: set[tuple[str, str, int | None, int | None]] = set()
    for entry in entries:
        key = (entry.kind, entry.value.lower(), entry.gpu_instance, entry.compute_instance)
        if key in seen:
            raise DeviceResolutionError(
                f"CUDA_VISIBLE_DEVICES={value!r} lists {entry.value!r} twice; CUDA refuses "
                "duplicate devices, list each once"
            )
        seen.add(key)
    return entries


class NvmlApi(Protocol):
    """The few NVML calls accounting needs; tests pass a fake table instead of the driver."""

    def device_count(self) -> int: ...
    def handle_by_index(self, index: int) -> Any: ...
    def uuid(self, handle: Any) -> str: ...
    def mig_handles(self, handle: Any) -> list[Any]: ...
    def mig_ids(self, handle: Any) -> tuple[int, int]: ...  # (gpu instance, compute instance)
    def total_bytes(self, handle: Any) -> int: ...
    def process_bytes(self, handle: Any) -> dict[int, int]: ...  # pid -> used bytes


@dataclass(frozen=True)
class PhysicalDevice:
    handle: Any
    uuid: str
    description: str  # e.g. "CUDA_VISIBLE_DEVICES entry 1 -> GPU-8f2e... (NVML index 3)"


def _match_uuid(wanted: str, candidates: list[tuple[str, Any]], what: str) -> tuple[str, Any]:
    exact = [c for c in candidates if c[0].lower() == wanted.lower()]
    if exact:
        return exact[0]
    prefixed = [c for c in candidates if c[0].lower().startswith(wanted.lower())]
    if len(prefixed) == 1:
        return prefixed[0]
    known = ", ".join(c[0] for c in candidates) or "none"
    if len(prefixed) > 1:
        raise DeviceResolutionError(
            f"{what} {wanted!r} is a prefix of several devices ({known}); give more of the UUID"
        )
    raise DeviceResolutionError(
        f"{what} {wanted!r} matches no device NVML sees (it sees: {known}); check `nvidia-smi -L`"
    )


def resolve_physical_device(entries: list[VisibleDevice] | None, local_index: int, nvml: NvmlApi) -> PhysicalDevice:
    """The NVML handle of the device this process calls `cuda:<local_index>`.

    Index entries are NVML indices, which match CUDA's only with CUDA_DEVICE_ORDER=PCI_BUS_ID
    (vLLM makes the same assumption); UUID entries are unambiguous.
    """
    count = nvml.device_count()
    if entries is None:
        if not 0 <= local_index < count:
            raise DeviceResolutionError(f"device cuda:{local_index} does not exist: NVML sees {count} GPU(s)")
        handle = nvml.handle_by_index(local_index)
        return PhysicalDevice(handle, nvml.uuid(handle), f"NVML index {local_index} (CUDA_VISIBLE_DEVICES unset)")
    if not 0 <= local_index < len(entries):
        raise DeviceResolutionError(
            f"device cuda:{local_index} does not exist: CUDA_VISIBLE_DEVICES lists {len(entries)} device(s)"
        )
    entry = entries[local_index]
    where = f"CUDA_VISIBLE_DEVICES entry {local_index} ({entry.value!r})"
    if entry.kind == "index":
        index = int(entry.value)
        if index >= count:
            raise DeviceResolutionError(f"{where}: NVML sees only {count} GPU(s), indices 0..{count - 1}")
        handle = nvml.handle_by_index(index)
        return PhysicalDevice(handle, nvml.uuid(handle), f"{where} -> NVML index {index}")
    gpus = [(nvml.uuid(h), h) for h in (nvml.handle_by_index(i) for i in range(count))]
    if entry.kind == "gpu_uuid":
        uuid, handle = _match_uuid(entry.value, gpus, "GPU UUID")
        return PhysicalDevice(handle, uuid, f"{where} -> {uuid}")
    if entry.kind == "mig_uuid":
        migs = [(nvml.uuid(m), m) for _, g in gpus for m in nvml.mig_handles(g)]
        uuid, handle = _match_uuid(entry.value, migs, "MIG UUID")
        return PhysicalDevice(handle, uuid, f"{where} -> {uuid}")
    parent_uuid, parent = _match_uuid(entry.value, gpus, "GPU UUID")
    for mig in nvml.mig_handles(parent):
        if nvml.mig_ids(mig) == (entry.gpu_instance, entry.compute_instance):
            uuid = nvml.uuid(mig)
            return PhysicalDevice(mig, uuid, f"{where} -> {uuid}")
    raise DeviceResolutionError(
        f"{where}: GPU {parent_uuid} has no MIG device with GPU instance {entry.gpu_instance} and "
        f"compute instance {entry.compute_instance}; `nvidia-smi -L` lists the MIG devices"
    )


class PynvmlApi:
    """`NvmlApi` over nvidia-ml-py (pynvml)."""

    def __init__(self) -> None:
        import pynvml

        self._nvml = pynvml
        pynvml.nvmlInit()

    def device_count(self) -> int:
        return int(self._nvml.nvmlDeviceGetCount())

    def handle_by_index(self, index: int) -> Any:
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    def uuid(self, handle: Any) -> str:
        value = self._nvml.nvmlDeviceGetUUID(handle)
        return value.decode() if isinstance(value, bytes) else str(value)

    def mig_handles(self, handle: Any) -> list[Any]:
        nv = self._nvml
        try:
            current, _pending = nv.nvmlDeviceGetMigMode(handle)
        except nv.NVMLError:
            return []  # not MIG-capable
        if current != nv.NVML_DEVICE_MIG_ENABLE:
            return []
        found = []
        for i in range(nv.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                found.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
            except nv.NVMLError:
                continue  # empty slot
        return found

    def mig_ids(self, handle: Any) -> tuple[int, int]:
        nv = self._nvml
        return (int(nv.nvmlDeviceGetGpuInstanceId(handle)), int(nv.nvmlDeviceGetComputeInstanceId(handle)))

    def total_bytes(self, handle: Any) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)

    def process_bytes(self, handle: Any) -> dict[int, int]:
        used: dict[int, int] = {}
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            # usedGpuMemory is None where the driver withholds it (some MIG/vGPU setups).
            if proc.usedGpuMemory is not None:
                used[int(proc.pid)] = used.get(int(proc.pid), 0) + int(proc.usedGpuMemory)
        return used


@dataclass(frozen=True)
class MemoryFigure:
    """This process's GPU bytes (None when there is no figure) and where it came from."""

    process_bytes: int | None
    source: str


def available_memory_bytes(total_bytes: int, fraction: float, process_bytes: int) -> int:
    """total x fraction - what this process already holds (never below 0).

    Counting only our own process is what lets several stages size themselves on one GPU
    at the same time: each gets its fraction of the card, not of what the others left.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"memory fraction must be in (0, 1], got {fraction!r}")
    return max(0, int(total_bytes * fraction) - process_bytes)


@dataclass(frozen=True)
class OwnTally:
    """What this process holds by its own count, for where NVML cannot say: torch's reserved
    bytes on the device, less those the memory backend unmapped while the allocator keeps their
    addresses (a cumem pool asleep), plus the CUDA context."""

    torch_reserved: Callable[[], int]
    unmapped_reserved: Callable[[], int] = lambda: 0

    def allocator_bytes(self) -> int:
        return max(0, self.torch_reserved() - self.unmapped_reserved())


class ProcessMemory:
    """Measures this process's GPU memory on one torch device, saying which source it used."""

    def __init__(
        self,
        device: Any,
        *,
        nvml: NvmlApi | None = None,
        pid: int | None = None,
        visible_devices: str | Literal["env"] | None = "env",
        tally: OwnTally | None = None,
    ) -> None:
        import torch

        self.device = torch.device(device)
        self.pid = os.getpid() if pid is None else pid
        self.physical: PhysicalDevice | None = None
        self.nvml: NvmlApi | None = None
        self.nvml_problem = ""
        self.tally = tally
        self.context_bytes = CONTEXT_ESTIMATE_BYTES
        self.own_entry: int | None = None  # NVML's pid for this process where it lists another
        self._entries_at_start: dict[int, int] = {}
        self._allocator_at_start = 0
        if self.device.type != "cuda":
            self.nvml_problem = f"no CUDA (device {self.device})"
            return
        if self.tally is None:
            self.tally = OwnTally(lambda: int(torch.cuda.memory_reserved(self.device)))
        env = os.environ.get("CUDA_VISIBLE_DEVICES") if visible_devices == "env" else visible_devices
        try:
            self.nvml = nvml if nvml is not None else PynvmlApi()
            local = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.physical = resolve_physical_device(parse_cuda_visible_devices(env), local, self.nvml)
        except DeviceResolutionError:
            raise  # a wrong CUDA_VISIBLE_DEVICES is the user's to fix, not to paper over
        except Exception as exc:  # NVML library missing, driver too old, no permission
            self.nvml = None
            self.nvml_problem = f"NVML unavailable: {type(exc).__name__}: {exc}"
        self._entries_at_start = self.device_processes()[0]
        self._allocator_at_start = self.tally.allocator_bytes()

    def set_unmapped_reserved(self, unmapped_reserved: Callable[[], int]) -> None:
        """Name what the memory backend unmapped under torch's allocator (the rank does, once
        its backend exists), so the own tally of a sleeping rank does not count it."""
        assert self.tally is not None, "no tally without CUDA"
        self.tally = OwnTally(self.tally.torch_reserved, unmapped_reserved)

    def measure(self) -> MemoryFigure:
        if self.device.type != "cuda":
            return MemoryFigure(None, f"none: {self.nvml_problem}")
        used, why = self.device_processes()
        if not why:
            if self.pid in used:
                return MemoryFigure(used[self.pid], NVML)
            why = f"NVML does not list pid {self.pid} (PID namespace?)"
            entry = self._find_own_entry(used)
            if entry is not None:
                return MemoryFigure(used[entry], f"{NVML}: this process's entry is pid {entry} ({why})")
        assert self.tally is not None
        allocator = self.tally.allocator_bytes()
        return MemoryFigure(
            allocator + self.context_bytes,
            f"{TALLY}: torch reserved {allocator} + CUDA context {self.context_bytes} bytes ({why})",
        )

    def _find_own_entry(self, used: dict[int, int]) -> int | None:
        """NVML's entry for this process where it lists host PIDs: the one entry that grew by
        what torch reserved since the rank started (or appeared, holding about that plus the
        context). Kept once found; its bytes less torch's then measure the context."""
        if self.own_entry in used:
            return self.own_entry
        assert self.tally is not None
        allocator = self.tally.allocator_bytes()
        growth = allocator - self._allocator_at_start
        if growth < _MATCH_MIN_GROWTH_BYTES:
            return None
        matches = [
            pid
            for pid, nbytes in used.items()
            if abs(nbytes - self._entries_at_start.get(pid, 0) - growth) <= _MATCH_TOLERANCE_BYTES
            or (pid not in self._entries_at_start and 0 <= nbytes - allocator <= 4 * CONTEXT_ESTIMATE_BYTES)
        ]
        if len(matches) != 1:
            return None
        self.own_entry = matches[0]
        self.context_bytes = max(0, used[matches[0]] - allocator)
        return self.own_entry

    def device_processes(self) -> tuple[dict[int, int], str]:
        """Every process NVML lists on this device with its bytes (pid -> bytes), and why the
        table is empty when NVML cannot give it ("" when it could)."""
        if self.nvml is None or self.physical is None:
            return {}, self.nvml_problem or "NVML unavailable"
        try:
            return dict(self.nvml.process_bytes(self.physical.handle)), ""
        except Exception as exc:
            return {}, f"NVML query failed: {type(exc).__name__}: {exc}"

    def total_bytes(self) -> int:
        if self.nvml is not None and self.physical is not None:
            return self.nvml.total_bytes(self.physical.handle)
        import torch

        return int(torch.cuda.mem_get_info(self.device)[1])

    def determine_available_memory(self, fraction: float) -> tuple[int, MemoryFigure]:
        """Bytes this process may still allocate to stay within `fraction` of the device, and
        the figure it was computed from (its source says whether others were counted)."""
        if self.device.type != "cuda":
            raise RuntimeError(f"determine_available_memory needs a CUDA device, this process uses {self.device}")
        figure = self.measure()
        return available_memory_bytes(self.total_bytes(), fraction, figure.process_bytes or 0), figure


def determine_available_memory(fraction: float, device: Any = "cuda") -> int:
    """total x fraction - this process's use, on `device` (see `ProcessMemory`)."""
    return ProcessMemory(device).determine_available_memory(fraction)[0]
