"""The fast backend: vLLM's CuMemAllocator pools, moved at the speed of the host link.

Same allocations, same virtual addresses, same lifecycle as the cumem backend (tensors,
raw pointers and captured CUDA graphs stay valid), but the bytes move differently:

- **One host arena, registered once.** vLLM's first sleep pins a fresh host tensor per
  allocation (pinning runs at 3-4 GB/s, so 8 GiB take 3-4 s) and torch's pinned cache then
  rounds every later one up to a power of two. Here a single anonymous mapping of exactly
  the offloaded allocations' size is page-locked with the driver (`cudaHostRegister`)
  when the weights have been allocated, before the first sleep: its cost is paid at load
  time (or in the background) and reported (`arena_prepare_s`), never inside a sleep.
- **Large asynchronous copies on dedicated streams.** Allocations are laid out in the arena
  in address order, so neighbours that are contiguous on the device are contiguous on the
  host too and travel as one copy; runs are cut into chunks (128 MiB by default) spread
  over two streams, with an event after each chunk.
- **Release as soon as copied.** Discarded tags are unmapped first (nothing to wait for);
  each offloaded allocation is unmapped the moment the event of its last chunk completes.
- **Map while copying on wake.** Allocation i+1 is mapped (cuMemCreate/cuMemMap through
  vLLM's extension) while allocation i's bytes are already on the way back.
- **Clean weights sleep without a copy.** For tags the runner declares unchanged by
  execution (`ModelRunner.read_only_tags`: inference weights), the arena keeps a valid copy
  while the tag is awake: made once after load (or after a reload), and still valid after
  a wake restored from it. A level-1 sleep of such a tag only unmaps. A reload, an
  in-place update or a discard invalidates the copy; `verify_clean` compares the device
  bytes with the copy at each clean sleep and refuses the sleep if a runner lied.

Allocations are mapped and unmapped with the CUDA driver's calls made directly
(`cuda_driver.py`: the same calls as vLLM's `python_create_and_map` /
`python_unmap_and_release`, on vLLM's own handles, but a wake runs at 51.6 GB/s instead of
46.4-47.7 on an H200, benchmarks/results/wake_gpu.md; `map_with="vllm"` uses the extension),
and vLLM's bookkeeping stays coherent: every allocation's `is_asleep` /
`is_mapped` flag is set as vLLM's own loops set it, and an offloaded allocation's
`cpu_backup_tensor` is a view of its arena slice, so vLLM's `wake_up` could restore it too.

`FastPath` is the mechanism over any CuMemAllocator instance; `FastBackend` is the
omni-core memory backend on it, and `omni_core.vllm_plugin` offers the same mechanism to
plain vLLM workers as a sleep-mode backend. The device calls sit behind `CudaOps` so that
the bookkeeping runs on CPU test doubles in CI.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from omni_core.fsm.tags import WEIGHTS_TAG
from omni_core.protocol import LinkShare
from omni_core.workers.backends.cuda_driver import CudaDriver
from omni_core.workers.backends.cumem import CumemBackend, handle_of
from omni_core.workers.backends.host_room import (
    ArenaChoice,
    HostMemorySource,
    choose_arena,
    host_arena_lock,
)
from omni_core.workers.backends.lanes import (
    DEFAULT_SLOT_BYTES,
    DirectLane,
    Lane,
    LanePicker,
    RelayFailed,
    RelayLane,
)
from omni_core.workers.memory_gate import MemoryGate, MemoryWaitExpired, admit

log = logging.getLogger("omni_core.backends.fast")

MiB = 1 << 20
WARM_SLOT_BYTES = 2 * MiB  # the staging of a load-time relay warm-up
DEFAULT_CHUNK_BYTES = 128 * MiB
DEFAULT_STREAMS = 2
MAP_WITH = ("driver", "vllm")  # how allocations are mapped and unmapped: cuda_driver.py, or vLLM's extension
# cudaMemcpyKind and cudaHostRegister flags (driver_types.h)
_H2D, _D2H, _DEFAULT = 1, 2, 4
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_HOST_REGISTER_PORTABLE = 1  # usable from every context: the arena may be prepared on another thread
# When the arena is laid out and registered: at load (the default: never inside a sleep), on
# a thread after load (the next sleep waits for it), or at the first sleep.
PREPARE_MODES = ("load", "background", "sleep")


class CopyObserver(Protocol):
    """Watches a FastPath's device work (`FastPath.observer`; None, the default, costs one
    attribute test per copy or map): the swap benchmark draws each process's bytes in flight
    and mapped bytes from it. Times are `time.monotonic()`, which is system-wide on Linux,
    so the timelines of two processes line up."""

    def copy_issued(self, stream: Any, nbytes: int, to_device: bool) -> None:
        """A copy of `nbytes` was just queued on `stream` (it completes later)."""

    def mapped(self, nbytes: int, started_s: float) -> None:
        """An allocation of `nbytes` was mapped; the map call began at `started_s`."""

    def unmapped(self, nbytes: int) -> None:
        """An allocation of `nbytes` was just unmapped (its memory is free again)."""


# ---------------------------------------------------------------------- planning (pure)


def _nbytes(data: Any) -> int:
    return int(handle_of(data).size)


@dataclass(frozen=True)
class Copy:
    """One asynchronous copy: `nbytes` between device address `device` and host `host`;
    `completes` lists the indices of the allocations whose last byte is in it."""

    device: int
    host: int
    nbytes: int
    completes: tuple[int, ...]


def plan_copies(spans: Sequence[tuple[int, int, int]], chunk_bytes: int) -> list[Copy]:
    """`spans` are (device address, host address, size), in the order they should travel.
    A span that continues the previous one on both sides joins its run; every run is cut
    into copies of at most `chunk_bytes`. Each span index appears in exactly one copy's
    `completes`: the copy holding its last byte (a zero-size span: the copy where it starts)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    runs: list[list[Any]] = []  # [device, host, length, [(end offset in run, span index)]]
    for index, (dev, host, size) in enumerate(spans):
        if size < 0:
            raise ValueError(f"span {index} has negative size {size}")
        last = runs[-1] if runs else None
        if last is not None and dev == last[0] + last[2] and host == last[1] + last[2]:
            last[2] += size
            last[3].append((last[2], index))
        else:
            runs.append([dev, host, size, [(size, index)]])
    copies: list[Copy] = []
    for dev, host, length, ends in runs:
        count = max(1, -(-length // chunk_bytes))
        done: list[list[int]] = [[] for _ in range(count)]
        for end, index in ends:
            done[max(0, end - 1) // chunk_bytes].append(index)
        for k in range(count):
            start = k * chunk_bytes
            copies.append(Copy(dev + start, host + start, min(chunk_bytes, length - start), tuple(done[k])))
    return copies


# ---------------------------------------------------------------------- device calls


def _find_cudart() -> str:
    """The libcudart torch loaded (vLLM's cumem module finds it the same way)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if "/" in line else ""
            if "libcudart" in os.path.basename(path):
                return path
    raise RuntimeError("libcudart is not loaded in this process (torch links it statically?); "
                       "the fast backend needs cudaMemcpyAsync and cudaHostRegister from it")  # fmt: skip


class CudaOps:
    """The few CUDA runtime calls the fast path makes, on `device`'s dedicated streams."""

    def __init__(self, device: torch.device, streams: int = DEFAULT_STREAMS) -> None:
        torch.cuda.init()
        self.device = torch.device(device)
        rt = ctypes.CDLL(_find_cudart())
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        rt.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        rt.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
        rt.cudaHostUnregister.argtypes = [vp]
        rt.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), sz, ctypes.c_uint]
        rt.cudaFreeHost.argtypes = [vp]
        rt.cudaGetErrorString.argtypes = [ctypes.c_int]
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), sz]
        rt.cudaFree.argtypes = [vp]
        rt.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
        for fn in (rt.cudaMemcpyAsync, rt.cudaHostRegister, rt.cudaHostUnregister, rt.cudaHostAlloc, rt.cudaFreeHost,
                   rt.cudaMalloc, rt.cudaFree, rt.cudaDeviceEnablePeerAccess):  # fmt: skip
            fn.restype = ctypes.c_int
        self._rt = rt
        self._stream_count = max(1, streams)
        self._streams: list[torch.cuda.Stream] | None = None
        self._peer_streams: dict[int, torch.cuda.Stream] = {}
        self._hop_streams: dict[int, torch.cuda.Stream] = {}
        self._staging: dict[int, int] = {}  # peer index -> its staging buffer (cudaMalloc on the peer)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({self._rt.cudaGetErrorString(rc).decode()})")

    @property
    def streams(self) -> list[Any]:
        if self._streams is None:
            self._streams = [torch.cuda.Stream(device=self.device) for _ in range(self._stream_count)]
        return self._streams

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool, stream: Any) -> None:
        rc = self._rt.cudaMemcpyAsync(dst, src, nbytes, _H2D if to_device else _D2H, stream.cuda_stream)
        self._check(rc, f"cudaMemcpyAsync of {nbytes} bytes")

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # -- relays through a peer GPU (lanes.RelayLane)

    def peer_stream(self, peer: int) -> Any:
        if peer not in self._peer_streams:
            self._peer_streams[peer] = torch.cuda.Stream(device=torch.device("cuda", peer))
        return self._peer_streams[peer]

    def hop_stream(self, peer: int) -> Any:
        if peer not in self._hop_streams:
            self._hop_streams[peer] = torch.cuda.Stream(device=self.device)
        return self._hop_streams[peer]

    def _enable_peer_access(self, peer: int) -> None:
        own = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if not torch.cuda.can_device_access_peer(own, peer):
            raise RuntimeError(f"cuda:{own} cannot access cuda:{peer} peer to peer (no NVLink or P2P between "
                               "them): plan this copy on the direct link alone")  # fmt: skip
        for here, there in ((own, peer), (peer, own)):
            with torch.cuda.device(here):
                rc = self._rt.cudaDeviceEnablePeerAccess(there, 0)
                if rc == _PEER_ACCESS_ALREADY_ENABLED:
                    self._rt.cudaGetLastError()  # the runtime keeps the code as its last error: clear it
                else:
                    self._check(rc, f"cudaDeviceEnablePeerAccess(cuda:{here} -> cuda:{there})")

    def staging(self, peer: int, nbytes: int) -> int:
        """`nbytes` of device memory on `peer`, held until release_staging(peer)."""
        self.release_staging(peer)
        self._enable_peer_access(peer)
        ptr = ctypes.c_void_p()
        with torch.cuda.device(peer):
            rc = self._rt.cudaMalloc(ctypes.byref(ptr), nbytes)
            self._check(rc, f"cudaMalloc of {nbytes} staging bytes on cuda:{peer}")
        self._staging[peer] = int(ptr.value or 0)
        return self._staging[peer]

    def release_staging(self, peer: int) -> None:
        ptr = self._staging.pop(peer, None)
        if ptr is not None:
            with torch.cuda.device(peer):
                self._check(self._rt.cudaFree(ptr), f"cudaFree of the staging buffer on cuda:{peer}")

    def copy_any(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """A copy between any two addresses of the unified address space (host, this device, a peer)."""
        rc = self._rt.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT, stream.cuda_stream)
        self._check(rc, f"cudaMemcpyAsync of {nbytes} bytes through a peer")

    def stream_wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def after_current(self, stream: Any) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait(self, event: Any) -> None:
        event.synchronize()

    def streams_after_current(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            s.wait_stream(current)

    def current_after_streams(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            current.wait_stream(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def warm_up(self, device_ptr: int, host_ptr: int) -> None:
        for stream in self.streams:  # one byte each way on every stream (the slot is rewritten at sleep)
            self.copy(host_ptr, device_ptr, 1, False, stream)
            self.copy(device_ptr, host_ptr, 1, True, stream)
            self.wait(self.record(stream))

    def register(self, ptr: int, nbytes: int) -> None:
        self._check(self._rt.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE),
                    f"cudaHostRegister of {nbytes} bytes")  # fmt: skip

    def unregister(self, ptr: int) -> None:
        self._check(self._rt.cudaHostUnregister(ptr), "cudaHostUnregister")

    def host_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(self._rt.cudaHostAlloc(ctypes.byref(ptr), nbytes, _HOST_REGISTER_PORTABLE),
                    f"cudaHostAlloc of {nbytes} bytes")  # fmt: skip
        return int(ptr.value or 0)

    def host_free(self, ptr: int) -> None:
        self._check(self._rt.cudaFreeHost(ptr), "cudaFreeHost")


# ---------------------------------------------------------------------- host arena


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


@dataclass
class PathStats:
    """Figures of the last prepare / sleep / wake (seconds, bytes)."""

    arena_bytes: int = 0
    arena_prepare_s: float = 0.0
    arena_touch_s: float = 0.0
    arena_register_s: float = 0.0
    late_arena_bytes: int = 0  # offloaded allocations that were not in the prepared arena
    late_arena_s: float = 0.0
    snapshot_bytes: int = 0  # the last host copy of read-only tags made while awake
    snapshot_s: float = 0.0
    last: dict[str, Any] = field(default_factory=dict)


class _RestoreCopies:
    """The host->device copies of a wake: contiguous allocations join one run, and a run
    goes out (cut into chunks, spread over the lanes) once it holds `chunk_bytes` or the
    next allocation does not continue it."""

    def __init__(self, lanes: LanePicker, chunk_bytes: int, observer: CopyObserver | None = None) -> None:
        self.lanes, self.chunk_bytes, self.observer = lanes, chunk_bytes, observer
        self.run: list[tuple[int, int, int]] = []  # (device, host, bytes), contiguous on both sides
        self.run_bytes = 0
        self.issued = 0  # copies started
        self.restored_bytes = 0

    def add(self, device: int, host: int, nbytes: int) -> None:
        last = self.run[-1] if self.run else None
        if last is not None and (last[0] + last[2] != device or last[1] + last[2] != host):
            self.flush()
        self.run.append((device, host, nbytes))
        self.restored_bytes += nbytes
        self.run_bytes += nbytes
        if self.run_bytes >= self.chunk_bytes:  # start this run's copies; map the next ones meanwhile
            self.flush()

    def flush(self) -> None:
        for c in plan_copies(self.run, self.chunk_bytes):
            if c.nbytes:
                lane = self.lanes.pick(c.nbytes)
                lane.copy(c.device, c.host, c.nbytes, True)
                if self.observer is not None:
                    self.observer.copy_issued(getattr(lane, "stream", lane.name), c.nbytes, True)
                self.issued += 1
        self.run.clear()
        self.run_bytes = 0


def _wait_on(ops: Any, lane: Lane, event: Any) -> None:
    try:
        ops.wait(event)
    except Exception as exc:
        if isinstance(lane, RelayLane):
            raise RelayFailed(lane.peer, exc) from exc
        raise


def _synchronize_lanes(ops: Any, relays: list[RelayLane]) -> None:
    """Every lane's copies have landed: a relay's last hop runs on the rank's device, so its
    synchronize covers a wake; each relay's own tail is waited on first to name a failure."""
    for relay in relays:
        _wait_on(ops, relay, relay.record())
    ops.synchronize()


# ---------------------------------------------------------------------- the mechanism


class FastPath:
    """Sleep and wake of a CuMemAllocator's allocations through a registered host arena."""

    def __init__(
        self,
        allocator: Any,
        module: Any,
        device: torch.device,
        *,
        ops: Any = None,
        chunk_bytes: int | None = None,
        streams: int = DEFAULT_STREAMS,
        touch: bool = True,
        map_with: str = "driver",
    ) -> None:
        self.allocator = allocator
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes or DEFAULT_CHUNK_BYTES
        self.ops = ops if ops is not None else CudaOps(self.device, streams)
        self.touch = touch
        if map_with not in MAP_WITH:
            raise ValueError(f"map_with={map_with!r}: use one of {MAP_WITH}")
        raw_map = getattr(module, "python_create_and_map", None)
        raw_unmap = getattr(module, "python_unmap_and_release", None)
        self._map = (lambda h: raw_map(*h)) if raw_map is not None else module.create_and_map
        self._unmap = (lambda h: raw_unmap(*h)) if raw_unmap is not None else module.unmap_and_release
        # The same driver calls made directly wake faster than through vLLM's extension
        # (cuda_driver.py); only for vLLM's own CUDA handles (device, size, d_mem, p_memHandle).
        self.map_with = "driver" if map_with == "driver" and raw_map is not None and self.device.type == "cuda" \
            and torch.version.hip is None else "vllm"  # fmt: skip
        if self.map_with == "driver":
            driver = CudaDriver()
            self._map = lambda h: driver.create_and_map(*h)
            self._unmap = lambda h: driver.unmap_and_release(*h)
        self._slots: dict[int, Slot] = {}
        self._arenas: list[HostArena] = []
        self._backed: set[int] = set()  # allocations whose bytes are in their slot now
        # Awake allocations whose slot holds exactly their device bytes (tags in clean_tags
        # only): a sleep releases them without a copy.
        self._clean: set[int] = set()
        self.clean_tags: frozenset[str] = frozenset()  # the runner's word: execution never writes these
        self.verify_clean = False  # compare device bytes with the copy at each clean sleep
        self._unmapped: set[int] = set()  # for allocator versions without a flag
        self._prepare_thread: threading.Thread | None = None
        self._prepare_error: BaseException | None = None
        self._lock = threading.Lock()
        self.stats = PathStats()
        self.observer: CopyObserver | None = None  # off unless a benchmark watches
        self.relay_slot_bytes = DEFAULT_SLOT_BYTES  # each staging buffer on a peer (DEFAULT_SLOTS of them)

    # ------------------------------------------------------------------ allocation state

    def allocations(self, tags: Iterable[str] | None = None) -> list[tuple[int, Any]]:
        wanted = None if tags is None else set(tags)
        return sorted((ptr, d) for ptr, d in list(self.allocator.pointer_to_data.items())
                      if wanted is None or d.tag in wanted)  # fmt: skip

    def is_asleep(self, ptr: int, data: Any) -> bool:
        if hasattr(data, "is_asleep"):
            return bool(data.is_asleep)
        if hasattr(data, "is_mapped"):
            return not data.is_mapped
        return ptr in self._unmapped

    def _mark(self, ptr: int, data: Any, *, asleep: bool) -> None:
        if hasattr(data, "is_asleep"):
            data.is_asleep = asleep
        if hasattr(data, "is_mapped"):
            data.is_mapped = not asleep
        (self._unmapped.add if asleep else self._unmapped.discard)(ptr)

    # ------------------------------------------------------------------ arena

    def prepare(self, tags: Iterable[str] = (WEIGHTS_TAG,), *, background: bool = False) -> None:
        """Lay out and register an exact-size arena for the current allocations of `tags`
        (no-op when the present arena already fits them). In the background, the next
        sleep waits for it."""
        tags = tuple(tags)
        self.wait_prepared()
        if not background:
            self._prepare(tags)
            return

        def work() -> None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.set_device(self.device)
                self._prepare(tags)
            except BaseException as exc:  # surfaced by the next wait_prepared()
                self._prepare_error = exc

        self._prepare_thread = threading.Thread(target=work, name="omni-fast-arena", daemon=True)
        self._prepare_thread.start()

    def wait_prepared(self) -> None:
        thread, self._prepare_thread = self._prepare_thread, None
        if thread is not None:
            thread.join()
        error, self._prepare_error = self._prepare_error, None
        if error is not None:
            raise RuntimeError(f"preparing the host arena failed: {type(error).__name__}: {error}") from error

    def _prune_backed(self) -> None:
        # An allocation woken by someone else (vLLM's own wake_up) no longer needs its slot.
        table = self.allocator.pointer_to_data
        self._backed = {p for p in self._backed if p in table and self.is_asleep(p, table[p])}

    def _prepare(self, tags: tuple[str, ...]) -> None:
        with self._lock:
            self._layout(tags)
            self._snapshot(tuple(t for t in tags if t in self.clean_tags))

    def _snapshot(self, tags: tuple[str, ...]) -> None:
        """Copy the mapped, not yet clean allocations of `tags` into their slots and mark them
        clean: the host copy a later sleep then need not make."""
        allocs = [(p, d) for p, d in self.allocations(tags) if not self.is_asleep(p, d) and p not in self._clean]
        allocs = [(p, d) for p, d in allocs if p in self._slots and self._slots[p].nbytes == _nbytes(d)]
        if not allocs:
            return
        started = time.perf_counter()
        copies = plan_copies([(p, self._slots[p].host, _nbytes(d)) for p, d in allocs], self.chunk_bytes)
        self._copy_out(copies)
        self._clean.update(p for p, _ in allocs)
        self.stats.snapshot_bytes = sum(_nbytes(d) for _, d in allocs)
        self.stats.snapshot_s = time.perf_counter() - started
        log.info("fast backend: host copy of %.3f GiB of read-only %s made in %.3f s; their sleeps copy nothing",
                 self.stats.snapshot_bytes / 2**30, list(tags), self.stats.snapshot_s)  # fmt: skip

    def _issue_copies_out(self, copies: list[Copy], lanes: LanePicker | None = None) -> list[tuple[Lane, Any]]:
        """Start device->host `copies`, spread over the lanes (the direct streams when None);
        each copy's lane and the event after it."""
        lanes = lanes or self._lanes(())[0]
        self.ops.streams_after_current()
        events = []
        for c in copies:
            lane = lanes.pick(c.nbytes)
            if c.nbytes:
                lane.copy(c.host, c.device, c.nbytes, False)
                if self.observer is not None:
                    self.observer.copy_issued(getattr(lane, "stream", lane.name), c.nbytes, False)
            events.append((lane, lane.record()))
        return events

    def _copy_out(self, copies: list[Copy]) -> None:
        """Device->host `copies`, returning once every one has landed."""
        for _, event in self._issue_copies_out(copies):
            self.ops.wait(event)

    def _lanes(self, links: Sequence[LinkShare]) -> tuple[LanePicker, list[RelayLane]]:
        """The lanes of one sleep or wake: the direct streams with the own link's share (all
        of it without a plan), and a relay through each planned peer."""
        own_share = sum(link.share for link in links if link.peer is None) if links else 1.0
        direct = [DirectLane(self.ops, stream, i) for i, stream in enumerate(self.ops.streams)]
        lanes: list[tuple[Lane, float]] = [(d, own_share / len(direct)) for d in direct] if own_share > 0 else []
        relays: list[RelayLane] = []
        try:
            for link in links:
                if link.peer is not None and link.share > 0:
                    slot_bytes = min(self.relay_slot_bytes, self.chunk_bytes)
                    relays.append(RelayLane(self.ops, link.peer, slot_bytes=slot_bytes))
                    lanes.append((relays[-1], link.share))
        except Exception as exc:
            self._close_relays(relays)
            raise RelayFailed(link.peer, exc) from exc
        return LanePicker(lanes), relays

    def warm_relays(self, peers: Iterable[int]) -> None:
        """Open each peer's context, enable peer access both ways and send a byte through a
        relay and back, at load: a first sleep over k links then runs at their speed instead
        of paying for k contexts (each costs the peer about 0.5 GiB of device memory from
        now on). A peer that cannot relay is only logged: its commands fall back then."""
        awake = [(p, d) for p, d in self.allocations() if p in self._slots and not self.is_asleep(p, d)]
        if not awake:
            return
        device, host = awake[0][0], self._slots[awake[0][0]].host
        for peer in peers:
            try:
                lane = RelayLane(self.ops, peer, slot_bytes=WARM_SLOT_BYTES, slots=1)
                try:  # device -> host -> device: the byte comes back as it was
                    for dst, src, to_device in ((host, device, False), (device, host, True)):
                        lane.copy(dst, src, 1, to_device)
                        self.ops.wait(lane.record())
                finally:
                    lane.close()
            except Exception as exc:
                log.warning("fast backend: cuda:%s cannot relay this rank's copies (%s: %s); plans through it "
                            "will run on the own link", peer, type(exc).__name__, exc)  # fmt: skip

    def _close_relays(self, relays: list[RelayLane]) -> None:
        for relay in relays:
            with contextlib.suppress(Exception):  # a peer that failed may refuse its cudaFree too
                relay.close()

    def invalidate(self, tags: Iterable[str]) -> None:
        """The device content of `tags` is about to change (a reload, an in-place update):
        their host copies no longer stand for it."""
        wanted = set(tags)
        self._clean -= {p for p, d in self.allocations(wanted)}

    def _layout(self, tags: tuple[str, ...]) -> None:
        self._prune_backed()
        allocs = [(p, d) for p, d in self.allocations(tags) if not self.is_asleep(p, d)]
        if all(p in self._slots and self._slots[p].nbytes == _nbytes(d) for p, d in allocs):
            return
        if self._backed:
            return  # bytes live in the present arena: keep it; late slots cover new allocations
        started = time.perf_counter()
        self._drop_arenas()
        arena = self._new_arena(allocs)
        self.stats.arena_bytes = arena.nbytes if arena else 0
        self.stats.arena_prepare_s = time.perf_counter() - started
        self.stats.arena_touch_s = arena.touch_s if arena else 0.0
        self.stats.arena_register_s = arena.register_s if arena else 0.0
        log.info("fast backend: host arena of %.3f GiB for %d allocations of %s prepared in %.3f s "
                 "(fault-in %.3f s, cudaHostRegister %.3f s)", self.stats.arena_bytes / 2**30, len(allocs),
                 list(tags), self.stats.arena_prepare_s, self.stats.arena_touch_s,
                 self.stats.arena_register_s)  # fmt: skip

    def _new_arena(self, allocs: list[tuple[int, Any]]) -> HostArena | None:
        total = sum(_nbytes(d) for _, d in allocs)
        if total == 0:
            return None
        arena = HostArena(total, self.ops, touch=self.touch)
        self._arenas.append(arena)
        offset = 0
        for ptr, data in allocs:  # address order: device neighbours are host neighbours
            self._slots[ptr] = Slot(arena, offset, _nbytes(data))
            offset += _nbytes(data)
        warm_up = getattr(self.ops, "warm_up", None)
        if warm_up is not None and not self.is_asleep(*allocs[0]):
            # Streams, events and the first transfer through the new registration cost a few
            # ms once: pay them here rather than in the first sleep.
            warm_up(allocs[0][0], self._slots[allocs[0][0]].host)
        return arena

    def _drop_arenas(self) -> None:
        for ptr, data in self.allocations():
            if getattr(data, "cpu_backup_tensor", None) is not None and ptr in self._slots:
                data.cpu_backup_tensor = None
        self._slots.clear()
        self._backed.clear()
        self._clean.clear()
        for arena in self._arenas:
            arena.close()
        self._arenas.clear()

    def _ensure_slots(self, allocs: list[tuple[int, Any]]) -> None:
        missing = [(p, d) for p, d in allocs if p not in self._slots or self._slots[p].nbytes != _nbytes(d)]
        if missing:
            started = time.perf_counter()
            arena = self._new_arena(missing)
            self.stats.late_arena_bytes += arena.nbytes if arena else 0
            self.stats.late_arena_s += time.perf_counter() - started
            log.warning("fast backend: %d allocations (%.3f GiB) to offload were not in the prepared arena; "
                        "registered %.3f s of host memory during this sleep", len(missing),
                        sum(_nbytes(d) for _, d in missing) / 2**30, time.perf_counter() - started)  # fmt: skip

    # ------------------------------------------------------------------ sleep / wake

    def sleep(self, offload: Iterable[str], discard: Iterable[str], links: Sequence[LinkShare] = ()) -> dict[str, Any]:
        """Release every mapped allocation of `offload | discard`; copy `offload` first, over
        the planned `links` (the own link alone when empty). A relay that fails finishes the
        sleep on the own link: an allocation is released only once its bytes have landed."""
        offload, discard = frozenset(offload), frozenset(discard)
        if not links:
            return self._sleep(offload, discard, ())
        try:
            return self._sleep(offload, discard, links)
        except RelayFailed as exc:
            log.warning("fast backend: %s; finishing the sleep on the own link", exc)
            self.ops.synchronize()
            last = self._sleep(offload, discard, ())
            last["relay_failed"] = str(exc)
            return last

    def _sleep(self, offload: frozenset[str], discard: frozenset[str], links: Sequence[LinkShare]) -> dict[str, Any]:
        started = time.perf_counter()
        self.wait_prepared()
        waited = time.perf_counter()
        self._prune_backed()
        allocs = [(p, d) for p, d in self.allocations(offload | discard) if not self.is_asleep(p, d)]
        dropped = [(p, d) for p, d in allocs if d.tag not in offload]
        clean = [(p, d) for p, d in allocs if d.tag in offload and p in self._clean]
        kept = [(p, d) for p, d in allocs if d.tag in offload and p not in self._clean]
        if clean and self.verify_clean:
            self._verify(clean)  # before anything is released: a refused sleep leaves all mapped
        # Discarded memory first: the caller has synchronized, so nothing is reading it, and
        # the driver's unmap (synchronous for most uses) has no copy to wait for yet.
        for ptr, data in dropped:
            self._release(ptr, data, backed=False)
        # Clean allocations: their slot already holds their bytes.
        for ptr, data in clean:
            self._release(ptr, data, backed=True)
        unmapped = time.perf_counter()
        copies: list[Copy] = []
        by_lane: dict[str, int] = {}
        if kept:
            self._ensure_slots(kept)
            copies = plan_copies([(p, self._slots[p].host, _nbytes(d)) for p, d in kept], self.chunk_bytes)
            lanes, relays = self._lanes(links)
            try:
                events = self._issue_copies_out(copies, lanes)
                # Events complete in any order across lanes; waiting in issue order means that
                # after event k every copy up to k is done, so the allocations ending in k are free.
                for c, (lane, event) in zip(copies, events, strict=True):
                    _wait_on(self.ops, lane, event)
                    for i in c.completes:
                        self._release(*kept[i], backed=True)
            finally:
                self._close_relays(relays)
            by_lane = lanes.bytes_by_lane()
        done = time.perf_counter()
        self.stats.last = {
            "op": "sleep", "offloaded_bytes": sum(_nbytes(d) for _, d in kept),
            "clean_bytes": sum(_nbytes(d) for _, d in clean),
            "discarded_bytes": sum(_nbytes(d) for _, d in dropped), "allocations": len(allocs),
            "copies": len(copies), "wait_prepare_s": waited - started, "discard_s": unmapped - waited,
            "offload_s": done - unmapped, "total_s": done - started, "bytes_by_lane": by_lane,
        }  # fmt: skip
        return self.stats.last

    def _verify(self, clean: list[tuple[int, Any]]) -> None:
        """Debug mode: the device bytes of every clean allocation equal its host copy."""
        total = sum(_nbytes(d) for _, d in clean)
        scratch = HostArena(total, self.ops, touch=False)
        try:
            offsets, offset = [], 0
            for _, data in clean:
                offsets.append(offset)
                offset += _nbytes(data)
            spans = [(p, scratch.ptr + o, _nbytes(d)) for (p, d), o in zip(clean, offsets, strict=True)]
            self._copy_out(plan_copies(spans, self.chunk_bytes))
            for (ptr, data), o in zip(clean, offsets, strict=True):
                slot = self._slots[ptr]
                if not torch.equal(scratch.view(o, slot.nbytes), slot.arena.view(slot.offset, slot.nbytes)):
                    raise CleanCopyMismatch(
                        f"allocation at {ptr:#x} of tag {data.tag!r} ({slot.nbytes} bytes) changed since its host "
                        f"copy was made, but the runner declares {data.tag!r} read-only (ModelRunner.read_only_tags); "
                        "fix the runner's declaration (a runner that writes its weights must not list them)")
        finally:
            scratch.close()

    def _release(self, ptr: int, data: Any, *, backed: bool) -> None:
        self._unmap_one(ptr, data)
        if backed:
            self._backed.add(ptr)
            data.cpu_backup_tensor = self._slots[ptr].arena.view(self._slots[ptr].offset, _nbytes(data))
        else:
            self._backed.discard(ptr)
            self._clean.discard(ptr)
            data.cpu_backup_tensor = None

    def wake(self, tags: Iterable[str] | None = None, gate: MemoryGate | None = None,
             links: Sequence[LinkShare] = ()) -> dict[str, Any]:  # fmt: skip
        """Map every asleep allocation of `tags` (all when None) back at its address and
        restore the ones with a host copy, over the planned `links` (the own link alone when
        empty); returns once the bytes are on the device. Mapping is pipelined with copying:
        allocation i+1 is mapped while i's bytes travel. With a `gate`, each map waits for
        free device memory; when the wait expires, the copies in flight land, every
        allocation this wake mapped is unmapped again and MemoryWaitExpired goes up with
        slots, host copies and flags as before the wake. A relay that fails is rolled back
        the same way and the wake runs again on the own link (the host copies still stand)."""
        if not links:
            return self._wake(tags, gate, ())
        try:
            return self._wake(tags, gate, links)
        except RelayFailed as exc:
            log.warning("fast backend: %s; running the wake again on the own link", exc)
            last = self._wake(tags, gate, ())
            last["relay_failed"] = str(exc)
            return last

    def _wake(self, tags: Iterable[str] | None, gate: MemoryGate | None, links: Sequence[LinkShare]) -> dict[str, Any]:
        started = time.perf_counter()
        allocs = [(p, d) for p, d in self.allocations(tags) if self.is_asleep(p, d)]
        if gate is not None:
            gate.expect(sum(_nbytes(d) for _, d in allocs))
        self.ops.streams_after_current()
        lanes, relays = self._lanes(links)
        copies = _RestoreCopies(lanes, self.chunk_bytes, self.observer)
        map_s = 0.0
        # Allocations with bytes to restore first, so that their copies start at once; the
        # others (discarded KV) are mapped while the last copies are still in flight.
        order = [a for a in allocs if a[0] in self._backed] + [a for a in allocs if a[0] not in self._backed]
        backed = sum(1 for a in allocs if a[0] in self._backed)
        mapped: list[tuple[int, Any]] = []
        try:
            for k, (ptr, data) in enumerate(order):
                if k == backed:
                    copies.flush()
                t = time.perf_counter()
                admit(gate, _nbytes(data), partial(self._map_one, data))
                self._mark(ptr, data, asleep=False)
                mapped.append((ptr, data))
                map_s += time.perf_counter() - t
                if ptr in self._backed:
                    copies.add(ptr, self._slots[ptr].host, _nbytes(data))
            copies.flush()
            self.ops.current_after_streams()
            _synchronize_lanes(self.ops, relays)
        except (MemoryWaitExpired, RelayFailed):
            self._unmap_refused(mapped, gate)
            raise
        finally:
            self._close_relays(relays)
        for ptr, data in allocs:
            if ptr in self._backed and data.tag in self.clean_tags:
                self._clean.add(ptr)  # the slot still holds what was just restored from it
            self._backed.discard(ptr)
            data.cpu_backup_tensor = None
        done = time.perf_counter()
        self.stats.last = {"op": "wake", "restored_bytes": copies.restored_bytes, "allocations": len(allocs),
                           "copies": copies.issued, "map_s": map_s, "total_s": done - started,
                           "bytes_by_lane": lanes.bytes_by_lane()}  # fmt: skip
        return self.stats.last

    def _unmap_refused(self, mapped: list[tuple[int, Any]], gate: MemoryGate | None) -> None:
        """Undo the maps of a refused wake. The issued copies land first (they write into
        these allocations); the slots keep their bytes, so `_backed` and `_clean` stand."""
        self.ops.current_after_streams()
        self.ops.synchronize()
        for ptr, data in mapped:
            self._unmap_one(ptr, data)
            if gate is not None:
                gate.release(_nbytes(data))

    def _map_one(self, data: Any) -> None:
        if self.observer is None:
            self._map(data.handle)
            return
        started_s = time.monotonic()
        self._map(data.handle)
        self.observer.mapped(_nbytes(data), started_s)

    def _unmap_one(self, ptr: int, data: Any) -> None:
        try:
            self._unmap(data.handle)
        finally:
            self._mark(ptr, data, asleep=True)
        if self.observer is not None:
            self.observer.unmapped(_nbytes(data))

    # ------------------------------------------------------------------ figures, teardown

    def backed_bytes(self) -> int:
        return sum(self._slots[p].nbytes for p in self._backed)

    def arena_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    def release(self) -> None:
        self.wait_prepared()
        self.ops.synchronize()
        self._drop_arenas()


class FastBackend(CumemBackend):
    """omni-core's memory backend on `FastPath` (see the module docstring).

    With `host_memory` given (the `auto` choice), the arena is registered only when the host
    can hold it (`host_room`); when it cannot, this backend runs as `cumem` on the same
    allocations, and `name` and `choice_reason` say so."""

    name = "fast"

    def __init__(
        self,
        device: torch.device,
        *,
        module: Any = None,
        ops: Any = None,
        arena_tags: tuple[str, ...] = (WEIGHTS_TAG,),
        prepare: str = "load",
        chunk_bytes: int | None = None,
        map_with: str = "driver",
        host_memory: HostMemorySource | None = None,
    ) -> None:
        super().__init__(device, module=module)
        if prepare not in PREPARE_MODES:
            raise ValueError(f"prepare={prepare!r}: use one of {PREPARE_MODES}")
        if host_memory is not None and prepare != "load":
            raise ValueError(f"prepare={prepare!r} with a host-memory check: the check holds the host's "
                             "arena lock through registration, so use prepare='load'")  # fmt: skip
        self.arena_tags = arena_tags
        self.prepare_mode = prepare
        self.path = FastPath(self.allocator, self._mod, self.device, ops=ops, chunk_bytes=chunk_bytes,
                             map_with=map_with)  # fmt: skip
        self._host_memory = host_memory
        self.arena_choice: ArenaChoice | None = None

    @property
    def _fast(self) -> bool:
        return self.arena_choice is None or self.arena_choice.fits

    def track(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        # Called once a tag's tensors are allocated (and after a reload): the weights are
        # final, so their arena can be laid out and registered now, before any sleep.
        if tag not in self.arena_tags or self.prepare_mode == "sleep":
            return
        if self._host_memory is not None and self.arena_choice is None:
            self._choose()
            return
        if self._fast:
            with self._on_device():
                self.path.prepare(self.arena_tags, background=self.prepare_mode == "background")
                self._warm_relays()

    def _warm_relays(self) -> None:
        if self.prepare_mode == "load" and self.supports_links:
            self.path.warm_relays(self.relay_peers())

    def _choose(self) -> None:
        assert self._host_memory is not None
        with host_arena_lock():
            arena_bytes = sum(_nbytes(d) for _, d in self.path.allocations(self.arena_tags))
            self.arena_choice = choose_arena(arena_bytes, self._host_memory())
            self.choice_reason = self.arena_choice.reason
            if self.arena_choice.fits:
                with self._on_device():
                    self.path.prepare(self.arena_tags)
                    self._warm_relays()
        if not self.arena_choice.fits:
            self.name = "cumem"
        log.info("%s", self.choice_reason)

    @property
    def supports_links(self) -> bool:  # type: ignore[override]
        return self._fast

    def relay_peers(self) -> tuple[int, ...]:
        """The other GPUs this process sees that its device reaches peer to peer
        (CUDA_VISIBLE_DEVICES decides what it sees)."""
        own = self.device.index
        if self.device.type != "cuda" or own is None:
            return ()
        peers = range(torch.cuda.device_count())
        return tuple(p for p in peers if p != own and torch.cuda.can_device_access_peer(own, p))

    def _sleep(self, offload: frozenset[str], discard: frozenset[str], links: Sequence[LinkShare] = ()) -> None:
        if not self._fast:
            super()._sleep(offload, discard)
            return
        self.sleep_paths.append("fast" if not links else f"fast over {len(links)} links")
        with self._on_device():
            self.path.sleep(offload, discard, links)

    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None, links: Sequence[LinkShare] = ()) -> None:
        if not self._fast:
            super()._wake(tags, gate)
            return
        with self._on_device():
            self.path.wake(tags, gate, links)

    def declare_read_only(self, tags: Iterable[str], *, verify: bool = False) -> None:
        self.path.clean_tags = frozenset(tags)
        self.path.verify_clean = verify

    def invalidate(self, tags: Iterable[str]) -> None:
        self.path.invalidate(tags)

    def _is_asleep(self, data: Any) -> bool:
        if not self._fast:
            return super()._is_asleep(data)
        return self.path.is_asleep(handle_of(data).d_mem, data)

    def _host_bytes(self) -> int:
        return self.path.backed_bytes() if self._fast else super()._host_bytes()

    def stats(self) -> dict[str, Any]:
        s = self.path.stats
        return {"arena_bytes": self.path.arena_bytes(), "arena_prepare_s": s.arena_prepare_s,
                "arena_touch_s": s.arena_touch_s, "arena_register_s": s.arena_register_s,
                "late_arena_bytes": s.late_arena_bytes, "late_arena_s": s.late_arena_s,
                "snapshot_bytes": s.snapshot_bytes, "snapshot_s": s.snapshot_s, "last": dict(s.last),
                "choice_reason": self.choice_reason}  # fmt: skip

    def release(self) -> None:
        super().release()
        self.path.release()
