"""The node ledger on a real GPU: a rank registers its holdings under the GPU's UUID, and a
waiting wake is refused, before it maps anything, while another engine's wake holds the
device, naming that wake; a rank's refusal for memory names the ledger's holders among
NVML's pids. omni_fast's side is in tests/workers/test_fast_vllm_plugin.py.

    source .device/setup.sh && python3 -m pytest -q -m gpu tests/workers/test_gpu_ledger.py
"""

from __future__ import annotations

import os

import pytest
import torch

from omni_core.protocol import Ack, Nack, NackReason, Shutdown, Sleep, Wake, WorkerState
from omni_core.workers.accounting import ProcessMemory
from omni_core.workers.device_ledger import gpu_ledger_directory, one_incoming_wake
from omni_core.workers.ledger_files import ENV_LEDGER_DIR
from omni_core.workers.simulated_device import SimulatedDevice

from ._harness import TestOrchestrator
from .test_process_swap import EPOCH, RUNNER_ARGS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def orch():
    o = TestOrchestrator()
    yield o
    o.close()


def test_a_gpu_rank_registers_and_its_waiting_wake_takes_its_turn(orch, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_LEDGER_DIR, str(tmp_path / "ledgers"))  # inherited by the rank
    memory = ProcessMemory("cuda:0")
    if memory.physical is None:
        pytest.skip(f"NVML cannot name the GPU: {memory.nvml_problem}")
    directory = gpu_ledger_directory(memory.physical.uuid)
    ledger = SimulatedDevice(directory, memory.total_bytes())
    worker = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, backend="portable", device="cuda", epoch=EPOCH)
    orch.wait_hello(worker)
    [held] = [h for h in ledger.holders().holders if h.label == "stage test rank 0"]
    assert held.nbytes > 0 and held.engine_pid == os.getpid()  # this test is the rank's engine
    assert isinstance(orch.request(worker, Sleep(task_id="sleep-1", epoch=EPOCH, level=1)), Ack)
    assert [h.nbytes for h in ledger.holders().holders if h.label == "stage test rank 0"] == [0]
    free_asleep = torch.cuda.mem_get_info()[0]
    with one_incoming_wake(directory, "stage other rank 0, pid 4242 (engine pid 4240)", 5.0):
        reply = orch.request(worker, Wake(task_id="wake-1", epoch=EPOCH, memory_wait_s=0.3))
        assert isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY, reply
        assert reply.state is WorkerState.SLEEPING and "stage other rank 0, pid 4242 (engine pid 4240)" in reply.detail
        assert torch.cuda.mem_get_info()[0] >= free_asleep - (64 << 20)  # nothing of the wake stayed mapped
    reply = orch.request(worker, Wake(task_id="wake-2", epoch=EPOCH, memory_wait_s=5.0))
    assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply
    assert [h.nbytes for h in ledger.holders().holders if h.label == "stage test rank 0"] == [held.nbytes]
    assert isinstance(orch.request(worker, Shutdown(task_id="stop", epoch=EPOCH)), Ack)
