"""The engine's C heap: arenas capped once, free memory trimmed on the loop's clock."""

from __future__ import annotations

import pytest

from omni_core.engine.native_heap import M_ARENA_MAX, NativeHeap


class FakeGlibc:
    def __init__(self, trim_returns: int = 1) -> None:
        self.calls: list[tuple[str, tuple[int, ...]]] = []
        self.trim_returns = trim_returns

    def mallopt(self, param: int, value: int) -> int:
        self.calls.append(("mallopt", (param, value)))
        return 1

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(("malloc_trim", (pad,)))
        return self.trim_returns


def test_arenas_are_capped_at_once_and_the_heap_trimmed_once_per_interval() -> None:
    libc = FakeGlibc()
    heap = NativeHeap(arena_limit=3, trim_interval_s=60.0, libc=libc, now_s=100.0)
    assert libc.calls == [("mallopt", (M_ARENA_MAX, 3))]
    for now_s in (100.0, 130.0, 159.9):
        heap.tick(now_s)
    assert heap.trims == 0
    heap.tick(160.0)
    heap.tick(200.0)  # within the next interval
    heap.tick(220.0)
    assert [c for c in libc.calls if c[0] == "malloc_trim"] == [("malloc_trim", (0,))] * 2
    assert (heap.trims, heap.trims_returning) == (2, 2)


def test_a_trim_that_returns_nothing_is_counted_apart() -> None:
    heap = NativeHeap(trim_interval_s=1.0, libc=FakeGlibc(trim_returns=0))
    heap.tick(1.0)
    assert (heap.trims, heap.trims_returning) == (1, 0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="arena_limit"):
        NativeHeap(arena_limit=0, libc=FakeGlibc())


def test_the_real_engine_tunes_glibc_here() -> None:
    heap = NativeHeap()  # this machine's C library is glibc
    assert heap.tuned
    heap.tick(heap.trim_interval_s)
    assert heap.trims == 1
