"""A hand-written msgpack writer that can say things msgspec refuses to write.

msgspec's encoder only produces well-formed msgpack of valid Python values, so a fuzzer
built on it never sends invalid UTF-8, a header whose length lies, a non-canonical integer
width or a reserved byte. Here a value is a plain Python object (encoded canonically) or one
of the node classes below, each of which controls its exact bytes. No IO, no randomness:
the generator in `omni_testing.fuzz.generate` decides what to build.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import msgspec

# msgpack's integer range: int64 min .. uint64 max.
INT_MIN = -(2**63)
UINT_MAX = 2**64 - 1

# Width names for `Int`: which header carries the value (non-canonical widths decode to the
# same number and must be accepted; they exercise the decoder's other paths).
INT_WIDTHS = ("fix", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64")
_INT_FORMATS = {
    "u8": (0xCC, ">B"),
    "u16": (0xCD, ">H"),
    "u32": (0xCE, ">I"),
    "u64": (0xCF, ">Q"),
    "i8": (0xD0, ">b"),
    "i16": (0xD1, ">h"),
    "i32": (0xD2, ">i"),
    "i64": (0xD3, ">q"),
}
# Header bytes for str/bin/array/map by width; "fix" only where the length fits.
LENGTH_WIDTHS = ("fix", "8", "16", "32")


class _NodeInside(Exception):
    """A plain container holds a node: msgspec cannot write it, the Python writer must."""


def _refuse(obj: Any) -> Any:
    raise _NodeInside


# Plain values are written by msgspec (C, canonical, the same bytes this writer would make);
# the nodes below are not dataclasses on purpose, so msgspec refuses them instead of
# writing them as maps.
_plain_encoder = msgspec.msgpack.Encoder(enc_hook=_refuse)


class _Node:
    __slots__ = ()

    def _fields(self) -> tuple[str, ...]:
        return tuple(name for cls in type(self).__mro__ for name in getattr(cls, "__slots__", ()))

    def _key(self) -> tuple:
        return tuple(getattr(self, name) for name in self._fields())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._key() == self._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._fields())
        return f"{type(self).__name__}({fields})"


class Raw(_Node):
    """Bytes spliced in as they are (random bytes, reserved 0xc1, a truncated value)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data


class Int(_Node):
    """An integer in a chosen header (`width` from INT_WIDTHS); None: the canonical one.
    A value that does not fit the width is masked into it (the bytes then lie)."""

    __slots__ = ("value", "width")

    def __init__(self, value: int, width: str | None = None) -> None:
        self.value = value
        self.width = width


class Float(_Node):
    __slots__ = ("single", "value")

    def __init__(self, value: float, single: bool = False) -> None:
        self.value = value
        self.single = single


class _Sized(_Node):
    """A body of any bytes behind a length header. `claimed_len`: the length the header
    states, when it should differ from the body's; `width`: header from LENGTH_WIDTHS."""

    __slots__ = ("claimed_len", "data", "width")

    def __init__(self, data: bytes, claimed_len: int | None = None, width: str | None = None) -> None:
        self.data = data
        self.claimed_len = claimed_len
        self.width = width


class Str(_Sized):
    """A str whose body is any bytes, invalid UTF-8 included."""

    __slots__ = ()


class Bin(_Sized):
    __slots__ = ()


class Arr(_Node):
    __slots__ = ("claimed_len", "items", "width")

    def __init__(self, items: tuple[Any, ...], claimed_len: int | None = None, width: str | None = None) -> None:
        self.items = items
        self.claimed_len = claimed_len
        self.width = width


class Map(_Node):
    """Key/value pairs in order: duplicate keys and non-str keys are allowed on purpose."""

    __slots__ = ("claimed_len", "pairs", "width")

    def __init__(
        self, pairs: tuple[tuple[Any, Any], ...], claimed_len: int | None = None, width: str | None = None
    ) -> None:
        self.pairs = pairs
        self.claimed_len = claimed_len
        self.width = width


class Ext(_Node):
    __slots__ = ("claimed_len", "code", "data")

    def __init__(self, code: int, data: bytes, claimed_len: int | None = None) -> None:
        self.code = code
        self.data = data
        self.claimed_len = claimed_len


class Deep(_Node):
    """`depth` nested one-element arrays (or maps) around `leaf`, written without recursion
    so a depth of 10**5 costs nothing here."""

    __slots__ = ("as_map", "depth", "leaf")

    def __init__(self, depth: int, leaf: Any = None, as_map: bool = False) -> None:
        self.depth = depth
        self.leaf = leaf
        self.as_map = as_map


def pack(value: Any) -> bytes:
    out = bytearray()
    _write(out, value)
    return bytes(out)


def _write(out: bytearray, value: Any) -> None:
    if not isinstance(value, _Node):
        try:
            out += _plain_encoder.encode(value)
            return
        except (_NodeInside, OverflowError, UnicodeEncodeError, TypeError):
            pass  # a node inside, a lone surrogate, an int beyond msgpack: written below
    if value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif isinstance(value, int):
        _write_int(out, value, None)
    elif isinstance(value, float):
        out += b"\xcb" + struct.pack(">d", value)
    elif isinstance(value, str):
        _write_str(out, value.encode("utf-8", "surrogatepass"), None, None)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        _write_len(out, bytes(value), None, None, _BIN)
    elif isinstance(value, (list, tuple)):
        _write_header(out, len(value), None, _ARRAY)
        for item in value:
            _write(out, item)
    elif isinstance(value, dict):
        _write_header(out, len(value), None, _MAP)
        for key, item in value.items():
            _write(out, key)
            _write(out, item)
    else:
        _write_node(out, value)


