"""Bounded cache of terminal replies, keyed by task_id (P-2).

A duplicate command is answered from here and has no second effect. The bound is a count
of entries with least-recently-used eviction: a retry that arrives after `max_entries`
newer tasks is treated as new, so callers must retry within that window (the orchestrator
keeps at most one lifecycle task per stage in flight, far inside any sane bound).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_REPLY_CACHE_ENTRIES = 1024


@dataclass
class CacheStats:
    hits: int = 0
    evictions: int = 0


class BoundedCache(Generic[K, V]):
    def __init__(self, max_entries: int = DEFAULT_REPLY_CACHE_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[K, V] = OrderedDict()
        self.stats = CacheStats()

    def get(self, key: K) -> V | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
            self.stats.hits += 1
        return value

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.stats.evictions += 1

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)
