"""The cumem backend: vLLM's CuMemAllocator (virtual-memory backed tagged pools).

Tensors allocated inside `pool(tag)` get physical memory through cuMemCreate/cuMemMap at a
reserved virtual address. Sleep unmaps the physical memory (copying an offloaded tag to
host first); wake maps new physical memory at the *same* address. Tensors, raw pointers
and captured CUDA graphs therefore stay valid: `stable_addresses` and `cuda_graphs`.

vLLM versions differ in the allocator's details, so this module relies only on what every
version since 0.26 has (`get_instance`, `use_memory_pool(tag)`, `sleep(offload_tags)`,
`wake_up(tags)`, `pointer_to_data` of `AllocationData(handle, tag, cpu_backup_tensor)`,
and the module functions `unmap_and_release` / `libcudart.cudaMemcpy`) and reads the rest:

- 0.26 marks each allocation `is_asleep`; later trees mark `is_mapped` instead and add a
  `keep_tags` argument to `sleep`; some have neither flag.
- `CuMemAllocator.sleep` acts on *every* allocation (offloading some, discarding the rest)
  and, in 0.26, would unmap an allocation twice if it were already asleep.

So a sleep that covers every tag while nothing is asleep goes through vLLM's own
`sleep`; a sleep of some tags uses `keep_tags` where the allocator has it; otherwise (and
whenever some tag is already asleep) it releases the chosen allocations one by one with
the same module functions vLLM's `sleep` uses, setting whichever flag the version has.
Wake always goes through vLLM's `wake_up(tags)`: the backend only ever wakes tags whose
allocations are all asleep, which every version handles.
"""

from __future__ import annotations

import importlib
import inspect
from collections import deque
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from types import ModuleType
from typing import Any, NamedTuple

import torch

from omni_core.fsm.tags import CUDA_GRAPH_TAG
from omni_core.protocol import Capability
from omni_core.workers.backends.base import BackendStateError, BackendUnavailable, MemoryBackend
from omni_core.workers.memory_gate import MemoryGate, MemoryWaitExpired

CUMEM_MODULE = "vllm.device_allocator.cumem"
INSTALL_HINT = "install vLLM >= 0.26 with CUDA support: pip install 'omni-core[vllm]'"
_REQUIRED = ("get_instance", "use_memory_pool", "sleep", "wake_up")


def cumem_unavailable_reason(device: torch.device) -> str | None:
    """Why the cumem backend cannot run here (None when it can). Checked at start-up so
    that a missing piece fails the worker's Hello, never its first sleep."""
    device = torch.device(device)
    if device.type != "cuda":
        return (
            f"the cumem backend needs a CUDA device but this worker is configured for "
            f"device {str(device)!r}; set WorkerConfig.device='cuda' or use backend 'portable'"
        )
    if not torch.cuda.is_available():
        build = (
            "a CPU-only build"
            if torch.version.cuda is None and torch.version.hip is None
            else f"built for CUDA {torch.version.cuda}"
        )
        return (
            f"torch {torch.__version__} ({build}) sees no CUDA device (torch.cuda.is_available() "
            "is False); run on a machine with an NVIDIA GPU and a CUDA build of torch, or use "
            "backend 'portable'"
        )
    try:
        module = importlib.import_module(CUMEM_MODULE)
    except Exception as exc:  # ImportError, or vLLM failing its own import-time checks
        return f"cannot import {CUMEM_MODULE} ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    if not getattr(module, "cumem_available", False):
        return (
            f"{CUMEM_MODULE} imported but its C extension vllm.cumem_allocator did not load "
            "(cumem_available is False); reinstall a vLLM wheel built for this CUDA and torch"
        )
    allocator = getattr(module, "CuMemAllocator", None)
    missing = [name for name in _REQUIRED if not hasattr(allocator, name)]
    if allocator is None or missing:
        return (
            f"this vLLM's CuMemAllocator lacks {missing or ['the class itself']}; omni-core "
            f"supports the allocator of vLLM >= 0.26: {INSTALL_HINT}"
        )
    return None


def _load_module(device: torch.device) -> ModuleType:
    reason = cumem_unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailable(f"backend 'cumem' is unavailable: {reason}")
    return importlib.import_module(CUMEM_MODULE)


