"""Runs (runs.py): touching allocations of one tag woken into one physical allocation, on CPU.

`FakeSpans` maps a run as one piece of the fake device memory, so a copy into a member
lands inside it, and `DeferredOps` fails a queued copy whose memory was unmapped before it
ran: a run unmapped before its last member's bytes were copied out shows.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from omni_core.workers.backends.cuda_driver import CudaDriverError
from omni_core.workers.backends.fast import DEFAULT_RUN_BYTES, FastBackend
from omni_core.workers.backends.runs import DriverSpans, FreeGuard, Runs

from .test_cumem_versions import GARBAGE, KV, FakeCumemModule, W
from .test_fast_backend import DeferredOps


class FakeSpans:
    def __init__(self, module: FakeCumemModule) -> None:
        self.m = module
        self.maps: list[tuple[int, int]] = []  # (ptr, nbytes) of each map_span
        self.unmaps: list[tuple[int, int]] = []
        self.adopts: list[tuple[int, int]] = []
        self.refuse_adopt = False  # as the driver would with no room for the scratch copy
        self._next_handle = 1
        self.refs: dict[int, int] = {}  # physical handle -> references not yet released
        self.cells: dict[int, int] = {}  # a stand-in's handle cell -> the handle it references
        self.freed_ranges: list[tuple[int, int]] = []  # address ranges given back (cuMemAddressFree)
        self.freed_cells: list[int] = []  # handle cells given back (free)
        self._next_decoy = 0x100000000000

    def _new_handle(self) -> int:
        self._next_handle += 1
        self.refs[self._next_handle] = 1
        return self._next_handle

    def map_span(self, nbytes: int, ptr: int) -> int:
        if any(p < ptr + nbytes and ptr < p + len(b) for p, b in self.m.memory.items()):
            raise RuntimeError(f"map of {ptr:#x}+{nbytes}, which overlaps a mapping")
        self.m.memory[ptr] = bytearray([GARBAGE]) * nbytes
        self.maps.append((ptr, nbytes))
        return self._new_handle()

    def decoy(self, nbytes: int, handle: int) -> tuple[int, int]:
        assert self.refs.get(handle, 0) > 0, f"a stand-in on handle {handle}, which is released"
        self._next_decoy += 1 << 30
        self.m.memory[self._next_decoy] = bytearray(nbytes)  # the run's memory, at another address
        self.refs[handle] += 1
        cell = self._next_decoy + 1
        self.cells[cell] = handle
        return self._next_decoy, cell

    def forget(self, nbytes: int, ptr: int, cell: int) -> None:
        assert not any(p <= ptr < p + len(b) for p, b in self.m.memory.items()), f"{ptr:#x} is still mapped"
        self.freed_ranges.append((ptr, nbytes))
        self.freed_cells.append(cell)

    def vllm_frees(self, allocator, ptr: int) -> None:
        """What vLLM's C extension does when torch gives the segment at `ptr` back (my_free):
        ask the free callback for the handle, unmap it and release the handle in its cell,
        free the address range, free the cell."""
        device, nbytes, d_mem, cell = allocator.python_free_callback(ptr)
        self.m.unmap_and_release((device, nbytes, d_mem, cell))  # refuses part of a larger mapping
        if cell in self.cells:
            self.refs[self.cells.pop(cell)] -= 1
        self.freed_ranges.append((d_mem, nbytes))
        self.freed_cells.append(cell)

    def adopt(self, nbytes: int, ptr: int, release_members) -> int:
        if self.refuse_adopt:
            raise RuntimeError("CUDA_ERROR_OUT_OF_MEMORY: no room for the scratch copy")
        kept = b"".join(bytes(self.m.memory[b][o : o + n]) for b, o, n in DeferredOps(self.m)._pieces(ptr, nbytes))
        release_members()
        assert not any(ptr <= p < ptr + nbytes for p in self.m.memory), "a member is still mapped"
        self.m.memory[ptr] = bytearray(kept)
        self.adopts.append((ptr, nbytes))
        return self._new_handle()

    def unmap_span(self, nbytes: int, ptr: int, handle: int) -> None:
        if len(self.m.memory.get(ptr, b"")) != nbytes:
            raise RuntimeError(f"unmap of {ptr:#x}+{nbytes}, which is not one mapping")
        del self.m.memory[ptr]
        self.unmaps.append((ptr, nbytes))
        self.refs[handle] -= 1


def device_bytes(ops: DeferredOps, ptr: int, nbytes: int) -> bytes:
    return b"".join(bytes(ops.m.memory[base][off : off + n]) for base, off, n in ops._pieces(ptr, nbytes))


def make(run_bytes: int, sizes_w=(4096, 8192, 12288), variant: str = "0.26", refuse_adopt: bool = False):
    module = FakeCumemModule(variant)
    ops = DeferredOps(module)
    spans = FakeSpans(module)
    spans.refuse_adopt = refuse_adopt
    backend = FastBackend(
        torch.device("cpu"), module=module, ops=ops, chunk_bytes=5000, run_bytes=run_bytes, spans=spans
    )
    ptrs = {}
    for tag, fill, sizes in ((W, 0x11, sizes_w), (KV, 0x22, (16384,))):
        with backend.pool(tag):
            ptrs[tag] = [backend.allocator.malloc(size, fill) for size in sizes]
    for i, p in enumerate(ptrs[W]):
        module.memory[p][:] = bytes((i * 31 + j) % 251 for j in range(len(module.memory[p])))
    before = [bytes(module.memory[p]) for p in ptrs[W]]
    for tag in (W, KV):
        backend.track(tag, [])  # the weights' touching allocations become runs here
    return module, ops, spans, backend, ptrs, before


@pytest.mark.parametrize("variant", ["0.26", "keep_tags", "no_flags"])
def test_a_tag_wakes_as_one_run_and_sleeps_with_one_unmap(variant: str) -> None:
    module, ops, spans, backend, ptrs, before = make(1 << 20, variant=variant)
    sizes = [4096, 8192, 12288]
    # at load the weights' three touching allocations became one run, their bytes kept
    assert spans.adopts == [(ptrs[W][0], sum(sizes))]
    assert [device_bytes(ops, p, n) for p, n in zip(ptrs[W], sizes, strict=True)] == before
    for cycle in range(3):
        backend.sleep({W}, {KV})
        assert module.memory == {}, f"cycle {cycle}: something stayed mapped"
        backend.wake({W, KV})
        # the weights' three touching ranges as one physical allocation; the KV (another tag,
        # alone) through its own vLLM handle
        assert spans.maps[-1] == (ptrs[W][0], sum(sizes))
        assert len(spans.maps) == cycle + 1
        got = [device_bytes(ops, p, n) for p, n in zip(ptrs[W], sizes, strict=True)]
        assert got == before, f"cycle {cycle}: a weight came back wrong"
        assert device_bytes(ops, ptrs[KV][0], 16384) == bytes([GARBAGE]) * 16384
    # every sleep, the first included, unmapped the run once
    assert spans.unmaps == [(ptrs[W][0], sum(sizes))] * 3
    assert backend.stats()["mapped_runs"] == 4


def test_runs_stop_at_run_bytes() -> None:
    _, ops, spans, backend, ptrs, before = make(12288)
    backend.sleep({W}, {KV})
    backend.wake({W})
    # the first two fill a run; the third, alone, is mapped through its own vLLM handle
    assert spans.maps == [(ptrs[W][0], 4096 + 8192)]
    assert ptrs[W][2] in ops.m.memory
    assert [device_bytes(ops, p, n) for p, n in zip(ptrs[W], (4096, 8192, 12288), strict=True)] == before


def test_clean_weights_sleep_by_unmapping_the_run() -> None:
    module, ops, _, backend, ptrs, before = make(1 << 20)
    backend.declare_read_only({W})
    backend.path.prepare((W,))  # the host copy, made while awake
    for _ in range(2):
        backend.sleep({W}, {KV})
        assert backend.path.stats.last["offloaded_bytes"] == 0  # nothing copied: the arena holds them
        backend.wake({W, KV})
        assert [device_bytes(ops, p, n) for p, n in zip(ptrs[W], (4096, 8192, 12288), strict=True)] == before
    assert module.memory.keys() == {ptrs[W][0], ptrs[KV][0]}


def test_a_sleep_that_fails_midway_leaves_the_run_mapped_and_the_wake_takes_it_back() -> None:
    module, ops, _, backend, ptrs, before = make(1 << 20)
    backend.sleep({W}, {KV})
    backend.wake({W, KV})
    real_wait, waits = ops.wait, []

    def failing_wait(event) -> None:
        waits.append(event)
        if len(waits) == 2:
            raise RuntimeError("copy engine fault")
        real_wait(event)

    ops.wait = failing_wait
    path = backend.path  # the mechanism itself: the backend's own state refuses a half-done sleep
    with pytest.raises(RuntimeError, match="copy engine fault"):
        path.sleep({W}, set())
    ops.wait = real_wait
    ops.synchronize()
    run_start = ptrs[W][0]
    assert run_start in module.memory  # the run keeps its memory while members are awake
    asleep = [p for p in ptrs[W] if path.is_asleep(p, backend.allocator.pointer_to_data[p])]
    assert asleep and len(asleep) < 3
    path.wake({W})  # the released members come back without a map over the live run
    assert [device_bytes(ops, p, n) for p, n in zip(ptrs[W], (4096, 8192, 12288), strict=True)] == before
    path.sleep({W}, {KV})
    assert module.memory == {}


def test_run_bytes_needs_a_span_mapper() -> None:
    with pytest.raises(ValueError, match="SpanMapper"):
        FastBackend(torch.device("cpu"), module=FakeCumemModule("0.26"), ops=object(), run_bytes=1 << 20)
    with pytest.raises(ValueError, match="positive"):
        Runs(FakeSpans(FakeCumemModule("0.26")), 0)


def test_a_run_that_cannot_be_made_at_load_stays_apart_until_its_first_wake() -> None:
    module, ops, spans, backend, ptrs, before = make(1 << 20, refuse_adopt=True)
    assert spans.adopts == [] and set(ptrs[W]) <= module.memory.keys()  # vLLM's own, untouched
    backend.sleep({W}, {KV})
    assert spans.unmaps == []  # the first sleep: vLLM's allocations one by one
    backend.wake({W, KV})
    assert spans.maps == [(ptrs[W][0], 4096 + 8192 + 12288)]
    assert [device_bytes(ops, p, n) for p, n in zip(ptrs[W], (4096, 8192, 12288), strict=True)] == before


def test_adoption_waits_for_a_prepare_in_the_foreground() -> None:
    module = FakeCumemModule("0.26")
    spans = FakeSpans(module)
    backend = FastBackend(
        torch.device("cpu"),
        module=module,
        ops=DeferredOps(module),
        run_bytes=1 << 20,
        spans=spans,
        prepare="background",
    )
    with backend.pool(W):
        for size in (4096, 8192):
            backend.allocator.malloc(size, 0x11)
    backend.track(W, [])
    backend.path.wait_prepared()
    assert spans.adopts == []  # the runner may be using the weights while a background prepare runs


# ---------------------------------------------------------------------- vLLM frees a member


def no_double_frees(spans: FakeSpans) -> None:
    assert len(set(spans.freed_ranges)) == len(spans.freed_ranges), spans.freed_ranges
    assert len(set(spans.freed_cells)) == len(spans.freed_cells), spans.freed_cells
    assert all(n >= 0 for n in spans.refs.values()), spans.refs  # no handle released twice


def test_a_member_vllm_frees_stays_under_its_run_until_the_last_member_goes() -> None:
    module, ops, spans, backend, ptrs, before = make(1 << 20)  # the three weights: one run, made at load
    run_start, total = ptrs[W][0], 4096 + 8192 + 12288
    spans.vllm_frees(backend.allocator, ptrs[W][1])  # torch gives the middle one's segment back
    assert len(module.memory[run_start]) == total  # the run is still one mapping
    assert device_bytes(ops, ptrs[W][0], 4096) == before[0] and device_bytes(ops, ptrs[W][2], 12288) == before[2]
    assert (ptrs[W][1], 8192) not in spans.freed_ranges  # its range is the run's until the run goes
    backend.sleep({W}, {KV})  # a sleep after the free
    assert spans.unmaps[-1] == (run_start, total) and module.memory == {}
    assert (ptrs[W][1], 8192) in spans.freed_ranges and ptrs[W][1] + 1 in spans.freed_cells
    backend.wake({W, KV})  # and a wake: the two left, no longer touching, each on its own handle
    assert device_bytes(ops, ptrs[W][0], 4096) == before[0] and device_bytes(ops, ptrs[W][2], 12288) == before[2]
    assert set(module.memory) == {ptrs[W][0], ptrs[W][2], ptrs[KV][0]}
    backend.sleep({W}, {KV})
    assert module.memory == {} and set(spans.refs.values()) == {0}  # every physical handle given back
    no_double_frees(spans)


def test_when_vllm_frees_every_member_the_run_goes_with_the_last_one() -> None:
    module, _, spans, backend, ptrs, _ = make(1 << 20)
    run_start, total = ptrs[W][0], 4096 + 8192 + 12288
    for ptr in (ptrs[W][2], ptrs[W][0]):
        spans.vllm_frees(backend.allocator, ptr)
        assert len(module.memory[run_start]) == total  # a member is left
    spans.vllm_frees(backend.allocator, ptrs[W][1])
    assert spans.unmaps == [(run_start, total)] and set(module.memory) == {ptrs[KV][0]}
    members = {(p, n) for p, n in zip(ptrs[W], (4096, 8192, 12288), strict=True)}
    assert members <= set(spans.freed_ranges)  # each member's own range, once the run was gone
    assert {p + 1 for p in ptrs[W]} <= set(spans.freed_cells)
    assert set(spans.refs.values()) == {0} and spans.cells == {}  # the run's memory and every stand-in's
    no_double_frees(spans)
    backend.sleep(set(), {KV})  # the KV sleeps and wakes as before
    backend.wake({KV})
    assert set(module.memory) == {ptrs[KV][0]}


def test_a_free_outside_any_run_goes_through_vllm_unchanged() -> None:
    module, _, spans, backend, ptrs, _ = make(1 << 20)
    spans.vllm_frees(backend.allocator, ptrs[KV][0])  # the KV: alone, on its own handle
    assert ptrs[KV][0] not in module.memory and spans.cells == {}
    assert spans.freed_ranges == [(ptrs[KV][0], 16384)]


def test_without_the_guard_vllm_could_not_free_a_member() -> None:
    _, _, spans, backend, ptrs, _ = make(1 << 20)
    allocator = backend.allocator
    allocator.python_free_callback = allocator._python_free_callback  # vLLM's own, unguarded
    with pytest.raises(RuntimeError, match="part of a larger mapping"):
        spans.vllm_frees(allocator, ptrs[W][1])


def test_runs_are_the_default_where_they_can_be_made_and_off_elsewhere() -> None:
    module = FakeCumemModule("0.26")
    on = FastBackend(torch.device("cpu"), module=module, ops=DeferredOps(module), spans=FakeSpans(module))
    assert on.path.runs is not None and on.path.runs.max_bytes == DEFAULT_RUN_BYTES
    assert on.stats()["runs"] == f"of {DEFAULT_RUN_BYTES} bytes"
    plain = FakeCumemModule("0.26")  # no SpanMapper: vLLM's extension maps, allocation by allocation
    off = FastBackend(torch.device("cpu"), module=plain, ops=DeferredOps(plain))
    assert off.path.runs is None and "SpanMapper" in off.stats()["runs"]
    assert FastBackend(torch.device("cpu"), module=module, ops=DeferredOps(module), run_bytes=0).path.runs is None
    old = FakeCumemModule("0.26")  # a vLLM whose allocator keeps no free callback to guard
    old.CuMemAllocator.get_instance().python_free_callback = None
    unguarded = FastBackend(torch.device("cpu"), module=old, ops=DeferredOps(old), spans=FakeSpans(old))
    assert unguarded.path.runs is None and "python_free_callback" in unguarded.stats()["runs"]
    with pytest.raises(ValueError, match="python_free_callback"):
        FastBackend(torch.device("cpu"), module=old, ops=DeferredOps(old), spans=FakeSpans(old), run_bytes=1 << 20)


class FakeDriver:
    """The driver calls DriverSpans.decoy makes, recorded; `partial_maps` says whether a part
    of a physical allocation may be mapped alone (the stand-in's first way)."""

    def __init__(self, partial_maps: bool) -> None:
        self.cu, self.partial_maps, self.calls = self, partial_maps, []

    def ensure_context(self, device: int) -> None:
        pass

    def check(self, rc: int, what: str) -> None:
        if rc:
            raise CudaDriverError(f"{what} failed: CUDA_ERROR_INVALID_VALUE")

    def reserve(self, nbytes: int) -> int:
        self.calls.append(("reserve", nbytes))
        return 0x5000

    def free_range(self, ptr: int, nbytes: int) -> None:
        self.calls.append(("free_range", ptr, nbytes))

    def cuMemMap(self, ptr: int, nbytes: int, offset: int, handle: int, flags: int) -> int:
        self.calls.append(("map", ptr, nbytes, handle))
        return 0 if self.partial_maps else 1

    def cuMemRetainAllocationHandle(self, cell, ptr: int) -> int:
        cell._obj.value = 77  # the run's handle, one reference more
        self.calls.append(("retain", ptr))
        return 0

    def map_into(self, device: int, nbytes: int, ptr: int, cell) -> None:
        cell.value = 99  # fresh memory of the member's size
        self.calls.append(("fresh", ptr, nbytes))


@pytest.mark.parametrize("partial_maps", [True, False])
def test_a_stand_in_maps_the_runs_memory_or_else_fresh_memory(partial_maps: bool) -> None:
    driver = FakeDriver(partial_maps)
    spans = DriverSpans(driver, 0)
    address, cell = spans.decoy(4096, 7)
    assert address == 0x5000 and ("map", 0x5000, 4096, 7) in driver.calls
    if partial_maps:
        assert ctypes.c_uint64.from_address(cell).value == 77 and ("retain", 0x5000) in driver.calls
    else:
        assert ctypes.c_uint64.from_address(cell).value == 99 and ("fresh", 0x5000, 4096) in driver.calls
    assert not any(c[0] == "free_range" for c in driver.calls)  # vLLM's free path gives the range back
    spans.forget(4096, 0x9000, cell)  # a freed member's own range, and a cell to free (this one)
    assert driver.calls[-1] == ("free_range", 0x9000, 4096)


def test_the_free_guard_is_installed_once_per_allocator_and_given_to_the_extension() -> None:
    module = FakeCumemModule("0.26")
    registered: list = []
    module.init_module = lambda malloc, free: registered.append((malloc, free))  # vLLM's extension
    allocator = module.CuMemAllocator.get_instance()
    allocator.python_malloc_callback = lambda handle: None
    first = FastBackend(torch.device("cpu"), module=module, ops=DeferredOps(module), spans=FakeSpans(module))
    second = FastBackend(torch.device("cpu"), module=module, ops=DeferredOps(module), spans=FakeSpans(module))
    guard = allocator.python_free_callback
    assert isinstance(guard, FreeGuard) and registered == [(allocator.python_malloc_callback, guard)]
    assert set(guard.registries) == {first.path.runs, second.path.runs}  # one wrapper, both backends' runs
