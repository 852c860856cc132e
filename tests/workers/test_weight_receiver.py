"""The rank's receiver (P-17) on CPU: every refusal before the first write, and the worker
invalidating the backend's host copy of the weights before an update writes them."""

from __future__ import annotations

import os
import threading
from typing import ClassVar

import pytest
import torch
import zmq

from omni_core.fsm.effects import UpdateEffect
from omni_core.protocol import CollectiveSource, CudaIpcHandle, IpcBucket, IpcSource, ShmSource, TensorSpec
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weights_sender import WeightSender
from omni_core.workers import process as worker_process
from omni_core.workers.config import WorkerConfig
from omni_core.workers.weight_receiver import WeightReceiver

from .test_clean_sleep import RecordingBackend

W = "weights"


class RecordingRunner(SyntheticRunner):
    """Records every write, so a test sees what happened before the first one."""

    writes: ClassVar[list[str]] = []

    def update_weights(self, named):  # type: ignore[no-untyped-def]
        for name, tensor in named:
            RecordingRunner.writes.append(name)
            super().update_weights([(name, tensor)])


def weights_like(runner: SyntheticRunner, value: float) -> dict[str, torch.Tensor]:
    return {n: torch.full(shape, value, dtype=dtype) for n, (shape, dtype) in runner.weight_specs().items()}


def test_shm_buckets_are_written_and_reopened_only_when_they_change(runner: RecordingRunner) -> None:
    receiver = WeightReceiver(torch.device("cpu"), 0)
    with WeightSender(bucket_bytes=1024) as sender:  # one 1 KiB tensor per bucket
        source = sender.share(weights_like(runner, 0.5))
        assert len(source.buckets) == 2
        receiver.apply(source, runner)
        assert all(torch.equal(w, torch.full_like(w, 0.5)) for w in runner.weights)
        receiver.apply(sender.share(weights_like(runner, 0.25)), runner)  # same buckets, refilled
        assert all(torch.equal(w, torch.full_like(w, 0.25)) for w in runner.weights)
        assert receiver.reopened == 2 and sender.reused == 1


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda s: {**s, "w0": torch.zeros(2, 2)}, r"tensor 'w0' is float32 \[2, 2\]"),
        (lambda s: {**s, "w9": torch.zeros(16, 16)}, "'w9' is not a weight of this model"),
        (lambda s: {**s, "w1": s["w1"].double()}, "is float64"),
    ],
)
def test_a_mismatch_anywhere_is_refused_before_the_first_write(runner: RecordingRunner, change, match) -> None:
    before = [w.clone() for w in runner.weights]
    with WeightSender() as sender, pytest.raises(RunnerArgumentError, match=match):
        WeightReceiver(torch.device("cpu"), 0).apply(sender.share(change(weights_like(runner, 1.0))), runner)
    assert RecordingRunner.writes == [] and all(torch.equal(a, b) for a, b in zip(before, runner.weights, strict=True))


def test_a_bucket_of_a_dead_sender_is_refused_by_pid(runner: RecordingRunner) -> None:
    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    with WeightSender() as sender:
        source = sender.share(weights_like(runner, 1.0))
        forged = ShmSource(
            buckets=tuple(
                b.__class__(handle=b.handle, nbytes=b.nbytes, sender_pid=child, tensors=b.tensors)
                for b in source.buckets
            )
        )
        with pytest.raises(RunnerArgumentError, match=f"sender pid {child} .* no longer runs"):
            WeightReceiver(torch.device("cpu"), 0).apply(forged, runner)
    assert RecordingRunner.writes == []


@pytest.mark.parametrize("handle", ["/etc/passwd", "/dev/shm/../etc/passwd", "..", "/dev/shm/a/b"])
def test_a_handle_outside_the_shared_memory_directory_is_refused(runner: RecordingRunner, handle: str) -> None:
    with WeightSender() as sender:
        bucket = sender.share(weights_like(runner, 1.0)).buckets[0]
        bad = ShmSource(
            buckets=(
                bucket.__class__(handle=handle, nbytes=bucket.nbytes, sender_pid=os.getpid(), tensors=bucket.tensors),
            )
        )
        with pytest.raises(RunnerArgumentError, match="not a file directly under /dev/shm"):
            WeightReceiver(torch.device("cpu"), 0).apply(bad, runner)


def fake_ipc(pid: int, nbytes: int, **fields) -> CudaIpcHandle:  # type: ignore[no-untyped-def]
    """A CUDA IPC description of the form torch makes (version 2, a cudaMalloc block)."""
    values = {
        "device": 0,
        "handle": bytes([2, ord("c")]) + bytes(range(64)),
        "storage_offset": 0,
        "storage_size": max(nbytes, 1),
        "offset": 0,
        "size": max(nbytes, 1),
        "ref_counter_handle": f"/torch_{pid}_1234_0".encode(),
        "ref_counter_offset": 0,
    }
    return CudaIpcHandle(**{**values, **fields})


