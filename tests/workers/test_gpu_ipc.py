"""Issue 35 item 8 on a GPU: a real CUDA IPC round trip between two processes with the typed
handle, and the checks a tampered description meets on a real device.

A trainer process (`WeightSender` on cuda:0) shares its buckets and prints the `IpcSource`
as JSON, msgspec's own wire form; this process is the rank: it decodes the source as the
server does and takes it through `WeightReceiver`. Then the trainer refills the same buckets
(the rank reads them through the mapping it holds), and descriptions an attacker edited are
refused, the rank still taking honest updates afterwards.

    python3 -m pytest -q -m gpu tests/workers/test_gpu_ipc.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from omni_core.protocol import IpcSource
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.weight_receiver import WeightReceiver

ROOT = Path(__file__).resolve().parents[2]
RUNNER_ARGS = {"weights_bytes": 8 << 20, "tensor_count": 4, "hidden": 256, "kv_bytes": 1 << 20}

TRAINER = textwrap.dedent(
    """
    import sys, msgspec, torch
    from omni_core.runners.synthetic import SyntheticRunner
    from omni_core.weights_sender import WeightSender

    model = SyntheticRunner(torch.device("cpu"), **{args})
    specs = model.weight_specs()
    sender = WeightSender(bucket_bytes=4 << 20)
    for line in sys.stdin:  # one value a line: share it, print the source
        value = float(line)
        tensors = {{n: torch.full(s, value, dtype=d, device="cuda:0") for n, (s, d) in specs.items()}}
        print(msgspec.json.encode(sender.share(tensors)).decode(), flush=True)
    sender.close()
    """
)


@pytest.fixture
def trainer():  # type: ignore[no-untyped-def]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER.format(args=RUNNER_ARGS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )

    def share(value: float) -> IpcSource:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{value}\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, f"the trainer exited ({proc.poll()})"
        return msgspec.json.decode(line, type=IpcSource, strict=True)

    share.pid = proc.pid  # type: ignore[attr-defined]
    yield share
    assert proc.stdin is not None
    proc.stdin.close()
    proc.wait(60)


def weights_are(runner: SyntheticRunner, value: float) -> bool:
    return all(torch.equal(w, torch.full_like(w, value)) for w in runner.weights)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_trainer_process_shares_cuda_buckets_through_the_typed_handle(trainer) -> None:  # type: ignore[no-untyped-def]
    device = torch.device("cuda", 0)
    runner = SyntheticRunner(device, **RUNNER_ARGS)
    runner.load_weights()
    runner.allocate_caches()
    receiver = WeightReceiver(device, 0)

    first = trainer(0.75)
    assert len(first.buckets) >= 2 and all(b.ipc is not None and b.handle is None for b in first.buckets)
    assert all(b.sender_pid == trainer.pid for b in first.buckets)
    receiver.apply(first, runner)
    torch.cuda.synchronize(device)
    assert weights_are(runner, 0.75)
    assert receiver.reopened == len(first.buckets)

    again = trainer(0.25)  # the same buckets refilled: the same descriptions, the mappings reused
    assert again == first
    receiver.apply(again, runner)
    torch.cuda.synchronize(device)
    assert weights_are(runner, 0.25) and receiver.reopened == len(first.buckets)

    bucket = first.buckets[0]
    assert bucket.ipc is not None
    total = torch.cuda.get_device_properties(0).total_memory
    tampered = [
        # past the allocation the handle opens: the driver's range check refuses it
        (
            msgspec.structs.replace(bucket.ipc, storage_offset=bucket.ipc.storage_offset + (64 << 20)),
            "outside its allocation|knows no allocation|ends past the",
        ),
        # more than the device holds
        (msgspec.structs.replace(bucket.ipc, storage_size=total + 1), "more than cuda:0 holds"),
        # another process's ref counter
        (msgspec.structs.replace(bucket.ipc, ref_counter_handle=b"/torch_1_2_3"), "not the sender's torch ref"),
    ]
    for ipc, match in tampered:
        forged = IpcSource(buckets=(msgspec.structs.replace(bucket, ipc=ipc),))
        with pytest.raises(RunnerArgumentError, match=match):
            receiver.apply(forged, runner)
        torch.cuda.synchronize(device)  # the rank's CUDA context is intact
        assert weights_are(runner, 0.25)

    receiver.apply(trainer(0.5), runner)  # honest updates still go through
    torch.cuda.synchronize(device)
    assert weights_are(runner, 0.5)
    receiver.close()
