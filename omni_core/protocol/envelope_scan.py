"""The envelope of a frame too deep for msgspec, read without recursion.

msgspec decodes nested containers recursively, so whether a deeply nested frame decodes at
all depends on how deep the caller's own stack already is: the same bytes decoded in a worker
(a shallow loop) and in a test's oracle (under pytest) could name their task in one process
and not in the other. This scanner reads the top-level map of a msgpack frame with an
explicit counter instead of recursion, keeps the scalar values of the envelope's keys and
skips everything else, so a refusal names the same task wherever it is decoded. Bounded:
it gives up after `MAX_SCAN_ITEMS` items (then nothing is known). Pure: no IO.
"""

from __future__ import annotations

import struct
from typing import Any

ENVELOPE_KEYS = frozenset({"type", "v", "task_id", "epoch"})
MAX_SCAN_ITEMS = 100_000
MAX_KEY_BYTES = 64


class _Truncated(Exception):
    pass


class _Reader:
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data, self.at = memoryview(data).cast("B"), 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.data):
            raise _Truncated
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def uint(self, n: int) -> int:
        return int.from_bytes(self.take(n), "big")

    def header(self) -> tuple[str, Any]:
        """(kind, value): kind "int"/"str"/"scalar"/"array"/"map"/"blob"; a blob's value is
        its length, a container's its item count, a str's its bytes, a scalar's itself."""
        b = self.uint(1)
        if b <= 0x7F or b >= 0xE0:
            return "int", b if b <= 0x7F else b - 0x100
        if 0x80 <= b <= 0x8F:
            return "map", b & 0x0F
        if 0x90 <= b <= 0x9F:
            return "array", b & 0x0F
        if 0xA0 <= b <= 0xBF:
            return "str", bytes(self.take(b & 0x1F))
        fixed = {0xC0: None, 0xC2: False, 0xC3: True}
        if b in fixed:
            return "scalar", fixed[b]
        if b in (0xC4, 0xC5, 0xC6):  # bin 8/16/32
            return "blob", self.uint(1 << (b - 0xC4))
        if b in (0xC7, 0xC8, 0xC9):  # ext 8/16/32: a type byte after the length
            return "blob", self.uint(1 << (b - 0xC7)) + 1
        if b in (0xCA, 0xCB):
            return "blob", 4 if b == 0xCA else 8
        if 0xCC <= b <= 0xCF:
            return "int", self.uint(1 << (b - 0xCC))
        if 0xD0 <= b <= 0xD3:
            n = 1 << (b - 0xD0)
            return "int", struct.unpack(">" + "bhiq"[b - 0xD0], self.take(n))[0]
        if 0xD4 <= b <= 0xD8:  # fixext 1/2/4/8/16 and its type byte
            return "blob", (1 << (b - 0xD4)) + 1
        if b in (0xD9, 0xDA, 0xDB):
            return "str", bytes(self.take(self.uint(1 << (b - 0xD9))))
        if b in (0xDC, 0xDD):
            return "array", self.uint(2 if b == 0xDC else 4)
        if b in (0xDE, 0xDF):
            return "map", self.uint(2 if b == 0xDE else 4)
        raise _Truncated  # 0xC1: never used


def scan_envelope(data: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The scalar values of `type`, `v`, `task_id` and `epoch` in a frame's top-level map, as
    far as they can be read within MAX_SCAN_ITEMS items; {} when the frame is not a map."""
    found: dict[str, Any] = {}
    reader = _Reader(data)
    budget = MAX_SCAN_ITEMS
    try:
        kind, pairs = reader.header()
        if kind != "map":
            return {}
        for _ in range(pairs):
            kind, key = reader.header()
            name = key.decode("utf-8", "replace") if kind == "str" and len(key) <= MAX_KEY_BYTES else None
            kind, value = reader.header()
            if name in ENVELOPE_KEYS and kind in ("int", "str", "scalar"):
                found[name] = value.decode("utf-8") if kind == "str" else value
            budget = _skip(reader, kind, value, budget)
            if found.keys() == ENVELOPE_KEYS:
                break
    except (_Truncated, UnicodeDecodeError, struct.error):
        pass
    return found


def _skip(reader: _Reader, kind: str, value: Any, budget: int) -> int:
    """Skip the rest of a value whose header was read: its nested items, iteratively."""
    pending = value * 2 if kind == "map" else value if kind == "array" else 0
    if kind == "blob":
        reader.take(value)
    while pending:
        budget -= 1
        if budget <= 0:
            raise _Truncated
        pending -= 1
        kind, value = reader.header()
        if kind == "blob":
            reader.take(value)
        elif kind == "map":
            pending += value * 2
        elif kind == "array":
            pending += value
    return budget


def nests_deeper_than(data: bytes | bytearray | memoryview, depth: int) -> bool:
    """Whether a map or array in the frame lies more than `depth` levels deep (the top-level
    map is level 1), as far as the frame can be read within MAX_SCAN_ITEMS items; False when
    it cannot be read that far. Iterative: one count of items left per open level."""
    reader = _Reader(data)
    left = [1]  # items still to read on each open level; the first is the frame's one value
    try:
        for _ in range(MAX_SCAN_ITEMS):
            while left and not left[-1]:
                left.pop()
            if not left:
                return False
            left[-1] -= 1
            kind, value = reader.header()
            if kind == "blob":
                reader.take(value)
            elif kind in ("map", "array"):
                if len(left) > depth:
                    return True
                left.append(value * 2 if kind == "map" else value)
    except (_Truncated, struct.error):
        pass
    return False
