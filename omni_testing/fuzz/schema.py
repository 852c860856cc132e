"""Frames derived from the wire schema, not from hand-chosen alphabets.

`SchemaFrameGenerator` walks every field of every message type in turn (round robin over
`msgspec.inspect.type_info` of each Struct, nested Structs such as MemoryReport included)
and replaces it with a hostile value chosen from the field's own type and constraints:

- str: any Unicode (every plane, controls, NUL, combining marks, bidi controls, lone
  surrogates written as bytes), invalid UTF-8, and lengths at and around each bound
  (min_length - 1, min_length, max_length, max_length + 1, in ASCII and in multi-byte text);
- int: each bound - 1, bound, bound + 1, 0, -1, msgpack's extremes, non-canonical widths;
- float: nan, +-inf, -0.0, subnormals, the largest finite, each bound and its neighbours;
- enums and literals: every member, members with a changed case or a NUL, unknown values;
- arrays, tuples and dicts: lengths at and around each bound, hostile items and keys;
- Any (a request payload, a result): nesting at and around MAX_PAYLOAD_DEPTH and far
  deeper, huge and negative integers, nan, bytes, extension types;
- every field: a value of each wrong type; every message: unknown and retagged type tags,
  unknown fields, missing required fields; then, sometimes, byte-level damage of the result.

The base of each frame is a valid message around the target's context (FuzzContext), so
the other fields get past the first check and the hostile one is what the target meets.
All randomness comes from the generator's one `random.Random(seed)`.
"""

from __future__ import annotations

import math
import random
from typing import Any

import msgspec
import msgspec.inspect as mi

from omni_core.protocol import MAX_PAYLOAD_DEPTH, MESSAGE_TYPES, Message
from omni_core.protocol.messages import COMMAND_TYPES, REPLY_TYPES
from omni_testing.fuzz.edges import INT_EDGES
from omni_testing.fuzz.generate import (
    DEFAULT_MIX,
    Frame,
    FrameGenerator,
    FuzzContext,
    GeneratorConfig,
    _pairs,
    _pairs_map,
)
from omni_testing.fuzz.msgpack_writer import (
    INT_WIDTHS,
    LENGTH_WIDTHS,
    UINT_MAX,
    Deep,
    Ext,
    Float,
    Int,
    Map,
    Raw,
    Str,
    pack,
)
from omni_testing.fuzz.mutations import set_field

# A str bound that the schema leaves open is probed up to here (the frame limit is the bound).
OPEN_STR_LENGTHS = (0, 1, 255, 256, 4096, 65_536)
OPEN_ARRAY_LENGTHS = (0, 1, 16, 17, 1000)
# Code points that break naive text handling: NUL and controls, DEL and C1 controls, BOM,
# bidi overrides, zero-width joiners, combining marks, the replacement character,
# non-characters, and astral-plane characters (two UTF-16 units).
HOSTILE_CHARS = (
    "\x00",
    "\x01",
    "\t",
    "\n",
    "\r",
    "\x1b",
    "\x7f",
    "\x85",
    "\x9f",
    "\u00a0",
    "\u00e9",
    "\u0301",
    "\u200b",
    "\u200d",
    "\u202e",
    "\u2028",
    "\ufeff",
    "\ufffd",
    "\uffff",
    "\U0001f600",
    "\U0010ffff",
    "\u0663",
    "\u00b2",
    "/",
    "..",
    "%",
    "{",
    "\\",
    "'",
    '"',
)
SURROGATES = ("\ud800", "\udbff", "\udc00", "\udfff")
# One value of each msgpack type: a field gets each type it does not declare.
WRONG_TYPES: tuple[Any, ...] = (
    None,
    True,
    False,
    0,
    -1,
    UINT_MAX,
    -(2**63),
    1.5,
    math.nan,
    "",
    "x",
    b"",
    b"\x00bin",
    [],
    [1, "a"],
    {},
    {"k": 1},
    Ext(1, b"x"),
    Ext(-1, b"\x00" * 12),
    Raw(b"\xc1"),
)
# Depths of a payload around the protocol's limit, and far beyond any stack.
DEPTHS = (MAX_PAYLOAD_DEPTH - 1, MAX_PAYLOAD_DEPTH, MAX_PAYLOAD_DEPTH + 1, 500, 986, 1000, 5000, 100_000)
SCHEMA_SHARE_DEFAULT = 0.5
# A schema frame stays under this (and under the frame limit): a frame over the socket's own
# limit makes libzmq drop the link (frames at and over the limit are the "big" strategy's).
SCHEMA_FRAME_BUDGET_BYTES = 1 << 20
MAX_DRAWS = 4  # hostile values drawn for one field before a frame over the budget gives way


