"""The cumem backend's dispatch against stand-ins of three CuMemAllocator generations.

The stand-ins copy the loop structure of vLLM's `sleep`/`wake_up` (0.26: `is_asleep`;
later trees: `is_mapped` plus `keep_tags`; older: no flag) over fake device memory that
refuses a double map or a double unmap, as the real extension does. They check the
backend's choice of code path, that partial sleeps never touch an allocation twice, and
that offloaded bytes come back while discarded ones do not. The real allocator runs in
test_gpu_backends.py on the device machine.
"""

from __future__ import annotations

import ctypes
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from omni_core.workers.backends import CumemBackend

W, KV = "weights", "kv_cache"
GARBAGE = 0xA5


@dataclass
class Data:
    handle: tuple[int, int, int, int]
    tag: str
    cpu_backup_tensor: Any = None


class FakeCumemModule:
    """What the backend uses of vllm.device_allocator.cumem, over fake device memory."""

    def __init__(self, variant: str) -> None:
        self.variant = variant
        self.memory: dict[int, bytearray] = {}  # mapped address -> bytes
        self.libcudart = self
        module = self

        class CuMemAllocator:
            instance = None

            @staticmethod
            def get_instance():
                if CuMemAllocator.instance is None:
                    CuMemAllocator.instance = FakeAllocator(module)
                return CuMemAllocator.instance

            use_memory_pool = sleep = wake_up = True  # presence, as checked at start-up

        self.CuMemAllocator = CuMemAllocator

    def unmap_and_release(self, handle) -> None:
        inside = any(p < handle[2] < p + len(b) for p, b in self.memory.items())
        if handle[2] not in self.memory and not inside:
            raise RuntimeError(f"CUDA Error: unmap of {handle[2]:#x}, which is not mapped")
        if inside or len(self.memory[handle[2]]) != handle[1]:  # the driver unmaps whole mappings only
            raise RuntimeError(f"CUDA Error: unmap of {handle[2]:#x}+{handle[1]}, part of a larger mapping")
        del self.memory[handle[2]]

    def create_and_map(self, handle) -> None:
        if handle[2] in self.memory:
            raise RuntimeError(f"CUDA Error: map of {handle[2]:#x}, which is mapped")
        self.memory[handle[2]] = bytearray([GARBAGE]) * handle[1]

    def cudaMemcpy(self, dst: int, src: int, count: int) -> None:  # vLLM's name
        if src in self.memory:
            ctypes.memmove(dst, bytes(self.memory[src][:count]), count)
        elif dst in self.memory:
            self.memory[dst][:count] = ctypes.string_at(src, count)
        else:
            raise RuntimeError("cudaMemcpy between two unmapped addresses")


class FakeAllocator:
    def __init__(self, module: FakeCumemModule) -> None:
        self.m = module
        self.pointer_to_data: dict[int, Data] = {}
        self.current_tag = "default"
        self._next = 0x7F0000000000
        # vLLM >= 0.11 keeps its two callbacks as attributes; its C extension calls the free
        # one when torch gives a segment back (tests/workers/test_fast_runs.py plays that part)
        self.python_malloc_callback = None
        self.python_free_callback = self._python_free_callback
        if module.variant == "keep_tags":

            def sleep(offload_tags=None, keep_tags=None):
                return self._sleep(offload_tags, keep_tags or ())

            self.sleep = sleep

    def _python_free_callback(self, ptr: int):
        return self.pointer_to_data.pop(ptr).handle

    @contextmanager
    def use_memory_pool(self, tag=None):
        old, self.current_tag = self.current_tag, tag
        try:
            yield
        finally:
            self.current_tag = old

    def malloc(self, size: int, fill: int) -> int:
        ptr, self._next = self._next, self._next + size
        data = Data((0, size, ptr, ptr + 1), self.current_tag)  # a handle cell of its own
        if self.m.variant == "0.26":
            data.is_asleep = False
        elif self.m.variant == "keep_tags":
            data.is_mapped = True
        self.pointer_to_data[ptr] = data
        self.m.create_and_map(data.handle)
        self.m.memory[ptr][:] = bytes([fill]) * size
        return ptr

    def sleep(self, offload_tags=None):  # 0.26 and older: every allocation, no skipping
        return self._sleep(offload_tags, ())

    def _sleep(self, offload_tags, keep_tags) -> None:
        for ptr, data in self.pointer_to_data.items():
            if self.m.variant == "keep_tags" and not data.is_mapped:
                continue
            if data.tag in keep_tags:
                continue
            if data.tag in offload_tags:
                data.cpu_backup_tensor = torch.empty(data.handle[1], dtype=torch.uint8)
                self.m.cudaMemcpy(data.cpu_backup_tensor.data_ptr(), ptr, data.handle[1])
            self.m.unmap_and_release(data.handle)
            if self.m.variant == "0.26":
                data.is_asleep = True
            elif self.m.variant == "keep_tags":
                data.is_mapped = False

    def wake_up(self, tags=None) -> None:
        for ptr, data in self.pointer_to_data.items():
            if tags is not None and data.tag not in tags:
                continue
            if self.m.variant == "keep_tags" and data.is_mapped:
                continue
            self.m.create_and_map(data.handle)
            if self.m.variant == "0.26":
                data.is_asleep = False
            elif self.m.variant == "keep_tags":
                data.is_mapped = True
            if data.cpu_backup_tensor is not None:
                self.m.cudaMemcpy(ptr, data.cpu_backup_tensor.data_ptr(), data.handle[1])
                data.cpu_backup_tensor = None


