"""The envelope of a frame too deep for msgspec names the same task at any stack depth."""

from __future__ import annotations

import msgspec
import pytest

from omni_core.protocol import ProtocolError, decode_command
from omni_core.protocol.envelope_scan import MAX_SCAN_ITEMS, nests_deeper_than, scan_envelope


def deep_execute(depth: int) -> bytes:
    """An Execute whose payload is `depth` one-item arrays, written byte by byte (msgspec's
    own encoder, like its decoder, gives up at some depth of the caller's stack)."""
    head = msgspec.msgpack.encode({"type": "Execute", "v": 1, "task_id": "deep-1", "epoch": 2})
    return b"\x85" + head[1:] + msgspec.msgpack.encode("payload") + b"\x91" * depth + b"\x00"


def refusal_at_stack_depth(frame: bytes, frames_below: int) -> ProtocolError:
    if frames_below:
        return refusal_at_stack_depth(frame, frames_below - 1)
    with pytest.raises(ProtocolError) as info:
        decode_command(frame)
    return info.value


@pytest.mark.parametrize("depth", [200, 987, 5000])
def test_a_deep_frame_names_its_task_at_any_stack_depth(depth):
    frame = deep_execute(depth)
    for below in (0, 100, 400):
        error = refusal_at_stack_depth(frame, below)
        assert (error.task_id, error.epoch) == ("deep-1", 2), (below, str(error))


@pytest.mark.parametrize("depth", [300, 500, 740, 986])
def test_a_deep_frame_broken_behind_its_depth_names_its_task_at_any_stack_depth(depth):
    """The schema fuzzer's kind of frame (its exact bytes: tests/fuzz/test_regressions.py): a
    message whose payload is 986 one-key maps, then a reserved byte. From the oracle's shallow
    stack msgspec reached the byte (malformed: no task named), from the worker's deeper one it
    ran out of stack first (the scanner named the task): the worker's NACK named a task the
    oracle did not expect. Which depth straddles two stacks depends on the stacks: several."""
    head = msgspec.msgpack.encode({"type": "Execute", "v": 1, "task_id": "deep-2", "epoch": 2})
    frame = b"\x85" + head[1:] + msgspec.msgpack.encode("payload") + b"\x81\xa1k" * depth + b"\xc1"
    for below in (0, 100, 400):
        error = refusal_at_stack_depth(frame, below)
        assert (error.task_id, error.epoch) == ("deep-2", 2), (below, str(error))
    shallow = frame.replace(b"\x81\xa1k" * depth, b"\x81\xa1k" * 10)  # msgspec's verdict stands: broken
    for below in (0, 400):
        assert refusal_at_stack_depth(shallow, below).task_id is None


def test_the_depth_probe_counts_levels_and_stays_in_its_budget():
    assert nests_deeper_than(msgspec.msgpack.encode({"a": [[1]]}), 2)
    assert not nests_deeper_than(msgspec.msgpack.encode({"a": [[1]]}), 3)
    assert not nests_deeper_than(msgspec.msgpack.encode([{}, [], b"x" * 500, 1.5]), 2)
    assert not nests_deeper_than(b"\x91" * 10, 20) and nests_deeper_than(b"\x91" * 10, 5)  # truncated
    late = msgspec.msgpack.encode([[0] * MAX_SCAN_ITEMS, [[[[0]]]]])
    assert not nests_deeper_than(late, 3)  # out of its budget: not known to be deep


def test_the_scanner_reads_every_msgpack_kind_before_the_envelope_and_skips_them():
    skipped = [
        b"\x00" * 300,
        1.5,
        -(2**63),
        2**64 - 1,
        "é" * 40,
        None,
        True,
        {"k": [1, {"x": b"y"}]},
        msgspec.msgpack.Ext(5, b"abc"),
        msgspec.msgpack.Ext(1, b"a"),
        list(range(70000)),
    ]
    frame = msgspec.msgpack.encode({"payload": skipped, "type": "Sleep", "v": 1, "task_id": "t", "epoch": 9})
    assert scan_envelope(frame) == {"type": "Sleep", "v": 1, "task_id": "t", "epoch": 9}


HOSTILE = [
    b"",
    b"\x91",
    b"\xc1",
    b"\xdf\xff\xff\xff\xff",
    b"\x81\xa7task_id\xdb\xff\xff\xff\xff",
    msgspec.msgpack.encode([1, 2]),
    msgspec.msgpack.encode("str"),
]


@pytest.mark.parametrize("frame", HOSTILE)
def test_hostile_bytes_give_an_empty_envelope_never_a_raise(frame):
    assert scan_envelope(frame) == {}


def test_the_scan_gives_up_after_its_item_budget():
    frame = msgspec.msgpack.encode({"payload": [0] * (MAX_SCAN_ITEMS + 5), "task_id": "late"})
    assert scan_envelope(frame) == {}
    frame = msgspec.msgpack.encode({"task_id": "early", "payload": [0] * (MAX_SCAN_ITEMS + 5)})
    assert scan_envelope(frame) == {"task_id": "early"}
