"""A real worker process on a simulated device: a Wake that finds the device held by another
process is refused NO_MEMORY naming the holder, rolled back to SLEEPING, answered again from
the reply cache; once the holder shrinks a Wake that waits succeeds bit-exact."""

from __future__ import annotations

import os

import pytest

from omni_core.protocol import Ack, Capability, Execute, Nack, NackReason, Shutdown, Sleep, Status, Wake, WorkerState
from omni_core.workers.simulated_device import SimulatedDevice

from ._harness import TestOrchestrator

RUNNER_ARGS = {
    "weights_bytes": 2 << 20,
    "tensor_count": 8,
    "kv_bytes": 256 << 10,
    "hidden": 64,
    "seed": 5,
    "cpu_threads": 1,
}
PAYLOAD = {"seed": 11, "batch": 3}
CAPACITY_BYTES = 4 << 20
EPOCH = 1


@pytest.fixture
def orch():
    o = TestOrchestrator()
    yield o
    o.close()


def test_a_wake_without_room_is_refused_no_memory_and_a_later_one_waits_and_succeeds(orch, tmp_path):
    device = SimulatedDevice(str(tmp_path / "gpu0"), CAPACITY_BYTES)
    worker = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, epoch=EPOCH, simulated_device=device)
    hello = orch.wait_hello(worker)
    assert hello.state is WorkerState.ACTIVE and Capability.SWAP in hello.capabilities
    (rank,) = device.read()[0]
    assert rank.label == "stage test rank 0" and rank.pid == hello.pid and rank.nbytes > 2 << 20
    loaded_bytes = rank.nbytes
    before = orch.request(worker, Execute(task_id="exec-1", epoch=EPOCH, payload=PAYLOAD))

    reply = orch.request(worker, Sleep(task_id="sleep-1", epoch=EPOCH, level=1))
    assert isinstance(reply, Ack) and reply.state is WorkerState.SLEEPING, reply
    assert device.free_bytes() == CAPACITY_BYTES  # the file says the rank holds nothing now

    # Another stage (played by this test process) takes all but 1 MiB of the device.
    device.write("talker", 0, os.getpid(), CAPACITY_BYTES - (1 << 20))
    wake = Wake(task_id="wake-1", epoch=EPOCH, memory_wait_s=0.2)
    reply = orch.request(worker, wake)
    assert isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY, reply
    assert reply.state is WorkerState.SLEEPING
    for part in (f"stage talker rank 0, pid {os.getpid()}", "stage test rank 0 needed", "memory_wait_s=0.2"):
        assert part in reply.detail, (part, reply.detail)
    assert device.free_bytes() == 1 << 20  # what the refused wake mapped is released again
    again = orch.request(worker, wake)  # a retry is answered from the cache, no second wait
    assert again == reply
    status = orch.request(worker, Status(task_id="status-1", epoch=EPOCH))
    assert status.state is WorkerState.SLEEPING

    # The other stage goes to sleep while a waiting wake is in flight.
    orch.send(worker, Wake(task_id="wake-2", epoch=EPOCH, memory_wait_s=60.0))
    device.write("talker", 0, os.getpid(), 0)
    reply = orch.next_message(worker)
    assert isinstance(reply, Ack) and reply.task_id == "wake-2" and reply.state is WorkerState.ACTIVE, reply
    after = orch.request(worker, Execute(task_id="exec-2", epoch=EPOCH, payload=PAYLOAD))
    assert after.output == before.output
    assert [h.nbytes for h in device.read()[0] if h.pid == hello.pid] == [loaded_bytes]

    reply = orch.request(worker, Shutdown(task_id="stop", epoch=EPOCH))
    assert isinstance(reply, Ack), reply
    assert worker.exit_code(30) == 0
    assert all(h.pid != hello.pid for h in device.read()[0])  # its file went with it
