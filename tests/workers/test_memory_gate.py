"""The memory gate on a controlled clock: a fake free-memory source whose figure is a
function of (fake) time, a sleep that only advances the clock. Nothing here waits."""

from __future__ import annotations

import pytest

from omni_core.workers.device_memory import SimulatedOutOfMemory, is_out_of_memory
from omni_core.workers.memory_gate import MAX_HOLDERS_SHOWN, MemoryGate, MemoryWaitExpired, admit
from omni_core.workers.simulated_device import Holder, HolderList

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        assert seconds > 0, "the gate slept for nothing"
        self.sleeps.append(seconds)
        self.now_s += seconds


class Source:
    """Free bytes as a function of the clock; counts queries."""

    def __init__(self, clock: Clock, free, *, reserve_bytes: int = 0, holders=()) -> None:
        self.clock, self.free, self.reserve_bytes = clock, free, reserve_bytes
        self._holders = tuple(holders)
        self.queries = 0

    def free_bytes(self) -> int:
        self.queries += 1
        return self.free(self.clock.now_s) if callable(self.free) else self.free

    def holders(self) -> HolderList:
        return HolderList(self._holders)

    def describe(self) -> str:
        return "fake device 0"


def gate(source: Source, clock: Clock, wait_s: float) -> MemoryGate:
    return MemoryGate(source, memory_wait_s=wait_s, what="stage dit rank 0", clock=clock, sleep=clock.sleep)


def test_plenty_of_room_costs_one_query_for_the_whole_wake():
    clock = Clock()
    source = Source(clock, 100 * MiB)
    g = gate(source, clock, 10.0)
    for _ in range(50):
        g.acquire(MiB)
    assert source.queries == 1 and clock.sleeps == []
    assert g.admitted_bytes == 50 * MiB


def test_the_budget_is_asked_again_only_when_it_runs_short():
    clock = Clock()
    free = {"bytes": 3 * MiB}
    source = Source(clock, lambda _now: free["bytes"])
    g = gate(source, clock, 10.0)
    g.acquire(2 * MiB)
    free["bytes"] = 10 * MiB  # another stage slept meanwhile (our 2 MiB are counted as used)
    g.acquire(2 * MiB)  # 1 MiB left in the budget: ask again, no waiting
    assert source.queries == 2 and clock.sleeps == []


def test_the_reserve_is_kept_back():
    clock = Clock()
    source = Source(clock, 10 * MiB, reserve_bytes=4 * MiB)
    gate(source, clock, 0.0).acquire(6 * MiB)
    with pytest.raises(MemoryWaitExpired, match=r"less a reserve of 0\.004 GiB"):
        gate(source, clock, 0.0).acquire(6 * MiB + 1)


def test_waits_while_memory_frees_then_admits():
    clock = Clock()
    start = clock.now_s
    # Another stage's sleep frees 1 MiB every 10 ms from 0 to 8 MiB.
    source = Source(clock, lambda now: min(8, int((now - start) / 0.01)) * MiB)
    g = gate(source, clock, 5.0)
    g.acquire(6 * MiB)
    assert 0.06 <= clock.now_s - start < 0.1  # admitted once 6 MiB were free, not later than a backoff
    assert g.waited_s == pytest.approx(clock.now_s - start)
    # backoff grows from 0.5 ms and is capped at 20 ms
    assert clock.sleeps[0] == pytest.approx(0.0005) and max(clock.sleeps) <= 0.02 + 1e-12
    assert clock.sleeps[:4] == pytest.approx([0.0005, 0.001, 0.002, 0.004])


def test_expires_naming_needed_free_waited_and_holders():
    clock = Clock()
    holders = [Holder(4242, 6 * MiB, "stage talker rank 0"), Holder(77, 1 * MiB)]
    source = Source(clock, 2 * MiB, holders=holders)
    g = gate(source, clock, 1.5)
    g.expect(8 * MiB)
    with pytest.raises(MemoryWaitExpired) as info:
        g.acquire(4 * MiB)
    err = info.value
    assert clock.now_s - 100.0 == pytest.approx(1.5)  # waited the whole wait, not one sleep more
    assert (err.needed_bytes, err.free_bytes) == (4 * MiB, 2 * MiB) and err.waited_s == pytest.approx(1.5)
    text = str(err)
    for part in (
        "stage dit rank 0 needed 4194304 bytes",
        "2097152 bytes (0.002 GiB) free on fake device 0",
        "after waiting 1.500 s (memory_wait_s=1.5)",
        "the wake maps 0.008 GiB in all",
        "stage talker rank 0, pid 4242: 6291456 bytes",
        "pid 77: 1048576 bytes",
        "memory_wait_s)",
    ):
        assert part in text, (part, text)
    assert text.index("pid 4242") < text.index("pid 77")  # largest first


