"""The field mutations of the frame generator: each takes a valid message as its [key, value]
pairs and damages one field (a value at an edge, bytes that are not UTF-8, a key too many or
missing, another type tag or version), so the receiver decodes a frame that is almost right."""

from __future__ import annotations

import random
from typing import Any, Protocol

from omni_core.protocol import PROTOCOL_VERSION
from omni_testing.fuzz.edges import FLOAT_EDGES, INT_EDGES, SOURCE_EDGES, TAG_EDGES, TASK_ID_EDGES, TYPE_TAGS
from omni_testing.fuzz.msgpack_writer import INT_WIDTHS, Arr, Ext, Float, Int, Str


class FrameGenerator(Protocol):
    """What a mutation draws with: the generator's stream and its values (generate.py)."""

    rng: random.Random

    def random_value(self, depth: int) -> Any: ...

    def random_key(self) -> Any: ...

    def bad_utf8(self, text: str) -> bytes: ...


class FuzzContext(Protocol):
    """What a mutation knows of the target (generate.py's FuzzContext)."""

    epoch: int


# Each mutation changes the pairs (mutable, in wire order) in place; pair 0 is the type tag.


def _m_bad_utf8_value(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    paths = _str_paths(pairs)
    if not paths:
        return
    path = paths[gen.rng.randrange(len(paths))]
    _replace_at(pairs, path, lambda s: Str(gen.bad_utf8(s)))


def _m_bad_utf8_key(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    index = gen.rng.randrange(len(pairs))
    pairs[index][0] = Str(gen.bad_utf8(str(pairs[index][0])))


def _m_int_edge(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    ints = [i for i, (_, v) in enumerate(pairs) if isinstance(v, int) and not isinstance(v, bool)]
    index = rng.choice(ints) if ints and rng.random() < 0.8 else rng.randrange(len(pairs))
    pairs[index][1] = Int(rng.choice(INT_EDGES), rng.choice((None, None, *INT_WIDTHS)))


def _m_epoch(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    choice = rng.choice((ctx.epoch - 1, ctx.epoch + 1, ctx.epoch + 64, ctx.epoch + 65, 0, -1, 2**63, 2**64 - 1))
    set_field(pairs, "epoch", choice if choice >= -(2**63) else -1)


def _m_enum_unknown(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    key = rng.choice(("state", "status", "reason", "command", "level", "capabilities", "type"))
    value = rng.choice(("", "active", "ACTIVE ", "SLEEPING\x00", "UNKNOWN", 0, 3, -1, None, ["ACTIVE"], "level2x"))
    set_field(pairs, key, value)


def _m_extra_field(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    pairs.insert(gen.rng.randrange(1, len(pairs) + 1), [gen.random_key(), gen.random_value(2)])


def _m_duplicate_key(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    key, value = pairs[rng.randrange(len(pairs))]
    pairs.insert(rng.randrange(len(pairs) + 1), [key, value if rng.random() < 0.5 else gen.random_value(1)])


def _m_wrong_type(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    pairs[gen.rng.randrange(len(pairs))][1] = gen.random_value(2)


def _m_retag(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    tag = rng.choice(
        (*TYPE_TAGS, "sleep", "Message", "Command", "Reply", "MemoryReport", "", 7, None, Str(b"Sl\xffeep"), ["Sleep"])
    )
    pairs[0][1] = tag
    if rng.random() < 0.2:  # the tag somewhere else than first
        pairs.append(pairs.pop(0))


def _m_version(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    value = rng.choice((PROTOCOL_VERSION + 1, PROTOCOL_VERSION - 1, 0, -1, 2, 99, 2**64 - 1, "1", 1.0, None, True))
    set_field(pairs, "v", value)


def _m_drop_field(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    if pairs:
        pairs.pop(gen.rng.randrange(len(pairs)))


def _m_noncanonical(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    """Same values in wider headers: must still decode to the same message."""
    rng = gen.rng
    for pair in pairs:
        value = pair[1]
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
            pair[1] = Int(value, rng.choice(("u32", "u64", "i64")))
        elif isinstance(value, str):
            pair[1] = Str(value.encode(), width=rng.choice(("16", "32")))
        elif isinstance(value, float):
            pair[1] = Float(value, single=value == 0.0)


def _m_float_edge(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    key = rng.choice(("duration_s", "payload", "output", "epoch", "level"))
    set_field(pairs, key, Float(rng.choice(FLOAT_EDGES), single=rng.random() < 0.3))


def _m_task_id_edge(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    set_field(pairs, "task_id", gen.rng.choice(TASK_ID_EDGES))


def _m_tags_edge(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    set_field(pairs, rng.choice(("tags", "tags", "asleep_tags", "capabilities")), rng.choice(TAG_EDGES))


def _m_source_edge(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    set_field(pairs, "source", gen.rng.choice(SOURCE_EDGES))


def _m_ext(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    # -1 with 4, 8 or 12 bytes is a valid timestamp; other lengths are not.
    node = Ext(rng.choice((-1, -1, 0, 5, 127, -128)), rng.randbytes(rng.choice((0, 1, 4, 8, 12, 16, 300))))
    if rng.random() < 0.5:
        set_field(pairs, "payload", node)
    else:
        pairs[rng.randrange(len(pairs))][1] = node


def _m_detail_edge(gen: FrameGenerator, pairs: list[list[Any]], ctx: FuzzContext) -> None:
    rng = gen.rng
    set_field(
        pairs,
        rng.choice(("detail", "proof", "stage", "device", "backend")),
        rng.choice(("x" * 4096, "x" * 4097, "\u00e9" * 4096, "y" * 129, "z" * 65, "")),
    )


# Drawn uniformly: a mutation listed twice comes twice as often.
FIELD_MUTATIONS = (
    _m_bad_utf8_value,
    _m_bad_utf8_value,
    _m_bad_utf8_key,
    _m_int_edge,
    _m_int_edge,
    _m_epoch,
    _m_epoch,
    _m_enum_unknown,
    _m_extra_field,
    _m_duplicate_key,
    _m_wrong_type,
    _m_wrong_type,
    _m_retag,
    _m_version,
    _m_drop_field,
    _m_drop_field,
    _m_noncanonical,
    _m_float_edge,
    _m_task_id_edge,
    _m_tags_edge,
    _m_source_edge,
    _m_ext,
    _m_detail_edge,
)
MUTATION_NAMES: tuple[str, ...] = tuple(sorted({m.__name__.removeprefix("_m_") for m in FIELD_MUTATIONS}))


def set_field(pairs: list[list[Any]], key: str, value: Any) -> None:
    """The first pair named `key` gets `value`; without one, the pair is added last."""
    for pair in pairs:
        if pair[0] == key:
            pair[1] = value
            return
    pairs.append([key, value])


def _str_paths(pairs: list[list[Any]]) -> list[tuple[int, ...]]:
    """Where the str leaves are: (pair index,) or (pair index, item index) inside tuples/lists."""
    paths: list[tuple[int, ...]] = []
    for i, (_, value) in enumerate(pairs):
        if isinstance(value, str):
            paths.append((i,))
        elif isinstance(value, (list, tuple)):
            paths.extend((i, j) for j, item in enumerate(value) if isinstance(item, str))
    return paths


def _replace_at(pairs: list[list[Any]], path: tuple[int, ...], make: Any) -> None:
    if len(path) == 1:
        pairs[path[0]][1] = make(pairs[path[0]][1])
        return
    items = list(pairs[path[0]][1])
    items[path[1]] = make(items[path[1]])
    pairs[path[0]][1] = Arr(tuple(items))