def _write_node(out: bytearray, node: Any) -> None:
    if isinstance(node, Raw):
        out += node.data
    elif isinstance(node, Int):
        _write_int(out, node.value, node.width)
    elif isinstance(node, Float):
        if node.single:
            out += b"\xca" + _pack_f32(node.value)
        else:
            out += b"\xcb" + struct.pack(">d", node.value)
    elif isinstance(node, Str):
        _write_str(out, node.data, node.claimed_len, node.width)
    elif isinstance(node, Bin):
        _write_len(out, node.data, node.claimed_len, node.width, _BIN)
    elif isinstance(node, Arr):
        claimed = len(node.items) if node.claimed_len is None else node.claimed_len
        _write_header(out, claimed, node.width, _ARRAY)
        for item in node.items:
            _write(out, item)
    elif isinstance(node, Map):
        claimed = len(node.pairs) if node.claimed_len is None else node.claimed_len
        _write_header(out, claimed, node.width, _MAP)
        for key, item in node.pairs:
            _write(out, key)
            _write(out, item)
    elif isinstance(node, Ext):
        _write_ext(out, node)
    elif isinstance(node, Deep):
        out += (b"\x81\xa1k" if node.as_map else b"\x91") * node.depth
        _write(out, node.leaf)
    else:
        raise TypeError(f"cannot pack {type(node).__name__}: use plain values or the node classes")


def _pack_f32(value: float) -> bytes:
    try:
        return struct.pack(">f", value)
    except OverflowError:  # a finite float64 beyond float32's range becomes infinity
        return struct.pack(">f", math.copysign(math.inf, value))


def _write_int(out: bytearray, value: int, width: str | None) -> None:
    if width is None:
        width = _canonical_int_width(value)
    if width == "fix":
        # positive fixint 0..127 or negative fixint -32..-1; masked into 7/5 bits otherwise
        out.append(value & 0x7F if value >= 0 else 0xE0 | (value & 0x1F))
        return
    header, fmt = _INT_FORMATS[width]
    bits = struct.calcsize(fmt) * 8
    masked = value & ((1 << bits) - 1)
    if fmt[1].islower() and masked >= 1 << (bits - 1):
        masked -= 1 << bits
    out.append(header)
    out += struct.pack(fmt, masked)


def _canonical_int_width(value: int) -> str:
    if -32 <= value <= 127:
        return "fix"
    if value > 0:
        for width, limit in (("u8", 0xFF), ("u16", 0xFFFF), ("u32", 0xFFFFFFFF)):
            if value <= limit:
                return width
        return "u64"
    for width, limit in (("i8", -(2**7)), ("i16", -(2**15)), ("i32", -(2**31))):
        if value >= limit:
            return width
    return "i64"


# Header tables: (fix base, fix limit, 8-bit header, 16-bit header, 32-bit header)
_STR = (0xA0, 31, 0xD9, 0xDA, 0xDB)
_BIN = (None, 0, 0xC4, 0xC5, 0xC6)
_ARRAY = (0x90, 15, None, 0xDC, 0xDD)
_MAP = (0x80, 15, None, 0xDE, 0xDF)


def _write_str(out: bytearray, data: bytes, claimed_len: int | None, width: str | None) -> None:
    _write_len(out, data, claimed_len, width, _STR)


def _write_len(out: bytearray, data: bytes, claimed_len: int | None, width: str | None, table: tuple) -> None:
    _write_header(out, len(data) if claimed_len is None else claimed_len, width, table)
    out += data


def _write_header(out: bytearray, length: int, width: str | None, table: tuple) -> None:
    fix_base, fix_limit, h8, h16, h32 = table
    if width is None:  # canonical: the smallest header that holds the length
        if fix_base is not None and 0 <= length <= fix_limit:
            width = "fix"
        elif h8 is not None and 0 <= length <= 0xFF:
            width = "8"
        elif 0 <= length <= 0xFFFF:
            width = "16"
        else:
            width = "32"
    # A width the type lacks (str8 for arrays) falls back to the next wider one.
    if width == "fix" and fix_base is None:
        width = "8"
    if width == "8" and h8 is None:
        width = "16"
    if width == "fix":
        out.append(fix_base | (length & fix_limit))
    elif width == "8":
        out += bytes((h8, length & 0xFF))
    elif width == "16":
        out.append(h16)
        out += struct.pack(">H", length & 0xFFFF)
    else:
        out.append(h32)
        out += struct.pack(">I", length & 0xFFFFFFFF)


_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}


def _write_ext(out: bytearray, node: Ext) -> None:
    length = len(node.data) if node.claimed_len is None else node.claimed_len
    code = struct.pack(">b", ((node.code + 128) % 256) - 128)
    if node.claimed_len is None and length in _FIXEXT:
        out.append(_FIXEXT[length])
    elif 0 <= length <= 0xFF:
        out += bytes((0xC7, length))
    elif 0 <= length <= 0xFFFF:
        out.append(0xC8)
        out += struct.pack(">H", length)
    else:
        out.append(0xC9)
        out += struct.pack(">I", length & 0xFFFFFFFF)
    out += code + node.data