def ipc_source_like(source: ShmSource, **fields) -> IpcSource:  # type: ignore[no-untyped-def]
    return IpcSource(
        buckets=tuple(
            IpcBucket(
                nbytes=b.nbytes,
                sender_pid=b.sender_pid,
                tensors=b.tensors,
                ipc=fake_ipc(b.sender_pid, b.nbytes, **fields),
            )
            for b in source.buckets
        )
    )


def test_ipc_on_a_cpu_rank_and_a_broadcast_without_a_group_are_refused(runner: RecordingRunner) -> None:
    receiver = WeightReceiver(torch.device("cpu"), 0)
    with WeightSender() as sender:
        source = ipc_source_like(sender.share(weights_like(runner, 1.0)))
        with pytest.raises(RunnerArgumentError, match="CUDA IPC handles; this rank is on cpu"):
            receiver.apply(source, runner)
    spec = TensorSpec(name="w0", dtype="float32", shape=tuple(runner.weights[0].shape))
    with pytest.raises(RunnerArgumentError, match="send InitWeightGroup first"):
        receiver.apply(CollectiveSource(tensors=(spec,)), runner)
    assert RecordingRunner.writes == []


def test_the_worker_invalidates_the_host_copy_before_an_update_writes(monkeypatch) -> None:
    """A `fast` backend keeps a clean host copy of read-only weights: an update that does not
    invalidate it wakes the previous version (test_clean_sleep shows what invalidate does)."""
    backend = RecordingBackend(torch.device("cpu"))
    monkeypatch.setattr(worker_process, "select_backend", lambda name, device: backend)
    context = zmq.Context()
    sock, peer = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    sock.bind("inproc://weight-update")
    peer.connect("inproc://weight-update")
    try:
        config = WorkerConfig(
            address="inproc://unused",
            rank=0,
            runner="tests.workers.test_weight_receiver:RecordingRunner",
            runner_args={"weights_bytes": 4096, "tensor_count": 2, "hidden": 16, "kv_bytes": 1024},
        )
        worker = worker_process.WorkerProcess(config, sock)
        worker.start()
        original = backend.invalidate
        writes = type(worker.runner).writes  # the class the worker imported by its path
        writes.clear()

        def invalidate(tags) -> None:  # type: ignore[no-untyped-def]
            assert writes == [], "invalidated after the update wrote"
            original(tags)

        backend.invalidate = invalidate  # type: ignore[method-assign]
        assert worker.runner is not None
        with WeightSender() as sender:
            source = sender.share(weights_like(worker.runner, 2.0))  # type: ignore[arg-type]
            worker._apply(UpdateEffect(task_id="u1", version=1, source=source))
        assert backend.calls[-1] == ("invalidate", frozenset({W})) and writes == ["w0", "w1"]
    finally:
        sock.close(linger=0)
        peer.close(linger=0)
        context.term()


def test_a_new_sender_sweeps_the_buckets_of_killed_senders(tmp_path) -> None:
    from omni_core.weights_sender import sweep_stale

    child = os.fork()
    if child == 0:
        os._exit(0)
    os.waitpid(child, 0)
    dead = tmp_path / f"omni-weights-{child}-0123abcd-1"
    live = tmp_path / f"omni-weights-{os.getppid()}-0123abcd-1"
    other = tmp_path / "someone-else"
    for path in (dead, live, other):
        path.write_bytes(b"x")
    assert sweep_stale(tmp_path) == [dead.name]
    assert not dead.exists() and live.exists() and other.exists()
    with WeightSender(shm_dir=tmp_path) as sender:
        assert sender.swept == []


def test_a_rendezvous_blocked_past_its_time_is_left_behind_and_forces_a_hard_exit(monkeypatch) -> None:
    """A join thread still inside torch when the rank ends would abort the process at
    finalization ("terminate called without an active exception", exit -6 after a clean
    Shutdown): it is counted, and the rank leaves by os._exit while it runs."""
    from omni_core.workers import weight_receiver

    monkeypatch.setattr(weight_receiver, "JOIN_UNBLOCK_S", 0.01)
    receiver = WeightReceiver(torch.device("cpu"), 0)
    release = threading.Event()
    with pytest.raises(TimeoutError, match="left behind"):
        weight_receiver.bounded_join(release.wait, 0.01, "127.0.0.1", 9, receiver._joins_left_behind)
    assert receiver.blocked_joins == 1
    worker = object.__new__(worker_process.WorkerProcess)
    worker.backend, worker.receiver = None, receiver
    assert worker.hard_exit_required
    release.set()
    receiver._joins_left_behind[0].join(5)
    assert receiver.blocked_joins == 0 and not worker.hard_exit_required