def _fields(cls: type[msgspec.Struct]) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info.fields


class SchemaFrameGenerator(FrameGenerator):
    """FrameGenerator plus the strategy "schema" (see the module doc); `schema_share` of all
    frames come from it, the rest from the hand-built strategies as before."""

    def __init__(
        self, seed: int, config: GeneratorConfig | None = None, *, schema_share: float = SCHEMA_SHARE_DEFAULT
    ) -> None:
        config = config or GeneratorConfig()
        if schema_share > 0:
            # The hand-built strategies keep their relative weights; "schema" takes its share.
            others = {k: w for k, w in config.mix.items() if k != "schema"} if schema_share < 1 else {}
            weight = sum(others.values()) * schema_share / (1.0 - schema_share) if others else 1.0
            config = GeneratorConfig(
                direction=config.direction,
                big_frame_rate=config.big_frame_rate,
                socket_drop_frames=config.socket_drop_frames,
                mix={**others, "schema": weight},
                history_frames=config.history_frames,
            )
        super().__init__(seed, config)
        self._long_arrays_left = 1  # per frame (see _schema_frame)
        types = COMMAND_TYPES if config.direction == "worker" else REPLY_TYPES
        # Every field of every type, the direction's own types first and twice as often:
        # each gets its turn (round robin), so none is left to chance.
        order = [*types, *types, *(t for t in MESSAGE_TYPES if t not in types)]
        self.targets: list[tuple[type[Message], mi.Field]] = [(cls, f) for cls in order for f in _fields(cls)]
        self._turn = 0
        self.fields_hit: dict[str, int] = {}

    # ------------------------------------------------------------------ the strategy

    def _schema(self, ctx: FuzzContext) -> Frame:
        cls, field = self.targets[self._turn % len(self.targets)]
        self._turn += 1
        budget_bytes = min(ctx.max_frame_bytes, SCHEMA_FRAME_BUDGET_BYTES)
        for _ in range(MAX_DRAWS):
            frame = self._schema_frame(ctx, cls, field)
            if frame.size_bytes <= budget_bytes:
                return frame
        return Frame((pack_pairs(_pairs(self.valid_message(ctx, cls))),), "schema", (f"{cls.__name__}.valid",))

    def _schema_frame(self, ctx: FuzzContext, cls: type[Message], field: mi.Field) -> Frame:
        rng = self.rng
        # One long array per frame: nested bounds multiply (4,097 buckets of 16,385 tensors each
        # is 67 M items: the generator once took 23 GB for one frame of UpdateWeights).
        self._long_arrays_left = 1
        pairs = _pairs(self.valid_message(ctx, cls))
        names = [f"{cls.__name__}.{field.name}"]
        value, label = self.hostile(field.type, rng)
        set_field(pairs, field.encode_name, value)
        names.append(label)
        key = names[0]
        self.fields_hit[key] = self.fields_hit.get(key, 0) + 1
        for _ in range(int(rng.expovariate(2.0))):  # now and then more fields of the same message
            other = rng.choice(_fields(cls))
            other_value, other_label = self.hostile(other.type, rng)
            set_field(pairs, other.encode_name, other_value)
            names.append(f"{other.name}:{other_label}")
        roll = rng.random()
        if roll < 0.05:
            set_field(
                pairs,
                "type",
                rng.choice(
                    (
                        "Bogus",
                        "",
                        "ack",
                        "Sleep\x00",
                        "\u00c5ck",
                        cls.__name__ + "X",
                        rng.choice(MESSAGE_TYPES).__name__,
                        7,
                        None,
                    )
                ),
            )
            names.append("tag")
        elif roll < 0.08:
            pairs.append([rng.choice(("extra", "", "\x00", "type2", "V")), rng.choice(WRONG_TYPES)])
            names.append("unknown_field")
        elif roll < 0.11:
            required = [f for f in _fields(cls) if f.required]
            if required:
                gone = rng.choice(required).encode_name
                pairs = [p for p in pairs if p[0] != gone]
                names.append(f"missing_{gone}")
        data = pack_pairs(pairs)
        data, extra = self._byte_level(data)
        return Frame((data,), "schema", tuple(names + extra))

    # ------------------------------------------------------------------ values from types

    def hostile(self, t: Any, rng: random.Random, depth: int = 0) -> tuple[Any, str]:
        """A hostile value for type `t` (msgspec.inspect) and a short label naming its kind."""
        if rng.random() < 0.15:
            return rng.choice(WRONG_TYPES), "wrong_type"
        if isinstance(t, mi.UnionType):
            return self.hostile(rng.choice(t.types), rng, depth)
        if isinstance(t, mi.StrType):
            return self._str(t, rng)
        if isinstance(t, mi.BoolType):
            return rng.choice((True, False, 0, 1, "true")), "bool"
        if isinstance(t, mi.IntType):
            return self._int(t, rng)
        if isinstance(t, mi.FloatType):
            return self._float(t, rng)
        if isinstance(t, mi.LiteralType):
            pick = rng.choice(t.values)
            return rng.choice((pick, pick + 1 if isinstance(pick, int) else pick, 0, -1, str(pick), 3, True)), "literal"
        if isinstance(t, mi.EnumType):
            member = rng.choice(list(t.cls)).value
            return rng.choice(
                (member, member.lower(), member + "\x00", " " + member, "BOGUS", "", 0, member.replace("A", "\u0391"))
            ), "enum"
        if isinstance(t, mi.NoneType):
            return None, "none"
        if isinstance(t, (mi.VarTupleType, mi.ListType, mi.SetType, mi.FrozenSetType, mi.TupleType)):
            return self._array(t, rng, depth)
        if isinstance(t, mi.DictType):
            return self._dict(t, rng, depth)
        if isinstance(t, mi.StructType):
            return self._struct(t, rng, depth)
        if isinstance(t, mi.AnyType):
            return self._any(rng)
        return rng.choice(WRONG_TYPES), f"unhandled_{type(t).__name__}"

    def _length(self, low: int | None, high: int | None, open_lengths: tuple[int, ...], rng: random.Random) -> int:
        bounds = [n for b in (low, high) if b is not None for n in (b - 1, b, b + 1)]
        choices = [n for n in (*bounds, *open_lengths) if n >= 0]
        if high is not None:
            choices = [n for n in choices if n <= high + 1]
        return rng.choice(choices or [0])

    def _str(self, t: mi.StrType, rng: random.Random) -> tuple[Any, str]:
        length = self._length(t.min_length, t.max_length, OPEN_STR_LENGTHS, rng)
        kind = rng.randrange(6)
        if kind == 0:
            return "x" * length, f"str_len_{length}"
        if kind == 1:  # multi-byte: the bound is in characters, the frame in bytes
            char = rng.choice(("\u00e9", "\u20ac", "\U0001f600", "\U0010ffff"))
            return char * length, f"str_mb_len_{length}"
        if kind == 2:
            return "".join(rng.choice(HOSTILE_CHARS) for _ in range(min(length, 512))), "str_hostile"
        if kind == 3:  # any code point of any plane, surrogates excluded (next kind)
            planes = ((0x20, 0x800), (0x800, 0xD800), (0xE000, 0x110000))
            text = "".join(chr(rng.randrange(*rng.choice(planes))) for _ in range(min(length, 256)))
            return text, "str_unicode"
        if kind == 4:  # a lone surrogate: no valid UTF-8, written with surrogatepass
            text = "a" * max(0, min(length, 64) - 1) + rng.choice(SURROGATES)
            return Str(text.encode("utf-8", "surrogatepass")), "str_surrogate"
        bad = rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\x80", b"\xe2\x82"))
        return Str(b"a" * min(length, 64) + bad, width=rng.choice((None, *LENGTH_WIDTHS))), "str_bad_utf8"

    def _int(self, t: mi.IntType, rng: random.Random) -> tuple[Any, str]:
        bounds = [b for b in (t.ge, t.le, t.gt, t.lt) if b is not None]
        near = [b + d for b in bounds for d in (-1, 0, 1)]
        value = (
            rng.choice((*near, *INT_EDGES, 0, -1, -(2**63), UINT_MAX))
            if near
            else rng.choice((*INT_EDGES, 0, -1, -(2**63), UINT_MAX))
        )
        if rng.random() < 0.2 and -(2**63) <= value <= UINT_MAX:
            return Int(value, rng.choice(INT_WIDTHS)), "int_width"
        return value, "int_bound" if value in near else "int_edge"

    def _float(self, t: mi.FloatType, rng: random.Random) -> tuple[Any, str]:
        bounds = [b for b in (t.ge, t.le, t.gt, t.lt) if b is not None]
        near = [x for b in bounds for x in (math.nextafter(b, -math.inf), float(b), math.nextafter(b, math.inf))]
        value = rng.choice(
            (*near, math.nan, -math.nan, math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308, -1.0, 1e-300)
        )
        return Float(value, single=rng.random() < 0.2), "float_bound" if value in near else "float_edge"

    def _array(self, t: Any, rng: random.Random, depth: int) -> tuple[Any, str]:
        if isinstance(t, mi.TupleType):
            items = [self.hostile(item, rng, depth + 1)[0] for item in t.types]
            if rng.random() < 0.5:
                items = items[: rng.randrange(len(items) + 1)] + [None] * rng.randrange(2)
            return items, "tuple_shape"
        length = self._length(getattr(t, "min_length", None), getattr(t, "max_length", None), OPEN_ARRAY_LENGTHS, rng)
        if length > 64:
            if self._long_arrays_left <= 0:
                length = rng.choice((0, 1, 3))
            else:
                self._long_arrays_left -= 1
        if depth > 2 or length > 64:  # long arrays repeat one hostile item: the bound is what is probed
            item, _ = self.hostile(t.item_type, rng, depth + 1)
            return [item] * length, f"array_len_{length}"
        return [self.hostile(t.item_type, rng, depth + 1)[0] for _ in range(length)], f"array_len_{length}"

    def _dict(self, t: mi.DictType, rng: random.Random, depth: int) -> tuple[Any, str]:
        length = self._length(t.min_length, t.max_length, (0, 1, 3, 100), rng)
        pairs = []
        for _ in range(length):
            key = self.hostile(t.key_type, rng, depth + 1)[0] if rng.random() < 0.8 else rng.choice(WRONG_TYPES)
            pairs.append((key, self.hostile(t.value_type, rng, depth + 1)[0]))
        return Map(tuple(pairs)), f"dict_len_{length}"

    def _struct(self, t: mi.StructType, rng: random.Random, depth: int) -> tuple[Any, str]:
        pairs = []
        for f in t.fields:
            if f.required or rng.random() < 0.5:
                pairs.append((f.encode_name, self.hostile(f.type, rng, depth + 1)[0]))
        if rng.random() < 0.2 and pairs:
            pairs.pop(rng.randrange(len(pairs)))
        return Map(tuple(pairs)), f"struct_{t.cls.__name__}"

    def _any(self, rng: random.Random) -> tuple[Any, str]:
        kind = rng.randrange(5)
        if kind == 0:
            depth = rng.choice(DEPTHS)
            leaf = {"seed": 1, "batch": 1} if rng.random() < 0.5 else rng.choice(WRONG_TYPES)
            return Deep(depth, leaf=leaf, as_map=rng.random() < 0.3), f"any_depth_{depth}"
        if kind == 1:  # a usable request with a hostile value beside it
            value = rng.choice(WRONG_TYPES) if rng.random() < 0.5 else self.random_value(2)
            return {"seed": rng.randrange(100), "batch": 1, rng.choice(HOSTILE_CHARS): value}, "any_beside"
        if kind == 2:
            return {
                "seed": rng.choice((UINT_MAX, -(2**63), math.nan, "7", None, [])),
                "batch": rng.choice((0, -1, 1, UINT_MAX, 1.5, math.inf)),
            }, "any_request_fields"
        if kind == 3:
            return self.random_value(4), "any_random"
        return Deep(MAX_PAYLOAD_DEPTH - 2, leaf={"seed": 2, "batch": 1}), "any_depth_at_limit"


def pack_pairs(pairs: list[list[Any]]) -> bytes:
    return pack(_pairs_map(pairs))


def make_generator(seed: int, direction: str, schema_share: float = 0.0, **config: Any) -> FrameGenerator:
    """The generator a target uses: the hand-built strategies alone (`schema_share` 0), or
    with `schema_share` of the frames derived from the schema."""
    base = GeneratorConfig(direction=direction, mix=dict(DEFAULT_MIX), **config)
    if schema_share <= 0:
        return FrameGenerator(seed, base)
    return SchemaFrameGenerator(seed, base, schema_share=schema_share)
