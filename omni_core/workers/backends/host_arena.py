"""Page-locked host memory for the fast path: one arena per layout, a slot per allocation."""

from __future__ import annotations

import contextlib
import mmap
import time
from dataclasses import dataclass
from typing import Any

import torch


class HostArena:
    """One block of page-locked host memory of exactly `nbytes`: an anonymous mapping,
    transparent huge pages where the kernel offers them, faulted in by all of torch's CPU
    threads, then `cudaHostRegister` (cudaHostAlloc of the same bytes was slower to set up
    and no faster to copy from: benchmarks/results/memory.md)."""

    def __init__(self, nbytes: int, ops: Any, *, touch: bool = True) -> None:
        started = time.perf_counter()
        self.nbytes = nbytes
        self._ops = ops
        size = max(nbytes, 1)
        self._buffer: Any = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # THP off: 4 KiB pages work, only the fault-in is slower
                self._buffer.madvise(mmap.MADV_HUGEPAGE)
        self.tensor = torch.frombuffer(self._buffer, dtype=torch.uint8, count=size)
        if touch:
            self.tensor.zero_()  # parallel page faults; cudaHostRegister alone faults serially
        self.ptr = self.tensor.data_ptr()
        touched = time.perf_counter()
        ops.register(self.ptr, size)
        self.registered = True
        self.touch_s = touched - started
        self.register_s = time.perf_counter() - touched

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self.registered:
            self.registered = False
            self._ops.unregister(self.ptr)
        with contextlib.suppress(BufferError):  # a view is still alive: the mapping goes with it
            self._buffer.close()


@dataclass
class Slot:
    arena: HostArena
    offset: int
    nbytes: int

    @property
    def host(self) -> int:
        return self.arena.ptr + self.offset
