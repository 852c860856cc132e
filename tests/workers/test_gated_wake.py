"""Wakes through a memory gate: waiting for memory another process frees, and the rollback
of a wake whose wait expired (every backend: portable on a simulated device; cumem and fast
over the CuMemAllocator stand-ins, whose fake device now has a capacity)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.backends import CumemBackend, PortableBackend
from omni_core.workers.backends.fast import FastBackend
from omni_core.workers.memory_gate import MemoryGate, WakeRefused
from omni_core.workers.simulated_device import HolderList, SimulatedDevice, SimulatedResidency

from .test_cumem_versions import VARIANTS, FakeCumemModule
from .test_fast_backend import DeferredOps
from .test_memory_gate import Clock

W, KV = "weights", "kv_cache"
PAYLOAD = {"seed": 3, "batch": 4}
KiB, MiB = 1 << 10, 1 << 20
WEIGHTS_BYTES, KV_BYTES, TENSORS = MiB, 256 * KiB, 8


# ---------------------------------------------------------------------- portable, simulated device


def loaded(device: SimulatedDevice) -> tuple[PortableBackend, SyntheticRunner, SimulatedResidency]:
    backend = PortableBackend(torch.device("cpu"))
    runner = SyntheticRunner(
        torch.device("cpu"), weights_bytes=WEIGHTS_BYTES, tensor_count=TENSORS, kv_bytes=KV_BYTES, hidden=64
    )
    for tag in (W, KV):
        with backend.pool(tag):
            runner.allocate(tag)
        backend.track(tag, runner.tensors(tag))
    residency = SimulatedResidency(device, "dit", 0)
    backend.report_to(residency)
    return backend, runner, residency


def resident(backend: PortableBackend) -> int:
    return sum(backend.usage().values())


@pytest.fixture
def sim(tmp_path):
    return SimulatedDevice(str(tmp_path / "gpu"), 4 * MiB)


def test_the_backend_reports_its_bytes_on_every_sleep_and_wake(sim):
    backend, _runner, residency = loaded(sim)
    full = resident(backend)
    assert residency.resident_bytes == full and sim.free_bytes() == 4 * MiB - full
    backend.sleep({W}, {KV})
    assert residency.resident_bytes == 0 and sim.free_bytes() == 4 * MiB
    backend.wake({W, KV})
    assert residency.resident_bytes == full
    backend.release()
    assert os.listdir(sim.directory) == []  # the file goes at shutdown


def test_a_wake_that_does_not_fit_waits_until_another_process_shrinks(sim):
    backend, runner, residency = loaded(sim)
    weights = [t.clone() for t in runner.tensors(W)]
    out, full = runner.execute(PAYLOAD), resident(backend)
    backend.sleep({W}, {KV})
    # A third process holds all but 1 MiB: the weights (1 MiB) fit, the KV cache does not.
    other = os.getppid()
    sim.write("talker", 0, other, 3 * MiB)
    waiting = threading.Event()

    def sleep(seconds: float) -> None:
        waiting.set()  # the gate polls: the wake is waiting for memory
        time.sleep(seconds)

    def shrink() -> None:
        assert waiting.wait(60), "the wake never waited"
        sim.write("talker", 0, other, 2 * MiB)  # the talker's sleep frees 1 MiB

    thread = threading.Thread(target=shrink)
    thread.start()
    gate = MemoryGate(residency, memory_wait_s=120.0, what="stage dit rank 0", sleep=sleep)
    backend.wake({W, KV}, gate)
    thread.join()
    assert waiting.is_set() and gate.queries >= 2 and gate.waited_s > 0
    assert backend.asleep == set() and residency.resident_bytes == resident(backend) == full
    assert all(torch.equal(a, b) for a, b in zip(weights, runner.tensors(W), strict=True))
    assert runner.execute(PAYLOAD)["data"] == out["data"]


def refused_wake(
    sim: SimulatedDevice, backend: PortableBackend, residency: SimulatedResidency, tags: set[str], wait_s: float = 2.0
) -> WakeRefused:
    clock = Clock()
    gate = MemoryGate(residency, memory_wait_s=wait_s, what="stage dit rank 0", clock=clock, sleep=clock.sleep)
    with pytest.raises(WakeRefused) as info:
        backend.wake(tags, gate)
    assert clock.now_s - 100.0 == pytest.approx(wait_s)
    return info.value


def test_an_expired_wait_rolls_back_and_a_later_wake_restores_bit_exact(sim):
    backend, runner, residency = loaded(sim)
    weights = [t.clone() for t in runner.tensors(W)]
    out = runner.execute(PAYLOAD)
    backend.sleep({W}, {KV})
    host = backend.host_bytes()
    # Room for 3 of the 8 weight tensors: the wake maps some, then runs out.
    sim.write("talker", 0, os.getppid(), 4 * MiB - 3 * WEIGHTS_BYTES // TENSORS)
    err = refused_wake(sim, backend, residency, {W, KV})
    text = str(err)
    assert f"stage talker rank 0, pid {os.getppid()}" in text and "needed 131072 bytes" in text
    assert "the wake maps 0.001 GiB in all, 0.000 GiB mapped so far" in text
    # Rolled back: nothing resident, every tensor storage empty again, host copies intact.
    assert backend.asleep == {W, KV} and resident(backend) == 0 and residency.resident_bytes == 0
    assert all(t.untyped_storage().nbytes() == 0 for t in runner.tensors(W) + runner.tensors(KV))
    assert backend.host_bytes() == host
    sim.write("talker", 0, os.getppid(), 0)
    backend.wake({W, KV}, MemoryGate(residency, memory_wait_s=0.0))
    assert all(torch.equal(a, b) for a, b in zip(weights, runner.tensors(W), strict=True))
    assert runner.execute(PAYLOAD)["data"] == out["data"]


def test_a_refused_partial_wake_unmaps_the_tags_it_had_finished(sim):
    backend, runner, residency = loaded(sim)
    weights = [t.clone() for t in runner.tensors(W)]
    kv = [t.clone() for t in runner.tensors(KV)]
    sizes = backend.usage()  # the weights tag holds the calibration buffer too
    backend.sleep({W, KV}, set())  # both offloaded: each has a host copy to keep
    host = backend.host_bytes()
    sim.write("talker", 0, os.getppid(), 4 * MiB - sizes[KV] - sizes[W] // 2)  # KV fits, then half the weights
    refused_wake(sim, backend, residency, {W, KV})  # kv_cache goes first (sorted), then weights
    assert backend.asleep == {W, KV} and resident(backend) == 0 and backend.host_bytes() == host
    sim.write("talker", 0, os.getppid(), 4 * MiB - sizes[W])
    backend.wake({W}, MemoryGate(residency, memory_wait_s=0.0))  # the weights alone fit
    assert backend.asleep == {KV}
    assert all(torch.equal(a, b) for a, b in zip(weights, runner.tensors(W), strict=True))
    sim.write("talker", 0, os.getppid(), 0)
    backend.wake({KV}, MemoryGate(residency, memory_wait_s=0.0))
    assert all(torch.equal(a, b) for a, b in zip(kv, runner.tensors(KV), strict=True))


def test_a_refused_level2_wake_keeps_the_saved_buffers_for_the_next_one(sim):
    backend, runner, residency = loaded(sim)
    out = runner.execute(PAYLOAD)
    calibration = runner.calibration.clone()
    backend.sleep(set(), {W, KV}, buffers=runner.buffers_to_save())
    sim.write("talker", 0, os.getppid(), 4 * MiB - 2 * WEIGHTS_BYTES // TENSORS)
    refused_wake(sim, backend, residency, {W, KV}, wait_s=0.5)
    assert backend.host_bytes() == calibration.numel() * calibration.element_size()  # still saved
    sim.write("talker", 0, os.getppid(), 0)
    backend.wake({W, KV}, MemoryGate(residency, memory_wait_s=0.0))
    assert torch.equal(runner.calibration, calibration)
    runner.reload_weights(None)
    assert runner.execute(PAYLOAD)["data"] == out["data"]


class StaleFigure:
    """A free-memory source that answers what was free before another process mapped: two
    ranks admitted on one figure, the race the simulated device's claim settles."""

    reserve_bytes = 0

    def __init__(self, residency: SimulatedResidency, free_bytes: int) -> None:
        self.residency, self.free = residency, free_bytes

    def free_bytes(self) -> int:
        return self.free

    def holders(self) -> HolderList:
        return self.residency.holders()

    def describe(self) -> str:
        return self.residency.describe()


