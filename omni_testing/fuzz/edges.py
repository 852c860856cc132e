"""The edge values the frame generator draws from: integers and floats at the limits of
their msgpack widths, bytes that are not UTF-8, task ids, tags and reload sources just
inside and just outside what a receiver must accept, and the names a message may carry."""

from __future__ import annotations

import math
import string
from typing import Any

import msgspec

from omni_core.protocol import MESSAGE_TYPES
from omni_core.protocol.messages import MAX_TAGS, MAX_TASK_ID_CHARS

INT_EDGES: tuple[int, ...] = (
    0,
    1,
    -1,
    2,
    127,
    128,
    -32,
    -33,
    255,
    256,
    -128,
    -129,
    65535,
    65536,
    -32768,
    -32769,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**32 - 1,
    2**32,
    2**53 + 1,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**63),
)
FLOAT_EDGES: tuple[float, ...] = (
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    -0.0,
    0.0,
    5e-324,
    1.7976931348623157e308,
    -1.0,
    1e-300,
    3.4e38,
)
# Byte sequences that are not UTF-8: lone continuation bytes, truncated sequences,
# overlong forms, UTF-16 surrogates, code points above U+10FFFF, bytes never valid.
BAD_UTF8: tuple[bytes, ...] = (
    b"\xff",
    b"\xfe",
    b"\x80",
    b"\xbf",
    b"\xc3\x28",
    b"\xa0\xa1",
    b"\xe2\x28\xa1",
    b"\xe2\x82",
    b"\xf0\x28\x8c\xbc",
    b"\xf0\x90\x28\xbc",
    b"\xf8\xa1\xa1\xa1\xa1",
    b"\xfc\xa1\xa1\xa1\xa1\xa1",
    b"\xed\xa0\x80",
    b"\xed\xbf\xbf",
    b"\xc0\xaf",
    b"\xc0\x80",
    b"\xe0\x80\xaf",
    b"\xf4\x90\x80\x80",
    b"\xf0",
)
TASK_ID_EDGES: tuple[str, ...] = (
    "",
    "x" * MAX_TASK_ID_CHARS,
    "x" * (MAX_TASK_ID_CHARS + 1),
    "\u00e9" * MAX_TASK_ID_CHARS,
    "\U0001f600" * MAX_TASK_ID_CHARS,
    "\x00",
    "-",
    "hello",
    "?",
    " ",
    "a\nb",
    "\ud7ff",
    "x" * 100_000,
)
TAG_EDGES: tuple[Any, ...] = (
    (),
    ("weights",) * (MAX_TAGS + 1),
    ("weights", "weights"),
    ("nope",),
    ("",),
    ("a" * 64,),
    ("a" * 65,),
    ("wei ghts",),
    ("weights\x00",),
    ("WEIGHTS",),
    ("../etc",),
    (("weights",),),
    ("kv_cache", 7),
    "weights",
)
# Reload sources: a runner must serve or refuse each (INVALID_ARGUMENT), never fail on one.
# Digits str.isdigit() accepts but int() does not (superscripts), other scripts' digits,
# more digits than int() converts, doubled signs.
SOURCE_EDGES: tuple[Any, ...] = (
    None,
    "seed:7",
    "seed:-3",
    "seed:",
    "seed:99999999999999999999999",
    "",
    "/ckpt/step-1",
    "seed:" + "9" * 5000,
    "x" * 70_000,
    "seed:\u00b2",
    "seed:\u0663",
    "seed:--5",
    "seed: 5",
    "seed:5\x00",
)

ALNUM = string.ascii_letters + string.digits + "_.-"
TYPE_TAGS: tuple[str, ...] = tuple(t.__name__ for t in MESSAGE_TYPES)
FIELD_NAMES: tuple[str, ...] = tuple(sorted({f.name for t in MESSAGE_TYPES for f in msgspec.structs.fields(t)}))