VARIANTS = ["0.26", "keep_tags", "no_flags"]


@pytest.fixture(params=VARIANTS)
def setup(request):
    module = FakeCumemModule(request.param)
    backend = CumemBackend(torch.device("cpu"), module=module)
    ptrs = {}
    for tag, fill, sizes in ((W, 0x11, (4096, 8192)), (KV, 0x22, (16384,))):
        with backend.pool(tag):
            ptrs[tag] = [backend.allocator.malloc(size, fill) for size in sizes]
    return request.param, module, backend, ptrs


def content(module, ptrs) -> set[int]:
    return {b for p in ptrs for b in module.memory[p]}


def test_full_sleep_goes_through_vllm_and_restores_offloaded_bytes(setup):
    _, module, backend, ptrs = setup
    assert backend.usage() == {W: 12288, KV: 16384}
    backend.sleep({W}, {KV})
    assert list(backend.sleep_paths) == ["vllm-sleep"]
    assert module.memory == {} and backend.usage() == {W: 0, KV: 0}
    assert backend.host_bytes() == 12288  # weights only; KV discarded
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {0x11} and content(module, ptrs[KV]) == {GARBAGE}
    assert backend.host_bytes() == 0 and backend.usage() == {W: 12288, KV: 16384}


def test_level2_discards_everything(setup):
    _, module, backend, ptrs = setup
    backend.sleep(set(), {W, KV})
    assert backend.host_bytes() == 0
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {GARBAGE}


def test_partial_sleeps_and_wakes_touch_each_allocation_once(setup):
    variant, module, backend, ptrs = setup
    backend.sleep(set(), {KV})  # KV only, weights stay mapped and untouched
    assert set(module.memory) == set(ptrs[W]) and backend.usage() == {W: 12288, KV: 0}
    backend.sleep({W}, set())  # the rest, with KV already asleep: no double unmap
    assert module.memory == {}
    expected_first = "vllm-sleep-keep-tags" if variant == "keep_tags" else "per-allocation"
    assert list(backend.sleep_paths) == [expected_first, "per-allocation"]
    backend.wake({W})  # partial wake: no double map of anything
    assert set(module.memory) == set(ptrs[W]) and content(module, ptrs[W]) == {0x11}
    backend.wake({KV})
    assert set(module.memory) == set(ptrs[W] + ptrs[KV])
    backend.sleep({W}, {KV})  # and a whole sleep again after all that
    assert backend.sleep_paths[-1] == "vllm-sleep" and module.memory == {}
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {0x11}


def test_declares_stable_addresses_and_graphs(setup):
    _, _, backend, _ = setup
    assert {c.value for c in backend.capabilities} == {"level2", "partial_wake", "stable_addresses", "cuda_graphs"}
    assert backend.hard_exit_required
