"""The buckets a rank keeps open between updates, bounded by bytes, released when gone.

A sender that refills the same buckets for the next version is read through the mapping the
rank already holds (no page faults, no reopening). But a mapping pins its file: a bucket the
sender unlinked stays in host memory for as long as a rank maps it. So at the start of every
update `sweep` drops each entry whose bucket is gone (its file unlinked or replaced under its
name, its sender no longer running), and after the update's buckets are open `trim` drops the
least recently used entries the update does not use until what is left of them is at most
`retained_bytes`. What one update uses is always kept: its buckets are read right after.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

log = logging.getLogger("omni_core.workers")

# Mappings of buckets outside the update in hand kept for a later update (another sender's,
# alternating with the first): bytes, not a count, because a mapping pins its whole file.
MAX_RETAINED_BUCKET_BYTES = 1 << 30


@dataclass(eq=False)
class CachedBucket:
    view: torch.Tensor | None
    nbytes: int
    gone: Callable[[], bool]  # the bucket no longer stands for what its sender shares


class BucketCache:
    def __init__(self, retained_bytes: int = MAX_RETAINED_BUCKET_BYTES) -> None:
        self.retained_bytes = retained_bytes
        self._entries: OrderedDict[Hashable, CachedBucket] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def mapped_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    def get(self, key: Hashable) -> torch.Tensor | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry.view

    def put(self, key: Hashable, entry: CachedBucket) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._drop(old)
        self._entries[key] = entry

    def sweep(self) -> int:
        """Release every entry whose bucket is gone; how many were."""
        gone = []
        for key, entry in self._entries.items():
            try:
                if entry.gone():
                    gone.append(key)
            except Exception:  # a check that cannot tell: treat as gone, reopen on demand
                gone.append(key)
        for key in gone:
            self._drop(self._entries.pop(key))
        return len(gone)

    def trim(self, in_use: set[Hashable]) -> None:
        """Release the oldest entries outside `in_use` until those left hold at most retained_bytes."""
        spare = sum(e.nbytes for k, e in self._entries.items() if k not in in_use)
        for key in [k for k in self._entries if k not in in_use]:
            if spare <= self.retained_bytes:
                break
            entry = self._entries.pop(key)
            spare -= entry.nbytes
            self._drop(entry)

    def clear(self) -> None:
        while self._entries:
            self._drop(self._entries.popitem(last=False)[1])

    @staticmethod
    def _drop(entry: CachedBucket) -> None:
        # The mapping (an mmap of a bucket file, a CUDA IPC mapping) goes with its last tensor:
        # at once, unless a view of it is still held elsewhere.
        entry.view = None
