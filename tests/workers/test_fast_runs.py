"""Runs (runs.py): touching allocations of one tag woken into one physical allocation, on CPU.

`FakeSpans` maps a run as one piece of the fake device memory, so a copy into a member
lands inside it, and `DeferredOps` fails a queued copy whose memory was unmapped before it
ran: a run unmapped before its last member's bytes were copied out shows.
"""

from __future__ import annotations

import pytest
import torch

from omni_core.workers.backends.fast import FastBackend
from omni_core.workers.backends.runs import Runs

from .test_cumem_versions import GARBAGE, KV, FakeCumemModule, W
from .test_fast_backend import DeferredOps


class FakeSpans:
    def __init__(self, module: FakeCumemModule) -> None:
        self.m = module
        self.maps: list[tuple[int, int]] = []  # (ptr, nbytes) of each map_span
        self.unmaps: list[tuple[int, int]] = []
        self._next_handle = 1

    def map_span(self, nbytes: int, ptr: int) -> int:
        if any(p < ptr + nbytes and ptr < p + len(b) for p, b in self.m.memory.items()):
            raise RuntimeError(f"map of {ptr:#x}+{nbytes}, which overlaps a mapping")
        self.m.memory[ptr] = bytearray([GARBAGE]) * nbytes
        self.maps.append((ptr, nbytes))
        self._next_handle += 1
        return self._next_handle

    def unmap_span(self, nbytes: int, ptr: int, handle: int) -> None:
        if len(self.m.memory.get(ptr, b"")) != nbytes:
            raise RuntimeError(f"unmap of {ptr:#x}+{nbytes}, which is not one mapping")
        del self.m.memory[ptr]
        self.unmaps.append((ptr, nbytes))


def device_bytes(ops: DeferredOps, ptr: int, nbytes: int) -> bytes:
    return b"".join(bytes(ops.m.memory[base][off : off + n]) for base, off, n in ops._pieces(ptr, nbytes))


def make(run_bytes: int, sizes_w=(4096, 8192, 12288), variant: str = "0.26"):
    module = FakeCumemModule(variant)
    ops = DeferredOps(module)
    spans = FakeSpans(module)
    backend = FastBackend(
        torch.device("cpu"), module=module, ops=ops, chunk_bytes=5000, run_bytes=run_bytes, spans=spans
    )
    ptrs = {}
    for tag, fill, sizes in ((W, 0x11, sizes_w), (KV, 0x22, (16384,))):
        with backend.pool(tag):
            ptrs[tag] = [backend.allocator.malloc(size, fill) for size in sizes]
        backend.track(tag, [])
    for i, p in enumerate(ptrs[W]):
        module.memory[p][:] = bytes((i * 31 + j) % 251 for j in range(len(module.memory[p])))
    before = [bytes(module.memory[p]) for p in ptrs[W]]
    return module, ops, spans, backend, ptrs, before


@pytest.mark.parametrize("variant", ["0.26", "keep_tags", "no_flags"])
def test_a_tag_wakes_as_one_run_and_sleeps_with_one_unmap(variant: str) -> None:
    module, ops, spans, backend, ptrs, before = make(1 << 20, variant=variant)
    sizes = [4096, 8192, 12288]
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
    # every sleep after the first unmapped the run once (the first: vLLM's own allocations)
    assert spans.unmaps == [(ptrs[W][0], sum(sizes))] * 2
    assert backend.stats()["mapped_runs"] == 3


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
