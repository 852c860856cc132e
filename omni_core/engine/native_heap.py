"""The engine process's C heap, bounded: what RSS keeps that no Python object holds.

A long chaos run (docs/security.md, "The chaos run's RSS growth") grew the server's RSS by
40 MiB in 10 minutes while tracemalloc found no growing Python structure: glibc had made 16
arenas (one per thread that ever allocated: callers, HTTP workers, fault threads) and held
23 MiB of freed memory in them for reuse; `malloc_trim(0)` gave 20 MiB of it back. So the
engine caps the arenas (`mallopt(M_ARENA_MAX)`, before its own threads start) and, from its
loop, hands free heap memory back to the kernel every `trim_interval_s`. Both are glibc's; on
another C library (musl, macOS) the heap is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

log = logging.getLogger("omni_core.engine")

M_ARENA_MAX = -8  # malloc.h
MALLOC_ARENA_LIMIT = 4  # threads beyond it share arenas (glibc's default: 8 per core)
HEAP_TRIM_INTERVAL_S = 60.0  # one malloc_trim(0) takes about a millisecond per 100 MiB of heap


def _glibc() -> Any | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None  # not glibc: nothing to tune
    return libc


class NativeHeap:
    """Caps the arenas once, then trims at most every `trim_interval_s` of the caller's clock."""

    def __init__(
        self,
        *,
        arena_limit: int = MALLOC_ARENA_LIMIT,
        trim_interval_s: float = HEAP_TRIM_INTERVAL_S,
        libc: Any | None = None,
        now_s: float = 0.0,
    ) -> None:
        if arena_limit < 1 or trim_interval_s <= 0:
            raise ValueError(f"arena_limit must be >= 1 and trim_interval_s > 0 (got {arena_limit}, {trim_interval_s})")
        self._libc = libc if libc is not None else _glibc()
        self.trim_interval_s = trim_interval_s
        self.trims = 0  # malloc_trim calls made
        self.trims_returning = 0  # of them, those that gave memory back to the kernel
        self._next_trim_at_s = now_s + trim_interval_s
        if self._libc is not None and self._libc.mallopt(M_ARENA_MAX, arena_limit) != 1:
            log.warning("glibc refused M_ARENA_MAX=%d; the engine's C heap keeps glibc's arena count", arena_limit)

    @property
    def tuned(self) -> bool:
        return self._libc is not None

    def tick(self, now_s: float) -> None:
        """From the engine's loop: trim when the interval has passed."""
        if self._libc is None or now_s < self._next_trim_at_s:
            return
        self._next_trim_at_s = now_s + self.trim_interval_s
        self.trims += 1
        if self._libc.malloc_trim(0) == 1:
            self.trims_returning += 1