def test_two_wakes_admitted_on_one_free_figure_never_hold_more_than_the_device(sim):
    backend, _runner, residency = loaded(sim)
    full = resident(backend)
    backend.sleep({W}, {KV})
    # Another process maps 3 MiB after this rank's gate read "4 MiB free": the device, like a
    # driver, refuses the maps past its capacity, and the gate waits on them until it expires.
    sim.claim("talker", 0, os.getppid(), 3 * MiB)
    clock = Clock()
    gate = MemoryGate(
        StaleFigure(residency, 4 * MiB), memory_wait_s=1.0, what="stage dit rank 0", clock=clock, sleep=clock.sleep
    )
    refusal = r"the driver refused a map the free figure allowed \(SimulatedOutOfMemory: out of memory on the"
    with pytest.raises(WakeRefused, match=refusal):
        backend.wake({W, KV}, gate)
    assert sim.used_bytes() == 3 * MiB and residency.resident_bytes == 0 == resident(backend)
    sim.claim("talker", 0, os.getppid(), 0)
    backend.wake({W, KV}, MemoryGate(residency, memory_wait_s=0.0))
    assert resident(backend) == full and sim.used_bytes() == full


def test_a_backend_without_the_gate_refuses_to_be_given_one(sim):
    from omni_core.workers.backends.base import BackendStateError
    from omni_core.workers.backends.portable import PortableBackend as Base

    class Ungated(Base):  # a third-party backend that cannot wait for memory
        supports_memory_gate = False

    backend = Ungated(torch.device("cpu"))
    backend.track(W, [torch.ones(4)])
    backend.sleep({W}, set())
    with pytest.raises(BackendStateError, match="cannot wait for device memory"):
        backend.wake({W}, MemoryGate(SimulatedResidency(sim, "x", 0), memory_wait_s=1.0))
    backend.wake({W})  # a wake without a gate still works
    assert backend.asleep == set()