def test_zero_wait_is_refused_at_once():
    clock = Clock()
    source = Source(clock, MiB)
    g = gate(source, clock, 0.0)
    with pytest.raises(MemoryWaitExpired, match=r"refused at once \(memory_wait_s=0\)"):
        g.acquire(2 * MiB)
    assert clock.sleeps == [] and source.queries == 1


def test_holders_are_capped_and_problems_said():
    clock = Clock()
    many = [Holder(1000 + i, MiB * (i + 1), f"stage s rank {i}") for i in range(40)]
    source = Source(clock, 0, holders=many)
    with pytest.raises(MemoryWaitExpired) as info:
        gate(source, clock, 0.0).acquire(1)
    assert f"and {40 - MAX_HOLDERS_SHOWN} more" in str(info.value)
    assert "pid 1039" in str(info.value) and "pid 1000:" not in str(info.value)

    class Blind(Source):
        def holders(self) -> HolderList:
            return HolderList((), problem="NVML unavailable: no driver")

    with pytest.raises(MemoryWaitExpired, match=r"holders unknown \(NVML unavailable: no driver\)"):
        gate(Blind(clock, 0), clock, 0.0).acquire(1)


def test_release_refunds_the_budget():
    clock = Clock()
    source = Source(clock, 4 * MiB)
    g = gate(source, clock, 0.0)
    g.acquire(3 * MiB)
    g.release(3 * MiB)
    g.acquire(4 * MiB)  # from the refunded budget, no second query needed
    assert source.queries == 1 and g.admitted_bytes == 4 * MiB


def test_a_driver_refusal_of_an_admitted_map_is_waited_on_again():
    """A third process allocated between the query and the map: the driver says out of memory.
    The gate forgets its budget, waits, asks again and maps once the racer is gone."""
    clock = Clock()
    start = clock.now_s
    source = Source(clock, 8 * MiB)  # the figure says there is room throughout
    attempts: list[float] = []

    def allocate() -> str:
        attempts.append(clock.now_s)
        if clock.now_s - start < 0.05:  # the racer holds the memory for 50 ms
            raise RuntimeError("CUDA Error: out of memory at cumem_allocator.cpp:91")
        return "mapped"

    g = gate(source, clock, 5.0)
    assert g.admit(4 * MiB, allocate) == "mapped"
    assert len(attempts) > 2 and source.queries == len(attempts)  # a fresh figure before each try
    assert g.admitted_bytes == 4 * MiB  # the refused tries are not counted as held


def test_a_driver_refusal_past_the_wait_expires_saying_so():
    clock = Clock()
    source = Source(clock, 8 * MiB)

    def allocate() -> None:
        raise SimulatedOutOfMemory("simulated device full")

    with pytest.raises(MemoryWaitExpired, match="the driver refused a map the free figure allowed"):
        gate(source, clock, 0.2).admit(MiB, allocate)
    assert clock.now_s - 100.0 == pytest.approx(0.2)


def test_other_errors_of_a_map_are_not_waited_on():
    clock = Clock()
    g = gate(Source(clock, 8 * MiB), clock, 5.0)

    def allocate() -> None:
        raise RuntimeError("CUDA Error: invalid argument")

    with pytest.raises(RuntimeError, match="invalid argument"):
        g.admit(MiB, allocate)
    assert clock.sleeps == []


def test_no_gate_allocates_at_once():
    assert admit(None, 1 << 40, lambda: "mapped") == "mapped"


def test_out_of_memory_is_recognised_and_nothing_else():
    import torch

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA Error: out of memory at csrc/cumem_allocator.cpp:70"))
    assert is_out_of_memory(RuntimeError("cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"))
    assert is_out_of_memory(SimulatedOutOfMemory("full"))
    assert not is_out_of_memory(RuntimeError("CUDA Error: invalid argument"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocation's error type


def test_bad_arguments_are_refused():
    clock = Clock()
    with pytest.raises(ValueError, match="memory_wait_s must be >= 0"):
        gate(Source(clock, 0), clock, -1.0)
    with pytest.raises(ValueError, match="cannot acquire -1 bytes"):
        gate(Source(clock, 0), clock, 1.0).acquire(-1)
