"""A valid message of any type, drawn from its struct's own fields and bounds: the frames of a
command no hand-written generator knows yet (the hand-written ones in `generate` choose values
a rank finds interesting, such as prefixes it must refuse).

Each optional field keeps its default half the time; every other field gets a value its type
and bounds accept, and the result is checked by decoding it as the wire would."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import msgspec.inspect as mi

from omni_core.protocol import Message
from omni_core.protocol.messages import ADAPTER_NAME_PATTERN, ENVELOPE_FIELDS, IDENTIFIER_PATTERN, MODULE_NAME_PATTERN

_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"
_LETTERS = _ALPHABET[:26]
# Patterns every string of _ALPHABET matches: a tag's, an adapter's and a module's names (P-20);
# and an identifier's (a counter's, a connector's), whose first character is drawn from _LETTERS.
_PATTERNS_OF_THE_ALPHABET = frozenset(
    (r"^[A-Za-z0-9_.-]+$", ADAPTER_NAME_PATTERN, MODULE_NAME_PATTERN, IDENTIFIER_PATTERN)
)
_OPEN_INT = 1 << 16  # how far above its lower bound an int without an upper bound is drawn
_MAX_ITEMS = 3  # items drawn for an array or a dict without a tighter bound
_DRAWS = 32  # draws before giving up on a struct whose fields constrain each other


class NotDerivable(TypeError):
    """A required field of a type this module draws no value for."""


def derived_message(kind: type[Message], task_id: str, epoch: int, rng: random.Random) -> Message:
    """A valid `kind` with these envelope fields and every other field drawn from its type.
    A struct whose own check refuses a draw (fields that constrain each other) is drawn
    again, up to _DRAWS times."""
    for _ in range(_DRAWS):
        try:
            return msgspec.convert(_draw(kind, task_id, epoch, rng), kind)
        except msgspec.ValidationError as exc:
            refused = exc
    raise NotDerivable(
        f"{_DRAWS} draws of {kind.__name__} were all refused (last: {refused}); give it a hand-written "
        "generator in omni_testing/fuzz/generate.py"
    )


def _draw(kind: type[Message], task_id: str, epoch: int, rng: random.Random) -> dict[str, Any]:
    raw: dict[str, Any] = {"type": kind.__name__, "task_id": task_id, "epoch": epoch}
    for f in mi.type_info(kind).fields:  # type: ignore[union-attr]
        if f.name in ENVELOPE_FIELDS or (not f.required and rng.random() < 0.5):
            continue
        try:
            raw[f.encode_name] = _value(f.type, rng)
        except NotDerivable:
            if f.required:
                raise NotDerivable(
                    f"{kind.__name__}.{f.name} has a type ({f.type!r}) the derived generator draws no value "
                    "for; give the type a hand-written generator in omni_testing/fuzz/generate.py"
                ) from None
    return raw


def _value(t: Any, rng: random.Random) -> Any:
    match t:
        case mi.NoneType():
            return None
        case mi.BoolType():
            return rng.random() < 0.5
        case mi.IntType():
            low = t.ge if t.ge is not None else t.gt + 1 if t.gt is not None else 0
            high = t.le if t.le is not None else t.lt - 1 if t.lt is not None else low + _OPEN_INT
            return rng.randint(low, high)
        case mi.FloatType():
            low = t.ge if t.ge is not None else t.gt if t.gt is not None else 0.0
            high = t.le if t.le is not None else t.lt if t.lt is not None else low + _OPEN_INT
            value = rng.uniform(low, high)
            return value if t.gt is None or value > t.gt else high
        case mi.StrType() if t.pattern is None or t.pattern in _PATTERNS_OF_THE_ALPHABET:
            low = max(1, t.min_length or 0)
            high = max(low, min(t.max_length if t.max_length is not None else 16, 16))
            first = rng.choice(_LETTERS if t.pattern == IDENTIFIER_PATTERN else _ALPHABET)
            return first + "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(low, high) - 1))
        case mi.BytesType():
            low = t.min_length or 0
            high = max(low, min(t.max_length if t.max_length is not None else 16, 128))
            return rng.randbytes(rng.randint(low, high))
        case mi.LiteralType():
            return rng.choice(t.values)
        case mi.EnumType():
            return rng.choice(list(t.cls)).value
        case mi.UnionType():
            return _value(rng.choice(t.types), rng)
        case mi.VarTupleType() | mi.ListType():
            low = t.min_length or 0
            high = max(low, min(t.max_length if t.max_length is not None else _MAX_ITEMS, _MAX_ITEMS))
            return [_value(t.item_type, rng) for _ in range(rng.randint(low, high))]
        case mi.DictType():
            high = min(t.max_length if t.max_length is not None else _MAX_ITEMS, _MAX_ITEMS)
            return {_value(t.key_type, rng): _value(t.value_type, rng) for _ in range(rng.randint(0, high))}
        case mi.StructType():
            tag = {t.tag_field: t.tag} if t.tag_field is not None else {}
            return tag | {f.encode_name: _value(f.type, rng) for f in t.fields if f.required or rng.random() < 0.5}
        case mi.AnyType():
            return rng.choice((None, 0, "x", [1, 2]))
    raise NotDerivable(repr(t))