# ---------------------------------------------------------------------- cumem and fast stand-ins


class CappedModule(FakeCumemModule):
    """The fake device with a capacity: a map past it fails as vLLM's extension does."""

    def __init__(self, variant: str, capacity_bytes: int) -> None:
        super().__init__(variant)
        self.capacity_bytes = capacity_bytes
        self.racer_bytes = 0  # a third process's allocation that the free figure does not show

    def used(self) -> int:
        return sum(len(b) for b in self.memory.values())

    def create_and_map(self, handle) -> None:
        if self.used() + self.racer_bytes + handle[1] > self.capacity_bytes:
            raise RuntimeError("CUDA Error: out of memory at csrc/cumem_allocator.cpp:70")
        super().create_and_map(handle)


class DeviceFree:
    """The fake device's free figure (as mem_get_info gives it), plus other holders."""

    reserve_bytes = 0

    def __init__(self, module: CappedModule) -> None:
        self.m = module
        self.other_bytes = 0

    def free_bytes(self) -> int:
        return self.m.capacity_bytes - self.m.used() - self.other_bytes

    def holders(self) -> HolderList:
        from omni_core.workers.simulated_device import Holder

        return HolderList((Holder(999, self.other_bytes, "stage talker rank 0"),))

    def describe(self) -> str:
        return "fake cuda:0"


SIZES_W, SIZES_KV = (4096, 8192, 12288), (16384,)


def cumem(variant: str, capacity: int):
    module = CappedModule(variant, capacity)
    backend = CumemBackend(torch.device("cpu"), module=module)
    return module, backend, _fill(module, backend)


