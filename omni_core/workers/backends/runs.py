"""Neighbouring allocations of one tag woken into one physical allocation (`fast`, by default).

The CUDA driver's cost of a sleep and a wake is per physical allocation, not per byte: on an
H100, unmapping 16 GiB held as 512 allocations of 32 MiB takes 20-30 ms and mapping it 22-30
ms, but held as 32 of 512 MiB 5.7 and 2.3 ms; while another process copies (a swap), each
allocation's cuMemSetAccess waits ~0.7 ms (benchmarks/results/swap_gpu.md). vLLM's
CuMemAllocator reserves a virtual range per allocation, and the ranges of consecutive
allocations touch; one physical allocation mapped over several touching ranges is accepted
by the driver (`benchmarks/swap_ideas.py`, `span_map`). So a wake maps each run of touching
asleep allocations of one tag, up to `max_bytes`, with one cuMemCreate + cuMemMap +
cuMemSetAccess, and a sleep unmaps the run once its last member is released. At load (a
prepare in the foreground), the awake allocations vLLM made one by one are adopted into runs,
bytes kept, so that the first sleep already unmaps runs.

A member's vLLM handle is left as it was: the run's physical handle is held here. The `fast`
backend does every sleep and wake, and its worker leaves with os._exit
(CumemBackend.hard_exit_required). What remains is vLLM's free path: when torch gives a
member's segment back (its pool released), vLLM's C extension asks the allocator's
`python_free_callback` for the handle, then unmaps and releases it and frees its address
range. A run member's range is part of the run's mapping, which the driver does not unmap
piecewise (the extension would keep the error and fail later allocations), and its own
physical handle was released when the run was made. So `guard_frees` wraps that callback:
for a member of a mapped run it hands the extension a stand-in (`SpanMapper.decoy`: fresh
address space mapped onto the run's own memory, with a new reference to it) to unmap and
release in the member's place, and keeps the member's range; the run is unmapped when its
last member goes, asleep or freed, and the freed members' ranges and handle cells with it.
vLLM's own sleep must still not run beside these runs (it is never called by omni-core).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from omni_core.workers.backends.copy_plan import nbytes_of
from omni_core.workers.backends.cuda_driver import CudaDriverError

log = logging.getLogger("omni_core.backends.fast")


class SpanMapper(Protocol):
    def map_span(self, nbytes: int, ptr: int) -> int:
        """Create `nbytes` of device memory and map it at `ptr`; returns its physical handle."""

    def unmap_span(self, nbytes: int, ptr: int, handle: int) -> None:
        """Unmap [ptr, ptr + nbytes) and release `handle`."""

    def adopt(self, nbytes: int, ptr: int, release_members: Callable[[], None]) -> int:
        """Move the bytes of the mapped range [ptr, ptr + nbytes) into one new physical
        allocation mapped there: made at a scratch range, filled from the range, then
        `release_members()` unmaps what backed the range, and the new one is mapped at
        `ptr`. Returns its handle; nothing changes when it fails before the release."""

    def decoy(self, nbytes: int, handle: int) -> tuple[int, int]:
        """A stand-in for a freed run member: `nbytes` of fresh address space mapped onto the
        run's physical allocation `handle`, and a cell (C malloc) holding a new reference to
        it. Returns (address, cell): unmapping the address, releasing the cell's handle,
        freeing the address and the cell (vLLM's free path) leave the run as it was."""

    def forget(self, nbytes: int, ptr: int, cell: int) -> None:
        """A freed member's own address range and handle cell, once its run is unmapped."""


class DriverSpans:
    """SpanMapper over the CUDA driver's calls (cuda_driver.CudaDriver) on one device;
    `ops` (cuda_ops.CudaOps) copies a range into the scratch of an adoption."""

    def __init__(self, driver: Any, device: int, ops: Any = None) -> None:
        self.driver, self.device, self.ops = driver, device, ops

    def map_span(self, nbytes: int, ptr: int) -> int:
        self.driver.ensure_context(self.device)
        cell = ctypes.c_uint64()
        self.driver.map_into(self.device, nbytes, ptr, cell)
        return cell.value

    def unmap_span(self, nbytes: int, ptr: int, handle: int) -> None:
        self.driver.ensure_context(self.device)
        self.driver.unmap_from(nbytes, ptr, handle)

    def adopt(self, nbytes: int, ptr: int, release_members: Callable[[], None]) -> int:
        d = self.driver
        d.ensure_context(self.device)
        scratch = d.reserve(nbytes)
        cell = ctypes.c_uint64()
        try:
            d.map_into(self.device, nbytes, scratch, cell)
            try:
                stream = self.ops.streams[0]
                self.ops.copy_any(scratch, ptr, nbytes, stream)
                self.ops.wait(self.ops.record(stream))
                release_members()
            except BaseException:
                d.unmap_from(nbytes, scratch, cell.value)
                raise
            d.check(d.cu.cuMemUnmap(scratch, nbytes), f"cuMemUnmap of {nbytes} scratch bytes")
            d.check(d.cu.cuMemMap(ptr, nbytes, 0, cell.value, 0), f"cuMemMap of a {nbytes}-byte run")
            d.check(d.cu.cuMemSetAccess(ptr, nbytes, ctypes.byref(d._prop(self.device)[1]), 1), "cuMemSetAccess")
        finally:
            d.free_range(scratch, nbytes)
        return cell.value

    def decoy(self, nbytes: int, handle: int) -> tuple[int, int]:
        d = self.driver
        d.ensure_context(self.device)
        scratch = d.reserve(nbytes)
        retained = ctypes.c_uint64()
        try:
            try:
                d.check(d.cu.cuMemMap(scratch, nbytes, 0, handle, 0), f"cuMemMap of a {nbytes}-byte stand-in")
                try:
                    d.check(
                        d.cu.cuMemRetainAllocationHandle(ctypes.byref(retained), scratch), "cuMemRetainAllocationHandle"
                    )
                except BaseException:
                    d.cu.cuMemUnmap(scratch, nbytes)
                    raise
            except CudaDriverError as exc:
                # A driver that maps no part of an allocation alone: fresh memory of the
                # member's size instead, which vLLM's free path gives back at once.
                log.info("fast backend: a freed run member's stand-in takes fresh memory (%s)", exc)
                d.map_into(self.device, nbytes, scratch, retained)
        except BaseException:
            d.free_range(scratch, nbytes)
            raise
        cell = _libc().malloc(ctypes.sizeof(ctypes.c_uint64))
        if not cell:
            d.unmap_from(nbytes, scratch, retained.value)
            d.free_range(scratch, nbytes)
            raise MemoryError("malloc of 8 bytes for a stand-in's handle cell failed")
        ctypes.c_uint64.from_address(cell).value = retained.value
        return scratch, cell

    def forget(self, nbytes: int, ptr: int, cell: int) -> None:
        self.driver.ensure_context(self.device)
        self.driver.free_range(ptr, nbytes)
        _libc().free(cell)


@functools.cache
def _libc() -> Any:
    libc = ctypes.CDLL(None)  # the C library vLLM's extension mallocs and frees its handle cells with
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.restype, libc.free.argtypes = None, [ctypes.c_void_p]
    return libc


@dataclass
class Run:
    start: int
    nbytes: int
    handle: int
    members: set[int]
    awake: set[int] = field(default_factory=set)
    freed: list[tuple[int, int, int]] = field(default_factory=list)  # (ptr, nbytes, cell) freed while mapped


class Runs:
    """The runs mapped now, and which allocation belongs to which."""

    def __init__(self, mapper: SpanMapper, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"runs of at most {max_bytes} bytes: give a positive size")
        self.mapper = mapper
        self.max_bytes = max_bytes
        self._of: dict[int, Run] = {}
        self.mapped_runs = 0  # figures: runs mapped since start

    def group(self, allocs: Sequence[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
        """`allocs` in address order, cut into runs of touching ranges of one tag (at most
        max_bytes each). An allocation whose run is still mapped stays alone."""
        groups: list[list[tuple[int, Any]]] = []
        run_bytes = 0
        for ptr, data in sorted(allocs, key=lambda a: a[0]):
            last = groups[-1] if groups else None
            joins = (
                last is not None
                and ptr not in self._of
                and last[-1][0] not in self._of
                and last[-1][0] + nbytes_of(last[-1][1]) == ptr
                and last[-1][1].tag == data.tag
                and run_bytes + nbytes_of(data) <= self.max_bytes
            )
            if joins and last is not None:
                last.append((ptr, data))
                run_bytes += nbytes_of(data)
            else:
                groups.append([(ptr, data)])
                run_bytes = nbytes_of(data)
        return groups

    def map(self, group: Sequence[tuple[int, Any]]) -> None:
        """Map the run `group` with one physical allocation."""
        start = group[0][0]
        nbytes = sum(nbytes_of(d) for _, d in group)
        handle = self.mapper.map_span(nbytes, start)
        run = Run(start, nbytes, handle, {p for p, _ in group}, {p for p, _ in group})
        for ptr, _ in group:
            self._of[ptr] = run
        self.mapped_runs += 1

    def adopt(self, group: Sequence[tuple[int, Any]], release_member: Callable[[int, Any], None]) -> None:
        """Make the awake run `group` one physical allocation, its bytes kept (at load)."""
        start = group[0][0]
        nbytes = sum(nbytes_of(d) for _, d in group)

        def release() -> None:
            for ptr, data in group:
                release_member(ptr, data)

        handle = self.mapper.adopt(nbytes, start, release)
        run = Run(start, nbytes, handle, {p for p, _ in group}, {p for p, _ in group})
        for ptr, _ in group:
            self._of[ptr] = run
        self.mapped_runs += 1

    def adopt_all(self, awake: Sequence[tuple[int, Any]], release_member: Callable[[int, Any], None]) -> None:
        """Every run of the `awake` allocations not yet in one becomes one, so that their first
        sleep already unmaps runs. A run that cannot (no room for its scratch) stays apart:
        it becomes one at its first wake."""
        for group in self.group([a for a in awake if a[0] not in self._of]):
            if len(group) < 2:
                continue
            try:
                self.adopt(group, release_member)
            except Exception as exc:
                log.warning("fast backend: %d allocations stay apart (%s: %s)", len(group), type(exc).__name__, exc)

    def owns(self, ptr: int) -> bool:
        return ptr in self._of

    def readopt(self, ptr: int) -> None:
        """An allocation released from a run that is still mapped (a sleep that failed
        midway) is awake again: its memory never left."""
        self._of[ptr].awake.add(ptr)

    def release(self, ptr: int) -> bool:
        """`ptr` is asleep; its run is unmapped once no member is awake. True when it was."""
        run = self._of[ptr]
        run.awake.discard(ptr)
        if run.awake:
            return False
        self._unmap(run)
        return True

    def free_member(self, ptr: int, handle: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
        """vLLM frees the member `ptr` of a mapped run (its free callback gave `handle`): the
        handle its extension unmaps and releases instead, a stand-in on the run's memory. The
        member leaves the run; its range stays mapped until the run's last member goes."""
        run = self._of[ptr]
        device, nbytes, _, cell = handle
        decoy, decoy_cell = self.mapper.decoy(nbytes, run.handle)  # first: a failure changes nothing
        del self._of[ptr]
        run.members.discard(ptr)
        run.awake.discard(ptr)
        run.freed.append((ptr, nbytes, cell))
        if not run.awake:
            self._unmap(run)
        return (device, nbytes, decoy, decoy_cell)

    def _unmap(self, run: Run) -> None:
        self.mapper.unmap_span(run.nbytes, run.start, run.handle)
        for member in run.members:
            self._of.pop(member, None)
        for ptr, nbytes, cell in run.freed:  # no longer under the run's mapping: vLLM's to give back
            self.mapper.forget(nbytes, ptr, cell)
        run.freed.clear()


class FreeGuard:
    """The allocator's free callback, wrapped once per allocator: a member of a mapped run of
    any live `Runs` is handed to `Runs.free_member` (see the module docstring)."""

    def __init__(self, original: Callable[[int], Any]) -> None:
        self.original = original
        self.registries: weakref.WeakSet[Runs] = weakref.WeakSet()

    def __call__(self, ptr: int) -> Any:
        handle = self.original(ptr)  # vLLM's own: forgets the allocation, waits for the device
        for runs in list(self.registries):
            if runs.owns(ptr):
                try:
                    return runs.free_member(ptr, tuple(handle))
                except Exception as exc:  # raising here would leave vLLM's extension holding the GIL
                    log.error(
                        "fast backend: could not stand in for run member %#x freed by vLLM (%s: %s); its range "
                        "stays mapped by the run and the driver will refuse vLLM's unmap of it",
                        ptr,
                        type(exc).__name__,
                        exc,
                    )
        return handle


def guard_frees(allocator: Any, module: Any, runs: Runs) -> str:
    """Route vLLM's frees of `runs`' members through a FreeGuard. Returns why it cannot ("":
    guarded): an allocator without a `python_free_callback` attribute (older vLLM) hands its
    extension a callback made on the spot, which nothing here can wrap."""
    current = getattr(allocator, "python_free_callback", None)
    if current is None or not callable(current):
        return "this vLLM's CuMemAllocator has no python_free_callback through which its frees could be guarded"
    if not isinstance(current, FreeGuard):
        current = FreeGuard(current)
        allocator.python_free_callback = current
        init_module = getattr(module, "init_module", None)
        malloc_callback = getattr(allocator, "python_malloc_callback", None)
        if init_module is not None and callable(malloc_callback):
            init_module(malloc_callback, current)  # pools made before: the extension's one callback is ours now
    current.registries.add(runs)
    return ""


def make_runs(
    allocator: Any, module: Any, spans: SpanMapper | None, run_bytes: int | None, *, required: bool
) -> tuple[Runs | None, str]:
    """Runs of at most `run_bytes` (None or 0: none) with vLLM's frees guarded, and why there
    are none. Where they cannot be made (no SpanMapper, no guard), `required` raises."""
    if not run_bytes:
        return None, "off (run_bytes=0)"
    why = "runs need the driver's mapping (map_with='driver' on CUDA) or a SpanMapper" if spans is None else ""
    runs = Runs(spans, run_bytes) if spans is not None else None
    if runs is not None:
        why = guard_frees(allocator, module, runs)
    if why and required:
        raise ValueError(f"run_bytes={run_bytes}: {why}")
    return (None, why) if why else (runs, "")
