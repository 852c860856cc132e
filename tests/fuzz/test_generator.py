"""The fuzzer's own parts, in-process and fast: the msgpack writer, the generator's coverage
and determinism, and the codec's contract over many generated frames."""

from __future__ import annotations

import collections
import math

import msgspec
import pytest

from omni_core.protocol import (
    MESSAGE_TYPES,
    NackReason,
    ProtocolError,
    Status,
    decode,
    decode_command,
    encode,
)
from omni_testing.fuzz.generate import (
    MUTATION_NAMES,
    FrameGenerator,
    FuzzContext,
    GeneratorConfig,
    _pairs,
    _pairs_map,
)
from omni_testing.fuzz.msgpack_writer import INT_WIDTHS, Arr, Bin, Deep, Ext, Float, Int, Map, Raw, Str, pack

CTX = FuzzContext(epoch=3, stage="fz", ranks=2, pids=(101, 102), task_ids=("req-fz-1", "fz-sleep-1"))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        1,
        -1,
        127,
        128,
        -32,
        -33,
        255,
        256,
        65536,
        -129,
        2**32,
        2**63,
        2**64 - 1,
        -(2**63),
        0.5,
        math.inf,
        "",
        "a" * 31,
        "a" * 32,
        "\u00e9t\u00e9",
        "x" * 70_000,
        b"",
        b"\x00" * 300,
        [],
        [1, [2, [3]]],
        list(range(16)),
        {"a": 1},
        {str(i): i for i in range(16)},
    ],
)
def test_plain_values_are_written_as_msgspec_writes_them(value: object) -> None:
    assert pack(value) == msgspec.msgpack.encode(value)


@pytest.mark.parametrize("kind", MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_valid_messages_of_every_type_are_written_byte_for_byte(kind: type) -> None:
    generator = FrameGenerator(1)
    for _ in range(20):
        message = generator.valid_message(CTX, kind)
        assert pack(_pairs_map(_pairs(message))) == encode(message)
        assert encode(decode(encode(message))) == encode(message)  # bytes: a NaN in a payload != itself


def test_nodes_write_what_msgspec_refuses() -> None:
    assert pack(Str(b"\xff")) == b"\xa1\xff"
    assert pack(Str(b"ab", claimed_len=5)) == b"\xa5ab"
    assert pack(Str(b"ab", width="32")) == b"\xdb\x00\x00\x00\x02ab"
    assert pack(Bin(b"", claimed_len=2**32 - 1)) == b"\xc6\xff\xff\xff\xff"
    assert pack(Arr((1,), claimed_len=3)) == b"\x93\x01"
    assert pack(Map(((1, 2), (1, 3)))) == b"\x82\x01\x02\x01\x03"  # duplicate, non-str keys
    assert pack(Int(1, "u64")) == b"\xcf" + (1).to_bytes(8, "big")
    assert pack(Int(-1, "i8")) == b"\xd0\xff"
    assert pack(Float(math.nan, single=True))[:1] == b"\xca"
    assert pack(Ext(-1, b"\x00" * 4)) == b"\xd6\xff\x00\x00\x00\x00"
    assert pack(Deep(3)) == b"\x91\x91\x91\xc0"
    assert pack(Raw(b"\xc1")) == b"\xc1"
    for width in INT_WIDTHS:  # every width of a value that fits reads back as that value
        value = 5
        assert msgspec.msgpack.decode(pack(Int(value, width))) == value


def test_what_the_nodes_write_is_refused_by_the_codec_with_a_protocol_error() -> None:
    status = _pairs(Status(task_id="s-1", epoch=0))
    cases = {
        "bad utf-8 in a value": [[k, Str(b"s-\xff") if k == "task_id" else v] for k, v in status],
        "bad utf-8 in a key": [[Str(b"task_\xffid") if k == "task_id" else k, v] for k, v in status],
        "negative epoch": [[k, Int(-1) if k == "epoch" else v] for k, v in status],
    }
    for what, pairs in cases.items():
        with pytest.raises(ProtocolError) as info:
            decode(pack(_pairs_map(pairs)))
        assert info.value.reason is NackReason.BAD_MESSAGE, what
    with pytest.raises(ProtocolError):
        decode(pack(Deep(100_000)))
    with pytest.raises(ProtocolError):
        decode(pack(Map(tuple(_pairs_map(status).pairs), claimed_len=2**32 - 1)))


def test_same_seed_same_frames_other_seed_other_frames() -> None:
    first = [FrameGenerator(7).next(CTX) for _ in range(1)]
    a, b, c = FrameGenerator(7), FrameGenerator(7), FrameGenerator(8)
    frames_a = [a.next(CTX) for _ in range(3000)]
    assert frames_a == [b.next(CTX) for _ in range(3000)]
    assert frames_a != [c.next(CTX) for _ in range(3000)]
    assert frames_a[0] == first[0]


def test_the_mix_covers_every_strategy_type_and_mutation() -> None:
    generator = FrameGenerator(3, GeneratorConfig(direction="worker"))
    kinds: collections.Counter[str] = collections.Counter()
    types: collections.Counter[str] = collections.Counter()
    mutations: collections.Counter[str] = collections.Counter()
    for index in range(6000):
        frame = generator.next(CTX)
        if index % 10 == 0:  # real traffic to replay and reorder
            generator.remember_valid(encode(Status(task_id=f"p-{index}", epoch=3)))
        kinds[frame.kind] += 1
        if frame.kind == "mutated":
            types[frame.mutations[0]] += 1
            mutations.update(frame.mutations[1:])
    assert set(kinds) >= {
        "mutated",
        "valid",
        "replay",
        "reorder",
        "random_value",
        "raw_bytes",
        "multipart",
        "deep",
        "lying_header",
    }
    assert set(types) == {t.__name__ for t in MESSAGE_TYPES}
    assert set(MUTATION_NAMES) <= set(mutations)


def test_big_frames_are_exactly_at_and_around_the_limit() -> None:
    generator = FrameGenerator(5)
    ctx = FuzzContext(max_frame_bytes=1 << 16)
    sizes = {len(generator._big(ctx).payload) for _ in range(60)}
    assert {(1 << 16) - 1, 1 << 16, (1 << 16) + 1} <= sizes


def test_the_codec_raises_only_protocol_errors_on_generated_frames() -> None:
    """P-10 over the generator's whole mix, in-process (the processes get the same frames)."""
    reasons: collections.Counter[str] = collections.Counter()
    for direction, seed in (("worker", 11), ("engine", 12)):
        generator = FrameGenerator(seed, GeneratorConfig(direction=direction))
        for _ in range(10_000):
            frame = generator.next(CTX)
            for decoder in (decode, decode_command):
                try:
                    message = decoder(frame.payload)
                except ProtocolError as err:
                    reasons[err.reason.value] += 1
                    assert err.task_id is None or 0 < len(err.task_id) <= 128
                    assert err.epoch is None or 0 <= err.epoch < 2**64
                else:  # what decodes re-encodes stably
                    assert encode(decode(encode(message))) == encode(message)
    assert reasons["BAD_MESSAGE"] > 0 and reasons["UNSUPPORTED_VERSION"] > 0
