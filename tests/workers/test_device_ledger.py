"""The node's device ledger: wakes that wait for memory on one device run one at a time
across engines, and the one that cannot get its turn is refused before it maps anything,
naming the wake that holds the device. Unit cases on a controlled clock, then a real rank
process against a lock held by another process (the test's)."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from omni_core.protocol import Ack, Nack, NackReason, Shutdown, Sleep, Wake, WorkerState
from omni_core.workers.device_ledger import gpu_ledger_directory, incoming_owner, one_incoming_wake
from omni_core.workers.memory_gate import WakeRefused
from omni_core.workers.simulated_device import SimulatedDevice

from ._harness import TestOrchestrator
from .test_memory_gate import Clock
from .test_process_swap import EPOCH, RUNNER_ARGS


def test_a_second_wake_waits_its_turn_and_is_refused_past_its_wait_naming_the_first(tmp_path) -> None:
    directory = str(tmp_path / "gpu0")
    clock = Clock()
    with one_incoming_wake(directory, "stage talker rank 0, pid 11 (engine pid 10)", 1.0):
        assert incoming_owner(directory) == "stage talker rank 0, pid 11 (engine pid 10)"
        entered = []
        refused = pytest.raises(WakeRefused, match=r"holds the device's incoming lock \(stage talker rank 0, pid 11")
        with refused, one_incoming_wake(directory, "stage dit rank 0", 0.5, clock=clock, pause=clock.sleep):
            entered.append(True)  # never: nothing is mapped by a refused wake
        assert not entered and sum(clock.sleeps) >= 0.5
    # Released with the first wake: the next one gets it at once and names itself.
    with one_incoming_wake(directory, "stage dit rank 0", 0.0, clock=clock, pause=clock.sleep) as waited_s:
        assert waited_s == 0.0 and incoming_owner(directory) == "stage dit rank 0"


def _hold(directory: str, held, release) -> None:  # a wake of another engine, in its own process
    with one_incoming_wake(directory, f"stage other rank 0, pid {os.getpid()} (engine pid {os.getppid()})", 5.0):
        held.set()
        release.wait(30)


def test_the_lock_is_one_per_device_across_processes(tmp_path) -> None:
    directory = str(tmp_path / "gpu0")
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(directory, held, release))
    other.start()
    try:
        assert held.wait(30)
        refused = pytest.raises(WakeRefused, match=f"stage other rank 0, pid {other.pid}")
        with refused, one_incoming_wake(directory, "stage dit rank 0", 0.05):
            pass
    finally:
        release.set()
        other.join(30)
    with one_incoming_wake(directory, "stage dit rank 0", 5.0):
        pass  # the other process released it (its exit would have too)


def test_each_gpu_has_its_own_ledger_of_this_user() -> None:
    a, b = gpu_ledger_directory("GPU-aaaa"), gpu_ledger_directory("GPU-bbbb")
    assert a != b and os.path.basename(a) == "GPU-aaaa" and f"omni-core-devices-{os.getuid()}" in a


@pytest.fixture
def orch():
    o = TestOrchestrator()
    yield o
    o.close()


def test_a_rank_wake_that_waits_takes_its_turn_and_one_that_does_not_takes_its_chance(orch, tmp_path) -> None:
    device = SimulatedDevice(str(tmp_path / "gpu0"), 64 << 20)  # room for all: only the lock binds
    worker = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, epoch=EPOCH, simulated_device=device)
    orch.wait_hello(worker)
    assert isinstance(orch.request(worker, Sleep(task_id="sleep-1", epoch=EPOCH, level=1)), Ack)
    asleep_free = device.free_bytes()
    with one_incoming_wake(device.directory, f"stage other rank 0, pid {os.getpid()} (engine pid 1)", 1.0):
        reply = orch.request(worker, Wake(task_id="wake-1", epoch=EPOCH, memory_wait_s=0.3))
        assert isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY, reply
        assert reply.state is WorkerState.SLEEPING and f"stage other rank 0, pid {os.getpid()}" in reply.detail
        assert device.free_bytes() == asleep_free  # refused before anything was mapped
        # A wake that does not wait for memory does not wait for the lock either.
        reply = orch.request(worker, Wake(task_id="wake-2", epoch=EPOCH))
        assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply
    assert isinstance(orch.request(worker, Sleep(task_id="sleep-2", epoch=EPOCH, level=1)), Ack)
    reply = orch.request(worker, Wake(task_id="wake-3", epoch=EPOCH, memory_wait_s=5.0))
    assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply  # its turn: the lock is free
    assert incoming_owner(device.directory).startswith("stage test rank 0, pid ")
    assert isinstance(orch.request(worker, Shutdown(task_id="stop", epoch=EPOCH)), Ack)
