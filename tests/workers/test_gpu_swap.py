"""A wake's memory gate on a real GPU (cumem and fast), through a real worker process: this
test process plays the other stage by holding most of the device. A wake that finds too
little free memory maps part of its allocations, waits, is refused NO_MEMORY and rolls back
(the device memory it took is returned, the rank stays SLEEPING); once the memory is freed a
wake restores bit-exact, and a wake already waiting goes on as soon as it is freed.

    source .device/setup.sh && python3 -m pytest -m gpu tests/workers/test_gpu_swap.py
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from omni_core.protocol import Ack, Capability, Execute, Nack, NackReason, Result, Shutdown, Sleep, Wake, WorkerState

from . import test_gpu_backends
from ._harness import TestOrchestrator

GiB, MiB = 1 << 30, 1 << 20


pytestmark = test_gpu_backends.pytestmark  # the gpu marker; skipped where cumem cannot run

# 1 GiB of weights in 64 tensors (16 MiB each) and 512 MiB of KV: small enough to load fast,
# many allocations so that a refused wake has mapped some before it runs out.
RUNNER_ARGS = {
    "weights_bytes": GiB,
    "tensor_count": 64,
    "kv_bytes": 512 * MiB,
    "hidden": 1024,
    "dtype": "bfloat16",
    "seed": 99,
}
PAYLOAD = {"seed": 7, "batch": 4}
LEFT_FREE_BYTES = 256 * MiB  # what the hog leaves: room for some weight tensors, not all
EPOCH = 1
REPLY_S = 300.0


def hog_device() -> torch.Tensor:
    """Hold all but LEFT_FREE_BYTES of the GPU from this process (the "other stage")."""
    free, _ = torch.cuda.mem_get_info()
    return torch.empty(max(0, free - LEFT_FREE_BYTES), dtype=torch.uint8, device="cuda")


def give_back() -> None:
    """After the caller dropped its hold: return the cached blocks to the driver, so that the
    worker's mem_get_info sees them free."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("backend", ["cumem", "fast"])
def test_a_refused_wake_rolls_back_and_a_waiting_wake_goes_on_when_memory_frees(backend):
    orch = TestOrchestrator()
    held: list[torch.Tensor] = []  # the other stage's memory
    try:
        worker = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, backend=backend, device="cuda", epoch=EPOCH)
        hello = orch.wait_hello(worker, timeout_s=REPLY_S)
        assert hello.state is WorkerState.ACTIVE, hello.detail
        assert Capability.SWAP in hello.capabilities
        reference = orch.request(worker, Execute(task_id="exec-0", epoch=EPOCH, payload=PAYLOAD), REPLY_S)
        assert isinstance(reference, Result), reference
        reply = orch.request(worker, Sleep(task_id="sleep-1", epoch=EPOCH, level=1), REPLY_S)
        assert isinstance(reply, Ack) and reply.state is WorkerState.SLEEPING, reply

        held.append(hog_device())
        free_before, _ = torch.cuda.mem_get_info()
        reply = orch.request(worker, Wake(task_id="wake-1", epoch=EPOCH, memory_wait_s=0.5), REPLY_S)
        assert isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY, reply
        assert reply.state is WorkerState.SLEEPING
        assert "stage test rank 0 needed" in reply.detail and "memory_wait_s=0.5" in reply.detail
        assert f"pid {os.getpid()}" in reply.detail or "holders unknown" in reply.detail, reply.detail
        free_after, _ = torch.cuda.mem_get_info()
        # The refused wake mapped part of its weights, then unmapped them again.
        assert free_after >= free_before - 8 * MiB, (free_before, free_after)

        held.clear()
        give_back()
        reply = orch.request(worker, Wake(task_id="wake-2", epoch=EPOCH, memory_wait_s=30.0), REPLY_S)
        assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply
        again = orch.request(worker, Execute(task_id="exec-1", epoch=EPOCH, payload=PAYLOAD), REPLY_S)
        assert again.output == reference.output  # bit-exact after a refused wake and a good one

        # A swap's shape: the wake is sent while the memory is still held and goes on once freed.
        reply = orch.request(worker, Sleep(task_id="sleep-2", epoch=EPOCH, level=1), REPLY_S)
        assert isinstance(reply, Ack) and reply.state is WorkerState.SLEEPING, reply
        held.append(hog_device())
        started = time.monotonic()
        orch.send(worker, Wake(task_id="wake-3", epoch=EPOCH, memory_wait_s=120.0))
        time.sleep(0.5)  # not a proof of anything: lets the wake start waiting before the memory goes
        held.clear()
        give_back()
        reply = orch.next_message(worker, REPLY_S)
        assert isinstance(reply, Ack) and reply.task_id == "wake-3" and reply.state is WorkerState.ACTIVE, reply
        assert time.monotonic() - started < 120.0
        again = orch.request(worker, Execute(task_id="exec-2", epoch=EPOCH, payload=PAYLOAD), REPLY_S)
        assert again.output == reference.output

        reply = orch.request(worker, Shutdown(task_id="stop", epoch=EPOCH), REPLY_S)
        assert isinstance(reply, Ack), reply
    finally:
        held.clear()
        give_back()
        orch.close()
