"""Per-frame isolation in a rank's loop (omni_core.isolation): an exception raised in any
handler of one frame is counted by cause, the frame's task still gets its one reply, and the
loop serves on. Only a violated invariant of the core ends the loop.

The worker runs in this process (its loop on a thread, a PAIR socket to the test), so each
handler can be replaced by one that raises once."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch
import zmq

from omni_core.fsm import InvariantViolation
from omni_core.isolation import FrameErrors
from omni_core.protocol import (
    MAX_PAYLOAD_DEPTH,
    PROTOCOL_VERSION,
    Ack,
    Bucket,
    Execute,
    Hello,
    Message,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    SaveWeights,
    ShmSource,
    Sleep,
    Status,
    TensorSpec,
    TransferIn,
    TransferOut,
    Wake,
    decode,
    encode,
)
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers import process as worker_process
from omni_core.workers.config import WorkerConfig

SMALL = {"weights_bytes": 64 << 10, "tensor_count": 2, "kv_bytes": 16 << 10, "hidden": 16, "cpu_threads": 1}
PROBE = {"seed": 5, "batch": 1}
REPLY_TIMEOUT_S = 30.0
_ids = iter(range(1, 1 << 30))


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


class DeepRunner(SyntheticRunner):
    """Answers {"deep": n} with a result nested n deep (the runner's output is hostile too)."""

    def execute(self, payload: Any) -> Any:
        if isinstance(payload, dict) and "deep" in payload:
            return nested(int(payload["deep"]))
        return super().execute(payload)


class Peer:
    def __init__(self, sock: zmq.Socket, worker: worker_process.WorkerProcess) -> None:
        self.sock = sock
        self.worker = worker

    def send_raw(self, data: bytes) -> None:
        self.sock.send(data)

    def receive(self) -> Message:
        if not self.sock.poll(int(REPLY_TIMEOUT_S * 1000)):
            raise AssertionError(f"no reply within {REPLY_TIMEOUT_S} s")
        return decode(self.sock.recv())

    def request(self, command: Any) -> Message:
        self.send_raw(encode(command))
        reply = self.receive()
        assert reply.task_id == command.task_id, (reply, command)
        return reply

    def execute(self, payload: Any) -> Message:
        return self.request(Execute(task_id=f"x{next(_ids)}", epoch=0, payload=payload))

    def serves(self, reference: Any) -> None:
        """The loop still answers every kind of command, and a request as before."""
        assert isinstance(self.request(Status(task_id=f"s{next(_ids)}", epoch=0)), Ack)
        result = self.execute(PROBE)
        assert isinstance(result, Result) and result.output == reference, result
        assert self.request(Sleep(task_id=f"z{next(_ids)}", epoch=0, level=1)).state.value == "SLEEPING"
        assert self.request(Wake(task_id=f"w{next(_ids)}", epoch=0)).state.value == "ACTIVE"


@pytest.fixture
def peer() -> Iterator[Peer]:
    context = zmq.Context()
    sock, theirs = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    address = f"inproc://isolation-{next(_ids)}"
    sock.bind(address)
    theirs.connect(address)
    config = WorkerConfig(
        address="inproc://unused",
        rank=0,
        backend="portable",
        device="cpu",
        runner="tests.workers.test_frame_isolation:DeepRunner",
        runner_args=SMALL,
        exit_with_parent=False,
        parent_check_interval_s=0.05,
    )
    worker = worker_process.WorkerProcess(config, theirs)
    ended: dict[str, BaseException | int] = {}

    def run() -> None:
        try:
            worker.start()
            ended["code"] = worker.serve(os.getpid())
        except BaseException as exc:
            ended["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    torch.set_num_threads(1)
    thread.start()
    test_peer = Peer(sock, worker)
    test_peer.ended = ended  # type: ignore[attr-defined]
    test_peer.thread = thread  # type: ignore[attr-defined]
    assert isinstance(test_peer.receive(), Hello)
    try:
        yield test_peer
    finally:
        worker.stopped = True
        thread.join(10)
        sock.close(linger=0)
        theirs.close(linger=0)
        context.term()


def raise_once(original: Any, name: str, error: BaseException | None = None) -> Any:
    fired: list[bool] = []

    def fault(*args: Any, **kwargs: Any) -> Any:
        if not fired:
            fired.append(True)
            raise error if error is not None else RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    return fault


# Every step of one frame's handling: (where, name, the reply the faulted Execute gets).
HANDLERS = [
    ("module", "decode_command", NackReason.BAD_MESSAGE),
    ("core", "_on_command", NackReason.BAD_MESSAGE),
    ("worker", "handle", NackReason.BAD_MESSAGE),
    ("worker", "_execute_batch", NackReason.EXECUTE_ERROR),  # taken on by the core: the request's own error
    ("worker", "_answer_request", NackReason.EXECUTE_ERROR),
    ("core", "_on_done", NackReason.EXECUTE_ERROR),
    ("core", "_remember", NackReason.BAD_MESSAGE),  # the reply cache's digest, after the task was taken
    ("worker", "_send_all", NackReason.EXECUTE_ERROR),
    ("worker", "_send", NackReason.BAD_MESSAGE),
    ("worker", "_write", NackReason.EXECUTE_ERROR),
]


@pytest.mark.parametrize(("where", "name", "reason"), HANDLERS, ids=[h[1] for h in HANDLERS])
def test_an_exception_in_any_handler_is_counted_answered_and_the_loop_serves_on(peer, monkeypatch, where, name, reason):
    reference = peer.execute(PROBE).output
    owner = {"module": worker_process, "core": peer.worker.core, "worker": peer.worker}[where]
    monkeypatch.setattr(owner, name, raise_once(getattr(owner, name), name))
    before = peer.worker.frame_errors.counts.get("RuntimeError", 0)
    faulted = Execute(task_id="faulted", epoch=0, payload=PROBE)
    reply = peer.request(faulted)
    assert isinstance(reply, Nack) and reply.reason is reason, reply
    assert f"RuntimeError: injected fault in {name}" in reply.detail, reply.detail
    assert peer.worker.frame_errors.counts["RuntimeError"] == before + 1
    peer.serves(reference)
    assert "error" not in peer.ended and peer.thread.is_alive()


def test_a_violated_invariant_ends_the_loop_loudly(peer, monkeypatch):
    violation = InvariantViolation("injected: the core's state is impossible")
    monkeypatch.setattr(peer.worker.core, "_on_command", raise_once(None, "_on_command", violation))
    peer.send_raw(encode(Status(task_id="s", epoch=0)))
    peer.thread.join(REPLY_TIMEOUT_S)
    assert peer.ended.get("error") is violation


def test_an_unknown_exception_is_counted_as_other(peer, monkeypatch):
    class Surprise(Exception):
        pass

    monkeypatch.setattr(peer.worker.core, "_on_command", raise_once(None, "_on_command", Surprise("boo")))
    reply = peer.request(Status(task_id="s1", epoch=0))
    assert isinstance(reply, Nack) and "other: boo" in reply.detail, reply
    assert peer.worker.frame_errors.counts == {"other": 1}


def test_a_payload_or_result_too_deep_is_answered_never_dropped(peer):
    reference = peer.execute(PROBE).output
    # 986 deep decoded on the wire and then could not be re-encoded for the reply cache's
    # digest: no reply, the stage failed at the request deadline.
    for depth in (MAX_PAYLOAD_DEPTH + 1, 986):
        # Written as raw msgpack: encoding 986 levels from the test's own deep stack would fail.
        deep = msgspec.Raw(b"\x91" * (depth - 1) + b"\x90")
        peer.send_raw(
            msgspec.msgpack.encode(
                {"type": "Execute", "v": PROTOCOL_VERSION, "task_id": f"deep{depth}", "epoch": 0, "payload": deep}
            )
        )
        reply = peer.receive()
        assert reply.task_id == f"deep{depth}", reply
        assert isinstance(reply, Nack) and reply.reason is NackReason.BAD_MESSAGE, reply
        assert f"at most MAX_PAYLOAD_DEPTH={MAX_PAYLOAD_DEPTH}" in reply.detail and f"nests {depth}" in reply.detail
    reply = peer.execute({"deep": 986})  # the runner's result is as deep: the request's error
    assert isinstance(reply, Nack) and reply.reason is NackReason.EXECUTE_ERROR, reply
    assert "the result cannot be sent" in reply.detail and "nests 986" in reply.detail
    assert isinstance(peer.execute({"deep": MAX_PAYLOAD_DEPTH}), Result)
    peer.serves(reference)
    assert peer.worker.frame_errors.total == 0  # refused by design, nothing escaped a handler


def test_a_transfer_payload_too_deep_is_refused_never_raised(peer):
    """The kind of frame the schema fuzzer found (seed 20261126; its exact bytes against a
    worker process: tests/fuzz/test_regressions.py): a TransferOut whose payload nests 987
    deep, naming tensors the runner does not export. It decoded, the export was refused, and
    the refusal's reply-cache digest re-encoded the payload deeper in the stack: RecursionError
    into the loop's isolation. A TransferOut's payload is bounded as a request's is."""
    reference = peer.execute(PROBE).output
    for depth in (MAX_PAYLOAD_DEPTH + 1, 987):
        deep = msgspec.Raw(b"\x91" * (depth - 1) + b"\x90")  # raw: the test's stack may not encode it
        frame = {"type": "TransferOut", "v": PROTOCOL_VERSION, "task_id": f"tdeep{depth}", "epoch": 0}
        peer.send_raw(msgspec.msgpack.encode(frame | {"request_id": "r1", "names": ["cl4"], "payload": deep}))
        reply = peer.receive()
        assert isinstance(reply, Nack) and reply.reason is NackReason.BAD_MESSAGE, reply
        assert reply.task_id == f"tdeep{depth}" and reply.state.value == "ACTIVE", reply
        assert "invalid TransferOut.payload: a payload must be at most MAX_PAYLOAD_DEPTH" in reply.detail
        assert f"nests {depth} levels" in reply.detail, reply.detail
    peer.serves(reference)
    assert peer.worker.frame_errors.total == 0  # refused at decode: nothing reached the isolation


GONE = ShmSource(
    buckets=(
        Bucket(
            handle="/dev/shm/omni-test-gone",
            nbytes=16,
            sender_pid=1,
            tensors=(TensorSpec(name="hidden", dtype="float32", shape=(2, 2)),),
        ),
    )
)


def _worker_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "omni_core.worker"]


def test_a_refused_argument_logs_one_warning_line_and_a_failure_its_traceback(peer, monkeypatch, caplog):
    """A RunnerArgumentError is the caller's to mend, from whichever command: one WARNING line,
    no traceback (a transfer's or a save's was an ERROR with one). The wire was right before."""
    refused = [
        TransferOut(task_id="t-out", epoch=0, request_id="r1", names=("cl4",)),
        TransferIn(task_id="t-in", epoch=0, request_id="r2", producer_version=5, expect_version=0, source=GONE),
        SaveWeights(task_id="t-save", epoch=0, directory="relative/dir"),
        ReloadWeights(task_id="t-reload", epoch=0, source="seed:--5"),
    ]
    for command in refused:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="omni_core.worker"):
            reply = peer.request(command)
        assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_ARGUMENT, reply
        assert reply.state.value == "ACTIVE", reply
        (record,) = _worker_records(caplog)
        assert record.levelno == logging.WARNING and record.exc_info is None, record.getMessage()
        message = record.getMessage()
        assert f"{command.task_id!r} refused: RunnerArgumentError" in message, message
        assert "Traceback" not in message and "\n" not in message, message

    def broken(runner: Any, command: Any, core: Any) -> Any:
        raise RuntimeError("the export's device fell over")

    monkeypatch.setitem(worker_process.COMMAND_HANDLERS, TransferOut, broken)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="omni_core.worker"):
        reply = peer.request(TransferOut(task_id="t-broken", epoch=0, request_id="r3", names=("hidden",)))
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_ARGUMENT, reply  # the row's error
    (record,) = _worker_records(caplog)
    assert record.levelno == logging.ERROR and "TransferOut 't-broken' failed:\nTraceback" in record.getMessage()
    assert "the export's device fell over" in record.getMessage()


def test_frame_errors_count_by_closed_cause_and_log_once_per_interval(caplog):
    now = [0.0]
    errors = FrameErrors("loop", logging.getLogger("test.isolation"), log_interval_s=60.0, clock=lambda: now[0])

    class Made(Exception):  # a class name no peer can add to the labels
        pass

    with caplog.at_level(logging.ERROR, logger="test.isolation"):
        for n in range(1000):
            now[0] = n * 0.01
            errors.record(Made(f"name {n}") if n % 2 else ValueError(n), "a frame")
        assert set(errors.counts) == {"other", "ValueError"} and errors.total == 1000
        assert len(caplog.records) == 2  # one line per cause in the first minute
        now[0] = 61.0
        errors.record(ValueError("again"), "a frame")
        assert len(caplog.records) == 3 and "500 of this cause" not in caplog.records[-1].getMessage()
        assert "501 of this cause so far, 499 since the last line" in caplog.records[-1].getMessage()
    assert errors.as_counters() == {"frame_errors": 1001, "frame_errors_ValueError": 501, "frame_errors_other": 500}
