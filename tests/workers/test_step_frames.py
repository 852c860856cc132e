"""The bound on frames a rank handles between two steps of its running requests
(`STEP_FRAMES_MAX`, workers/process.py): a flood of frames waiting on the socket is served a
bounded slice per step, so it cannot starve the requests that decode, and every frame is
still answered; a Status is answered beside running requests, not after them. The worker
runs in this process (its loop on a thread, a PAIR socket to the test); its runner's first
step waits until the flood is queued, so each slice is full."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

from omni_core.protocol import Ack, Execute, Hello, Message, Nack, NackReason, Result, Status, decode, encode
from omni_core.workers import process as worker_process
from omni_core.workers.config import WorkerConfig
from tests.engine.stepping_runner import SteppingRunner

SMALL = {"weights_bytes": 64 << 10, "tensor_count": 2, "kv_bytes": 16 << 10, "hidden": 16, "cpu_threads": 1}
REPLY_TIMEOUT_S = 30.0
FLOOD = 3 * worker_process.STEP_FRAMES_MAX + 5


class CountingRunner(SteppingRunner):
    """Records, at each step, how many frames the rank handled since the step before."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frames = 0  # handled since the last step: the worker counts, the runner reads
        self.frames_between_steps: list[int] = []
        self.flooded = threading.Event()

    def step_requests(self) -> list[tuple[str, Any]]:
        self.frames_between_steps.append(self.frames)
        self.frames = 0
        self.flooded.wait(REPLY_TIMEOUT_S)  # the first step waits until the whole flood is queued
        return super().step_requests()


@pytest.fixture
def rank() -> Iterator[tuple[zmq.Socket, worker_process.WorkerProcess]]:
    context = zmq.Context()
    sock, theirs = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    sock.bind("inproc://step-frames")
    theirs.connect("inproc://step-frames")
    config = WorkerConfig(
        address="inproc://unused",
        rank=0,
        backend="portable",
        device="cpu",
        runner="tests.workers.test_step_frames:CountingRunner",
        runner_args=SMALL,
        exit_with_parent=False,
        parent_check_interval_s=0.05,
        batch_max_requests=4,
    )
    worker = worker_process.WorkerProcess(config, theirs)
    handle = worker.handle_isolated

    def counted(data: bytes | memoryview) -> None:
        worker.runner.frames += 1  # type: ignore[union-attr]
        handle(data)

    worker.handle_isolated = counted  # type: ignore[method-assign]
    thread = threading.Thread(target=lambda: (worker.start(), worker.serve(os.getpid())), daemon=True)
    torch.set_num_threads(1)
    thread.start()
    assert isinstance(_receive(sock), Hello)
    try:
        yield sock, worker
    finally:
        worker.runner.flooded.set()  # type: ignore[union-attr]
        worker.stopped = True
        thread.join(10)
        sock.close(linger=0)
        theirs.close(linger=0)
        context.term()


def _receive(sock: zmq.Socket) -> Message:
    if not sock.poll(int(REPLY_TIMEOUT_S * 1000)):
        raise AssertionError(f"no reply within {REPLY_TIMEOUT_S} s")
    return decode(sock.recv())


def test_a_flood_is_served_a_bounded_slice_per_step_and_every_frame_answered(rank, tmp_path: Path) -> None:
    sock, worker = rank
    release = tmp_path / "release"
    sock.send(encode(Execute(task_id="held", epoch=0, payload={"seed": 1, "until": str(release)})))
    for i in range(FLOOD):
        sock.send(b"\xc1not msgpack %d" % i)  # each is answered NACK BAD_MESSAGE, none waits for the request
    worker.runner.flooded.set()  # type: ignore[union-attr]
    refusals = [_receive(sock) for _ in range(FLOOD)]
    assert all(isinstance(r, Nack) and r.reason is NackReason.BAD_MESSAGE for r in refusals)
    release.touch()
    assert isinstance(_receive(sock), Result)
    assert worker.runner is not None
    between = worker.runner.frames_between_steps  # type: ignore[attr-defined]
    assert max(between) == worker_process.STEP_FRAMES_MAX, between  # full slices, never more
    assert sum(between) >= FLOOD


def test_a_status_is_answered_beside_a_running_request(rank, tmp_path: Path) -> None:
    sock, worker = rank
    release = tmp_path / "release"
    worker.runner.flooded.set()  # type: ignore[union-attr]
    sock.send(encode(Execute(task_id="held", epoch=0, payload={"seed": 1, "until": str(release)})))
    sock.send(encode(Status(task_id="probe", epoch=0)))
    status = _receive(sock)  # the request still runs: it waits for a file not yet made
    assert isinstance(status, Ack) and status.task_id == "probe" and status.memory is None
    release.touch()
    result = _receive(sock)
    assert isinstance(result, Result) and result.task_id == "held"