SLEEP_PATHS_KEPT = 64
# omni-core's tag -> the allocator's, where vLLM names a pool it fills itself otherwise: its
# CUDA graph pool (`sleep_mode_offload_cudagraph`, CuMemAllocator.cudagraph_pool) is "cudagraph".
ALLOCATOR_TAG = {CUDA_GRAPH_TAG: "cudagraph"}
_OUR_TAG = {theirs: ours for ours, theirs in ALLOCATOR_TAG.items()}


def ours(allocator_tag: str) -> str:
    return _OUR_TAG.get(allocator_tag, allocator_tag)


def theirs(tags: frozenset[str] | set[str]) -> tuple[str, ...]:
    return tuple(sorted(ALLOCATOR_TAG.get(tag, tag) for tag in tags))


class Handle(NamedTuple):
    """vLLM's `AllocationData.handle`, as its extension's create/unmap calls take it."""

    device: int
    size: int  # bytes
    d_mem: int  # the device address the allocation is mapped at
    p_memory: int  # the physical memory handle (cuMemCreate)


def handle_of(data: Any) -> Handle:
    return Handle(*data.handle)


class CumemBackend(MemoryBackend):
    name = "cumem"
    capabilities = (Capability.LEVEL2, Capability.PARTIAL_WAKE, Capability.STABLE_ADDRESSES, Capability.CUDA_GRAPHS)
    supports_memory_gate = True  # gated per allocation, before cuMemCreate/cuMemMap
    supports_host_refit = True  # an offloaded allocation's bytes are its cpu_backup_tensor

    def __init__(self, device: torch.device, *, module: Any = None) -> None:
        """`module` stands in for vllm.device_allocator.cumem (tests pass a fake one)."""
        super().__init__(device)
        self._mod = _load_module(self.device) if module is None else module
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.allocator = self._mod.CuMemAllocator.get_instance()
        self._has_keep_tags = "keep_tags" in inspect.signature(self.allocator.sleep).parameters
        # Which code path each recent sleep took (tests, trace); bounded, a worker sleeps for weeks.
        self.sleep_paths: deque[str] = deque(maxlen=SLEEP_PATHS_KEPT)

    # ------------------------------------------------------------------ allocations

    @contextmanager
    def _pool(self, tag: str) -> Iterator[None]:
        with self._on_device(), self.allocator.use_memory_pool(tag=tag):
            yield

    def _on_device(self) -> AbstractContextManager[Any]:
        # The allocator maps on the *current* device: make it ours for every call.
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    def _allocations(self, tags: frozenset[str] | set[str] | None = None) -> list[tuple[int, Any]]:
        return [
            (ptr, data)
            for ptr, data in self.allocator.pointer_to_data.items()
            if tags is None or ours(data.tag) in tags
        ]

    def _is_asleep(self, data: Any) -> bool:
        if hasattr(data, "is_asleep"):
            return bool(data.is_asleep)
        if hasattr(data, "is_mapped"):
            return not data.is_mapped
        return ours(data.tag) in self.asleep  # a version without flags: tags sleep whole

    @staticmethod
    def _mark(data: Any, *, asleep: bool) -> None:
        if hasattr(data, "is_asleep"):
            data.is_asleep = asleep
        if hasattr(data, "is_mapped"):
            data.is_mapped = not asleep

    def tag_of(self, tensor: torch.Tensor) -> str | None:
        address = tensor.untyped_storage().data_ptr()
        for ptr, data in self._allocations():
            if ptr <= address < ptr + handle_of(data).size:
                return ours(data.tag)
        return None

    # ------------------------------------------------------------------ sleep / wake

    def _sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None:
        tags = offload | discard
        allocator_tags = {ours(data.tag) for _, data in self._allocations()}
        nothing_asleep = not any(self._is_asleep(d) for _, d in self._allocations())
        if nothing_asleep and tags >= allocator_tags:
            self.sleep_paths.append("vllm-sleep")
            self.allocator.sleep(offload_tags=theirs(offload))
        elif nothing_asleep and self._has_keep_tags:
            self.sleep_paths.append("vllm-sleep-keep-tags")
            self.allocator.sleep(offload_tags=theirs(offload), keep_tags=theirs(allocator_tags - tags))
        else:
            self.sleep_paths.append("per-allocation")
            self._sleep_allocations(offload, tags)

    def _sleep_allocations(self, offload: frozenset[str], tags: frozenset[str]) -> None:
        """vLLM's sleep loop restricted to `tags` (for versions whose sleep cannot be)."""
        for ptr, data in self._allocations(tags):
            if self._is_asleep(data):
                continue  # released by an earlier partial sleep; unmapping twice breaks the handle
            size = handle_of(data).size
            if ours(data.tag) in offload:
                host = torch.empty(size, dtype=torch.uint8, device="cpu", pin_memory=self._pin)
                self._mod.libcudart.cudaMemcpy(host.data_ptr(), ptr, size)
                data.cpu_backup_tensor = host
            try:
                self._mod.unmap_and_release(data.handle)
            finally:
                self._mark(data, asleep=True)

    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None) -> None:
        with self._on_device():
            if gate is None:
                # A caller of `wake` outside a rank (benchmarks/memory.py, the version tests):
                # vLLM's own wake_up. A rank on CUDA always passes a gate, even without a wait.
                self.allocator.wake_up(tags=list(theirs(tags)))
            else:
                self._wake_gated(tags, gate)
        for _, data in self._allocations(tags):
            self._mark(data, asleep=False)  # versions without flags: keep ours consistent

    def _wake_gated(self, tags: frozenset[str], gate: MemoryGate) -> None:
        """vLLM's wake_up loop with each map admitted by `gate`; the host copies are dropped
        only once every allocation is back, so an expired wait can unmap and leave them."""
        allocs = [(p, d) for p, d in self._allocations(tags) if self._is_asleep(d)]
        gate.expect(sum(handle_of(d).size for _, d in allocs))
        mapped: list[tuple[int, Any]] = []
        try:
            for ptr, data in allocs:
                size = handle_of(data).size
                gate.admit(size, partial(self._mod.create_and_map, data.handle))
                self._mark(data, asleep=False)
                mapped.append((ptr, data))
                if data.cpu_backup_tensor is not None:  # synchronous, as in vLLM's wake_up
                    self._mod.libcudart.cudaMemcpy(ptr, data.cpu_backup_tensor.data_ptr(), size)
        except MemoryWaitExpired:
            for _, data in mapped:
                self._mod.unmap_and_release(data.handle)
                self._mark(data, asleep=True)
                gate.release(handle_of(data).size)
            raise
        for _, data in allocs:
            data.cpu_backup_tensor = None

    def adopt(self, tag: str) -> None:
        if tag not in ALLOCATOR_TAG:
            super().adopt(tag)
        elif tag not in self.tags:
            self.tags.append(tag)

    def _host_copy_of(self, tag: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        # Asleep, a tensor keeps its virtual address: the allocation holding it names its backup.
        address = tensor.untyped_storage().data_ptr()
        for ptr, data in self._allocations({tag}):
            if ptr <= address < ptr + handle_of(data).size:
                if not self._is_asleep(data) or data.cpu_backup_tensor is None:
                    break
                return data.cpu_backup_tensor, address - ptr
        raise BackendStateError(
            f"the tensor at {address:#x} has no host copy in {tag!r} (outside its pool, or discarded "
            "by a level-2 sleep); wake the tag and update on the device"
        )

    def _resident_bytes(self, tag: str) -> int:
        return sum(handle_of(d).size for _, d in self._allocations({tag}) if not self._is_asleep(d))

    def unmapped_reserved_bytes(self) -> int:
        # Asleep, an allocation is unmapped but keeps its segment in the MemPool torch counts.
        return sum(handle_of(d).size for _, d in self._allocations() if self._is_asleep(d))

    def _host_bytes(self) -> int:
        return sum(d.cpu_backup_tensor.numel() for _, d in self._allocations() if d.cpu_backup_tensor is not None)

    def release(self) -> None:
        super().release()
        for _, data in self._allocations():
            data.cpu_backup_tensor = None

    @property
    def last_sleep_path(self) -> str:
        return self.sleep_paths[-1] if self.sleep_paths else ""

    @property
    def hard_exit_required(self) -> bool:
        # Freeing an allocation that is asleep makes the extension unmap a handle that is not
        # mapped (its error state then breaks every later call), and tearing down pluggable
        # allocator pools at interpreter exit can abort (pytorch/pytorch#145168). The driver
        # reclaims every mapping and reservation when the process exits, so after Shutdown
        # the worker leaves with os._exit instead of freeing tensor by tensor.
        return True
