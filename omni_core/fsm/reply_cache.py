"""Bounded cache of terminal replies, keyed by task_id (P-2).

A duplicate command is answered from here and has no second effect. Two bounds, both
enforced with least-recently-used eviction: a count of entries and a total of bytes (a
worker answering large Results must not grow without limit: six 100 MB Executes once took
a worker from 229 MB to 932 MB). A retry that arrives after its entry was evicted is
treated as new, so callers must retry within that window (the orchestrator keeps at most
one lifecycle task per stage in flight, far inside any sane bound).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_REPLY_CACHE_ENTRIES = 1024
# P-2: a worker holds at least this many answers whatever it is configured to (the conformance
# suite sends a copy of a task after this many newer ones).
MIN_REPLY_CACHE_ENTRIES = 64
DEFAULT_REPLY_CACHE_BYTES = 16 << 20


@dataclass
class CacheStats:
    hits: int = 0
    evictions: int = 0


class BoundedCache(Generic[K, V]):
    def __init__(
        self, max_entries: int = DEFAULT_REPLY_CACHE_ENTRIES, max_bytes: int = DEFAULT_REPLY_CACHE_BYTES
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._bytes = 0
        self.stats = CacheStats()

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def get(self, key: K) -> V | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry[0]

    def put(self, key: K, value: V, size_bytes: int = 0) -> None:
        """Keep `value`, counted as `size_bytes`; a value over `max_bytes` on its own is a
        caller's bug (it must store something smaller), not a reason to flush the cache."""
        if size_bytes > self.max_bytes:
            raise ValueError(f"an entry of {size_bytes} bytes cannot fit a cache of {self.max_bytes} bytes")
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= old[1]
        self._entries[key] = (value, size_bytes)
        self._bytes += size_bytes
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, evicted_bytes) = self._entries.popitem(last=False)
            self._bytes -= evicted_bytes
            self.stats.evictions += 1

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