def fast(variant: str, capacity: int):
    module = CappedModule(variant, capacity)
    ops = DeferredOps(module)
    backend = FastBackend(torch.device("cpu"), module=module, ops=ops, chunk_bytes=5000)
    return module, backend, _fill(module, backend)


def _fill(module, backend) -> dict[str, list[int]]:
    ptrs = {}
    for tag, sizes in ((W, SIZES_W), (KV, SIZES_KV)):
        with backend.pool(tag):
            ptrs[tag] = [backend.allocator.malloc(size, 0) for size in sizes]
        backend.track(tag, [])
    for i, p in enumerate(ptrs[W]):  # distinct bytes per allocation and position
        module.memory[p][:] = bytes((i * 31 + j) % 251 for j in range(len(module.memory[p])))
    return ptrs


def weights_of(module, ptrs) -> list[bytes]:
    return [bytes(module.memory[p]) for p in ptrs[W]]


MAKERS = {"cumem": cumem, "fast": fast}
CAPACITY = sum(SIZES_W) + sum(SIZES_KV)  # exactly both tags


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_an_expired_wait_unmaps_what_the_wake_mapped_and_keeps_the_host_copies(kind, variant):
    module, backend, ptrs = MAKERS[kind](variant, CAPACITY)
    before = weights_of(module, ptrs)
    backend.sleep({W}, {KV})
    host = backend.host_bytes()
    source = DeviceFree(module)
    source.other_bytes = module.capacity_bytes - 4096 - 8192  # room for the first two weights only
    clock = Clock()
    gate = MemoryGate(source, memory_wait_s=1.0, what="stage dit rank 0", clock=clock, sleep=clock.sleep)
    with pytest.raises(WakeRefused, match=r"needed 12288 bytes .* stage talker rank 0, pid 999"):
        backend.wake({W, KV}, gate)
    assert module.memory == {}, "an allocation the refused wake mapped is still mapped"
    assert backend.asleep == {W, KV} and backend.usage() == {W: 0, KV: 0}
    assert backend.host_bytes() == host and gate.admitted_bytes == 0
    if kind == "fast":
        assert backend.path._backed == set(ptrs[W])  # the slots still stand for the weights
    # The other stage leaves: the same wake now succeeds, bit-exact.
    source.other_bytes = 0
    backend.wake({W, KV}, MemoryGate(source, memory_wait_s=0.0))
    assert weights_of(module, ptrs) == before and backend.host_bytes() == 0
    assert backend.usage() == {W: sum(SIZES_W), KV: sum(SIZES_KV)}


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_a_driver_refusal_after_admission_is_waited_on_then_mapped(kind):
    module, backend, ptrs = MAKERS[kind]("0.26", CAPACITY)
    before = weights_of(module, ptrs)
    backend.sleep({W}, {KV})
    source = DeviceFree(module)
    module.racer_bytes = CAPACITY  # a process the free figure does not show, gone after a while
    clock = Clock()

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now_s - 100.0 > 0.1:
            module.racer_bytes = 0

    gate = MemoryGate(source, memory_wait_s=5.0, clock=clock, sleep=sleep)
    backend.wake({W, KV}, gate)
    assert weights_of(module, ptrs) == before and backend.asleep == set()
    assert gate.queries > 2 and clock.now_s - 100.0 > 0.1


def test_the_fast_rollback_lets_issued_copies_land_before_unmapping():
    """DeferredOps runs a copy only at a wait or synchronize: unmapping first would make the
    queued copy fail, and skipping the synchronize would leave it queued for later."""
    module, backend, _ptrs = fast("0.26", CAPACITY)
    backend.sleep({W}, {KV})
    source = DeviceFree(module)
    source.other_bytes = module.capacity_bytes - sum(SIZES_W)  # all weights fit, the KV cache does not
    with pytest.raises(WakeRefused):
        backend.wake({W, KV}, MemoryGate(source, memory_wait_s=0.0))
    ops = backend.path.ops
    assert [d for d, _ in ops.copies].count("h2d") > 0  # the weights' copies were issued
    assert all(ops.done[s] == len(ops.queues[s]) for s in ops.streams)  # and had landed
    assert module.memory == {} and backend.asleep == {W, KV}
