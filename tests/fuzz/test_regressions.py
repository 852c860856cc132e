"""What the fuzzer found, as exact bytes. An open bug is xfail(strict=True), with an entry in
omni_testing/fuzz/known_issues.py; both go with the fix. The three found so far are fixed:
unparsable synthetic seeds (now INVALID_ARGUMENT), requests over max_frame_bytes (refused
at submit) and frames over a worker's socket limit (the worker's socket no longer drops
them; its codec refuses them).

1. ReloadWeights sources the synthetic runner lets through its check but cannot parse put
   the worker in FAILED (BACKEND_ERROR) instead of a refusal (INVALID_ARGUMENT). Found by
   `python -m omni_testing.fuzz --target worker --frames 30000 --seed 3` (the frames below are
   the ones it sent, with the epoch set back to 0 for a fresh worker).
2. A request larger than the stage's max_frame_bytes is sent to the ranks anyway: up to 64 KiB
   over, the rank refuses it as BAD_MESSAGE without a task_id (the size check comes before
   the envelope is read), further over, zmq drops the rank's connection; either way the
   request waits for its deadline and the stage FAILS.
3. A frame over a worker's socket limit (max_frame_bytes + 64 KiB) makes libzmq close the
   worker's connection as a protocol error, and a connecting socket does not reconnect after
   one: the process lives on, deaf, until its parent dies.
4. A TransferOut whose payload nests 987 deep decoded (only a request's payload and a
   result's output had their depth checked), its export was refused, and the refusal's
   reply-cache digest re-encoded the command deeper in the stack: RecursionError into the
   worker loop's isolation. Now every field typed Any is checked at decode (BAD_MESSAGE).
5. A frame whose payload is 986 one-key maps and then a reserved byte: from the fuzzer's
   shallow stack msgspec met the byte (malformed: task '-'), from the worker's deeper one it
   ran out of stack first and the envelope scanner named the task. Now a refused frame that
   nests deeper than DECODER_SAFE_DEPTH is read by the scanner in every process.
   Both found by the schema fuzzer (tests/fuzz/test_fuzz_schema.py, seed 20261126) once the
   derived generator's identifiers drew their first letter first; epochs set back to 0.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from omni_core.engine import Engine, StageSpec
from omni_core.engine.errors import InvalidArgumentError, RequestRejectedError
from omni_core.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    Ack,
    Nack,
    NackReason,
    ProtocolError,
    Status,
    WorkerState,
    decode,
    decode_command,
    encode,
)
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.transport.zmq_socket import SOCKET_FRAME_SLACK_BYTES

from ._worker import RawWorker

_HEAD = "85a474797065ad52656c6f616457656967687473a17601a77461736b5f6964a7"  # map(5) type ReloadWeights v 1 task_id
# ReloadWeights(task_id=..., epoch=0, source=...), byte for byte as the fuzzer wrote them.
RELOAD_FRAMES: dict[str, bytes] = {
    "double_minus": bytes.fromhex(_HEAD + "667a2d34363535a565706f636800a6736f75726365a8736565643a2d2d35"),
    "superscript_two": bytes.fromhex(_HEAD + "667a2d38313335a565706f636800a6736f75726365a7736565643ac2b2"),
    "5000_digits": bytes.fromhex(_HEAD + "667a2d34343730a565706f636800a6736f75726365da138d") + b"seed:" + b"9" * 5000,
}
# TransferOut(task_id="fz-734", request_id="jwnn3", names=("cl4", "kf0z4dqpsi"), payload=986
# one-item arrays around {"seed": 1, "batch": 1}), byte for byte as the schema fuzzer wrote it.
DEEP_TRANSFER_OUT = (
    bytes.fromhex(
        "89a474797065ab5472616e736665724f7574a17601a77461736b5f6964a6667a2d373334a565706f636800aa7265717565"
        "73745f6964a56a776e6e33a56e616d657392a3636c34aa6b66307a346471707369a77061796c6f6164"
    )
    + b"\x91" * 986
    + bytes.fromhex("82a47365656401a5626174636801a96d61785f6279746573ce40000000ac6275636b65745f6279746573ce10000000")
)
# {"type": "", "v": 1, "task_id": "fz-3337", "epoch": 0, "payload": 986 one-key maps, then 0xc1}.
DEEP_BROKEN = bytes.fromhex("85a474797065a0a17601a77461736b5f6964a7667a2d33333337a565706f636800a77061796c6f6164")
DEEP_BROKEN += b"\x81\xa1k" * 986 + b"\xc1"
SMALL = {"weights_bytes": 256 << 10, "tensor_count": 4, "kv_bytes": 64 << 10, "hidden": 32, "cpu_threads": 1}


def test_the_frames_are_valid_reload_commands() -> None:
    sources = {name: decode(data).source for name, data in RELOAD_FRAMES.items()}  # type: ignore[attr-defined]
    expected = {"double_minus": "seed:--5", "superscript_two": "seed:\u00b2", "5000_digits": "seed:" + "9" * 5000}
    assert sources == expected


@pytest.mark.parametrize("name", sorted(RELOAD_FRAMES))
def test_synthetic_reload_refuses_unparsable_seed(name: str) -> None:
    source = decode(RELOAD_FRAMES[name]).source  # type: ignore[attr-defined]
    runner = SyntheticRunner(torch.device("cpu"), **SMALL)
    runner.load_weights()
    with pytest.raises(RunnerArgumentError):
        runner.reload_weights(source)


@pytest.fixture(scope="module")
def worker() -> Iterator[RawWorker]:
    raw = RawWorker()
    try:
        yield raw
    finally:
        raw.close()


def test_worker_refuses_unparsable_reload_source_and_stays_active(worker: RawWorker) -> None:
    for name, data in sorted(RELOAD_FRAMES.items()):
        reply = worker.request(data)
        assert isinstance(reply, Nack), (name, reply)
        assert reply.reason is NackReason.INVALID_ARGUMENT, (name, reply.reason, reply.detail[:300])
        assert reply.state is WorkerState.ACTIVE, (name, reply.state)


# Findings 4 and 5 hang on how deep a stack is: whether these bytes reach the bug depends on
# the process. Their deterministic tests: tests/workers/test_frame_isolation.py (a too-deep
# TransferOut into the rank's loop), tests/test_codec.py (each Any field's bound) and
# tests/test_envelope_scan.py (one envelope at every stack depth).
def test_worker_refuses_a_transfer_payload_too_deep_at_decode(worker: RawWorker) -> None:
    reply = worker.request(DEEP_TRANSFER_OUT)
    assert isinstance(reply, Nack) and reply.reason is NackReason.BAD_MESSAGE, reply
    assert reply.task_id == "fz-734" and reply.state is WorkerState.ACTIVE, reply
    assert reply.detail.startswith("invalid TransferOut"), reply.detail  # the codec's refusal, not the isolation's


def test_worker_and_this_process_name_the_same_task_for_a_deep_broken_frame(worker: RawWorker) -> None:
    with pytest.raises(ProtocolError) as here:
        decode_command(DEEP_BROKEN)
    reply = worker.request(DEEP_BROKEN)
    assert isinstance(reply, Nack) and reply.reason is NackReason.BAD_MESSAGE, reply
    assert reply.task_id == here.value.task_id == "fz-3337", (reply, str(here.value))
    assert reply.state is WorkerState.ACTIVE


# Last in this module: it cuts the shared worker off.
def test_worker_stays_reachable_after_a_frame_over_the_socket_limit(worker: RawWorker) -> None:
    """Once libzmq dropped the link on such a frame and the worker never reconnected; now its
    socket takes the frame and the codec refuses it unread (BAD_MESSAGE, task '-')."""
    limit_bytes = DEFAULT_MAX_FRAME_BYTES  # what the worker runs with
    worker.send(
        b"\xc6"
        + (limit_bytes + SOCKET_FRAME_SLACK_BYTES).to_bytes(4, "big")
        + bytes(limit_bytes + SOCKET_FRAME_SLACK_BYTES)
    )
    refusal = worker.next_message(timeout_s=60.0)
    assert isinstance(refusal, Nack) and refusal.reason is NackReason.BAD_MESSAGE and refusal.task_id == "-"
    assert "over the limit" in refusal.detail
    reply = worker.request(encode(Status(task_id="after-drop", epoch=0)), timeout_s=30.0)
    assert isinstance(reply, Ack) and reply.task_id == "after-drop"


def test_engine_refuses_a_request_over_max_frame_bytes_at_once() -> None:
    limit_bytes = 64 << 10  # StageSpec's smallest limit: the test stays cheap
    spec = StageSpec(
        "big",
        runner_args=SMALL,
        backend="portable",
        max_frame_bytes=limit_bytes,
        request_timeout_s=3.0,
        deadline_s=10.0,
    )
    with Engine([spec]) as engine:
        for blob_bytes in (limit_bytes + 4096, limit_bytes + SOCKET_FRAME_SLACK_BYTES + 4096):
            started = time.monotonic()
            with pytest.raises((InvalidArgumentError, RequestRejectedError)):
                engine.execute("big", {"seed": 1, "batch": 1, "blob": bytes(blob_bytes)})
            assert time.monotonic() - started < 1.5, "refused only at the deadline"
            assert engine.status()["big"]["state"] == "RUNNING"


def test_codec_refuses_oversize_frames_as_bad_message() -> None:
    """Not a bug: the codec's side of finding 2 (the refusal has no task_id to give)."""
    with pytest.raises(ProtocolError) as info:
        decode(bytes(100), max_frame_bytes=99)
    assert info.value.reason is NackReason.BAD_MESSAGE and info.value.task_id is None
