"""Page-locked host memory for the fast path: one arena per layout, a slot per allocation."""

from __future__ import annotations

import contextlib
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from omni_core.workers.backends.copy_plan import nbytes_of


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


class CleanCopyMismatch(RuntimeError):
    """A tag declared read-only (ModelRunner.read_only_tags) changed on the device since
    its host copy was made: the runner writes it. Nothing was released."""


def verify_clean(
    clean: list[tuple[int, Any]],
    slots: dict[int, Slot],
    ops: Any,
    copy_out: Callable[[list[tuple[int, int, int]]], None],
) -> None:
    """The device bytes of every `clean` allocation (address, vLLM's data) equal its slot's:
    copied into a scratch arena with `copy_out((device, host, nbytes) spans)`, compared there."""
    total = sum(nbytes_of(d) for _, d in clean)
    scratch = HostArena(total, ops, touch=False)
    try:
        offsets, offset = [], 0
        for _, data in clean:
            offsets.append(offset)
            offset += nbytes_of(data)
        copy_out([(p, scratch.ptr + o, nbytes_of(d)) for (p, d), o in zip(clean, offsets, strict=True)])
        for (ptr, data), o in zip(clean, offsets, strict=True):
            slot = slots[ptr]
            if not torch.equal(scratch.view(o, slot.nbytes), slot.arena.view(slot.offset, slot.nbytes)):
                raise CleanCopyMismatch(
                    f"allocation at {ptr:#x} of tag {data.tag!r} ({slot.nbytes} bytes) changed since its host "
                    f"copy was made, but the runner declares {data.tag!r} read-only (ModelRunner.read_only_tags); "
                    "fix the runner's declaration (a runner that writes its weights must not list them)"
                )
    finally:
        scratch.close()
