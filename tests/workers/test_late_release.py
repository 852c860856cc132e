"""A swap's outgoing sleep with room beside it (release_late): the fast path copies every
offloaded byte out first and releases after its last copy (with runs: one unmap per run);
without it, each allocation is released as its copy lands, so a stage waiting for that memory
gets it early. On CPU, over the queued copies of `DeferredOps`: each copy runs only when an
event after it is waited on, so the mapped count seen at each wait shows when releases ran."""

from __future__ import annotations

import pytest

from omni_core.workers.backends.fast import FastBackend
from omni_core.workers.memory_gate import room_for

from .test_cumem_versions import KV, W
from .test_fast_backend import make, snapshot
from .test_fast_runs import device_bytes
from .test_fast_runs import make as make_runs

SIZES_W = (4096, 8192, 12288, 4096)  # chunk_bytes=5000: 7 copies, allocations completing in 4 of them


def mapped_at_each_wait(ops, module) -> list[int]:
    """Replace ops.wait with one that notes how many allocations are mapped at each call."""
    seen: list[int] = []
    real_wait = ops.wait

    def wait(event) -> None:
        seen.append(len(module.memory))
        real_wait(event)

    ops.wait = wait
    return seen


@pytest.mark.parametrize("variant", ["0.26", "keep_tags", "no_flags"])
def test_a_late_release_keeps_everything_mapped_until_the_last_copy_has_landed(variant: str, monkeypatch) -> None:
    # The mechanism, on allocations without runs (the backend uses it only with runs).
    monkeypatch.setattr(FastBackend, "supports_late_release", True)
    module, ops, backend, ptrs = make(variant, sizes_w=SIZES_W)
    before = snapshot(module, ptrs[W])
    seen = mapped_at_each_wait(ops, module)
    backend.sleep({W}, {KV}, release_late=True)
    assert len(seen) >= 4 and set(seen) == {len(SIZES_W) + 1}, seen  # the KV too: nothing left before the end
    assert module.memory == {}
    last = backend.path.stats.last
    assert last["release_late"] is True and last["offloaded_bytes"] == sum(SIZES_W)
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before


def test_without_runs_the_backend_declines_a_late_release() -> None:
    """Releasing every allocation after the last copy pays one unmap per allocation at the
    end of the sleep (measured: a slower swap); only runs make a late release worth it."""
    module, ops, backend, _ = make("0.26", sizes_w=SIZES_W)
    assert backend.path.runs is None and not backend.supports_late_release
    seen = mapped_at_each_wait(ops, module)
    backend.sleep({W}, {KV}, release_late=True)
    assert seen[-1] == 1, seen  # released as the copies landed
    assert backend.path.stats.last["release_late"] is False
    _, _, _, with_runs, _, _ = make_runs(4096 + 8192)
    assert with_runs.supports_late_release


def test_without_room_each_allocation_is_released_as_its_copy_lands() -> None:
    module, ops, backend, ptrs = make("0.26", sizes_w=SIZES_W)
    before = snapshot(module, ptrs[W])
    seen = mapped_at_each_wait(ops, module)
    backend.sleep({W}, {KV})  # what a plain sleep, and a swap whose incoming stage waits, do
    # the KV first, then the weights one by one as their copies land: by the last copy's wait
    # only the allocations it completes are left
    assert seen[0] == len(SIZES_W) and seen[-1] == 1, seen
    assert backend.path.stats.last["release_late"] is False
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before


@pytest.mark.parametrize("late", [True, False])
def test_with_runs_a_late_release_unmaps_each_run_once_after_the_copies(late: bool) -> None:
    module, ops, spans, backend, ptrs, before = make_runs(4096 + 8192)  # a run of two, the third alone
    backend.sleep({W}, {KV})
    backend.wake({W, KV})
    unmaps = len(spans.unmaps)
    seen = mapped_at_each_wait(ops, module)
    backend.sleep({W}, {KV}, release_late=late)
    assert spans.unmaps[unmaps:] == [(ptrs[W][0], 4096 + 8192)]  # the run: one unmap either way
    if late:
        assert set(seen) == {3}, seen  # the run, the third weight, the KV: all mapped to the end
    else:
        assert seen[0] == 2 and seen[-1] == 1, seen  # the KV at once, the run once its copies landed
    assert module.memory == {}
    backend.wake({W, KV})
    assert [device_bytes(ops, p, n) for p, n in zip(ptrs[W], (4096, 8192, 12288), strict=True)] == before


def test_a_late_release_whose_copy_fails_releases_nothing_and_the_next_sleep_completes() -> None:
    module, ops, backend, ptrs = make("0.26", sizes_w=SIZES_W)
    before = snapshot(module, ptrs[W])
    real_wait, calls = ops.wait, []

    def failing_wait(event) -> None:
        calls.append(event)
        if len(calls) == 3:
            raise RuntimeError("copy engine fault")
        real_wait(event)

    ops.wait = failing_wait
    with pytest.raises(RuntimeError, match="copy engine fault"):
        backend.path.sleep({W}, {KV}, release_late=True)
    ops.wait = real_wait
    ops.synchronize()
    assert set(module.memory) == set(ptrs[W] + ptrs[KV])  # every allocation still mapped, bytes intact
    assert snapshot(module, ptrs[W]) == before
    backend.sleep({W}, {KV}, release_late=True)
    assert module.memory == {}
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before


def test_a_clean_sleep_has_nothing_to_wait_for_and_releases_at_once() -> None:
    module, _, backend, _ = make("0.26", sizes_w=SIZES_W)
    backend.declare_read_only({W})
    backend.path.prepare((W,))
    backend.sleep({W}, {KV}, release_late=True)
    assert module.memory == {} and backend.path.stats.last["release_late"] is False


class Source:
    def __init__(self, free_bytes: int, reserve_bytes: int = 0, broken: bool = False) -> None:
        self.free, self.reserve_bytes, self.broken = free_bytes, reserve_bytes, broken

    def free_bytes(self) -> int:
        if self.broken:
            raise RuntimeError("NVML: driver not loaded")
        return self.free


def test_room_for_counts_the_reserve_and_says_no_when_unsure() -> None:
    assert room_for(Source(100), 100) is True
    assert room_for(Source(100, reserve_bytes=1), 100) is False  # the gate keeps the reserve back
    assert room_for(Source(100), 0) is False  # nothing incoming: a plain sleep
    assert room_for(None, 10) is False  # no device to ask (a CPU rank)
    assert room_for(Source(100, broken=True), 10) is False
