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
- **Map while copying on wake.** Allocation i+1 is mapped while i's bytes are on the way
  back; with `run_bytes`, touching allocations of a tag are mapped as one (runs.py).
- **Clean weights sleep without a copy.** For tags the runner declares unchanged by
  execution (`ModelRunner.read_only_tags`: inference weights), the arena keeps a valid copy
  while the tag is awake: made once after load (or after a reload), and still valid after
  a wake restored from it. A level-1 sleep of such a tag only unmaps. A reload, an
  in-place update or a discard invalidates the copy; `verify_clean` compares the device
  bytes with the copy at each clean sleep and refuses the sleep if a runner lied.

Allocations are mapped with the CUDA driver's calls made directly (`cuda_driver.py`: vLLM's
calls on vLLM's handles, 51.6 GB/s instead of 46.4-47.7 through its extension on an H200,
benchmarks/results/wake_gpu.md; `map_with="vllm"` uses the extension),
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
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from omni_core.fsm.tags import WEIGHTS_TAG
from omni_core.protocol import LinkShare
from omni_core.workers.backends.copy_plan import Copy, CopyObserver, RestoreCopies, nbytes_of, plan_copies
from omni_core.workers.backends.cuda_driver import CudaDriver
from omni_core.workers.backends.cuda_ops import DEFAULT_STREAMS, CudaOps
from omni_core.workers.backends.host_arena import HostArena, Slot, verify_clean
from omni_core.workers.backends.lanes import (
    DEFAULT_SLOT_BYTES,
    DirectLane,
    Lane,
    LanePicker,
    RelayFailed,
    RelayLane,
    synchronize_lanes,
    wait_on,
)
from omni_core.workers.backends.lanes import warm_relays as warm_relay_peers
from omni_core.workers.backends.runs import DriverSpans, SpanMapper, make_runs
from omni_core.workers.memory_gate import MemoryGate, MemoryWaitExpired, admit

log = logging.getLogger("omni_core.backends.fast")

MiB = 1 << 20
DEFAULT_CHUNK_BYTES = 128 * MiB
MAP_WITH = ("driver", "vllm")  # how allocations are mapped and unmapped: cuda_driver.py, or vLLM's extension


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
        run_bytes: int | None = None,
        spans: SpanMapper | None = None,
        runs_optional: bool = False,
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
        self.map_with = (
            "driver"
            if map_with == "driver" and raw_map is not None and self.device.type == "cuda" and torch.version.hip is None
            else "vllm"
        )
        if self.map_with == "driver":
            driver = CudaDriver()
            self._map = lambda h: driver.create_and_map(*h)
            self._unmap = lambda h: driver.unmap_and_release(*h)
            spans = spans or DriverSpans(driver, self.device.index or 0, self.ops)
        # runs.py; with `runs_optional` (the fast backend's default) none where they cannot be made
        self.runs, self.runs_off_reason = make_runs(allocator, module, spans, run_bytes, required=not runs_optional)
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
        return sorted(
            (ptr, d) for ptr, d in list(self.allocator.pointer_to_data.items()) if wanted is None or d.tag in wanted
        )

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
            if self.runs is not None:  # at load, not in the background: the runner may use the weights
                awake = [(p, d) for p, d in self.allocations(tags) if not self.is_asleep(p, d)]
                self.runs.adopt_all(awake, lambda _, data: self._unmap(data.handle))
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
        allocs = [(p, d) for p, d in allocs if p in self._slots and self._slots[p].nbytes == nbytes_of(d)]
        if not allocs:
            return
        started = time.perf_counter()
        copies = plan_copies([(p, self._slots[p].host, nbytes_of(d)) for p, d in allocs], self.chunk_bytes)
        self._copy_out(copies)
        self._clean.update(p for p, _ in allocs)
        self.stats.snapshot_bytes = sum(nbytes_of(d) for _, d in allocs)
        self.stats.snapshot_s = time.perf_counter() - started
        log.info(
            "fast backend: host copy of %.3f GiB of read-only %s made in %.3f s; their sleeps copy nothing",
            self.stats.snapshot_bytes / 2**30,
            list(tags),
            self.stats.snapshot_s,
        )

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
        """Open each peer's context and send a byte through a relay and back, at load (lanes.py)."""
        awake = [(p, d) for p, d in self.allocations() if p in self._slots and not self.is_asleep(p, d)]
        if awake:
            warm_relay_peers(self.ops, awake[0][0], self._slots[awake[0][0]].host, peers)

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
        if all(p in self._slots and self._slots[p].nbytes == nbytes_of(d) for p, d in allocs):
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
        log.info(
            "fast backend: host arena of %.3f GiB for %d allocations of %s prepared in %.3f s "
            "(fault-in %.3f s, cudaHostRegister %.3f s)",
            self.stats.arena_bytes / 2**30,
            len(allocs),
            list(tags),
            self.stats.arena_prepare_s,
            self.stats.arena_touch_s,
            self.stats.arena_register_s,
        )

    def _new_arena(self, allocs: list[tuple[int, Any]]) -> HostArena | None:
        total = sum(nbytes_of(d) for _, d in allocs)
        if total == 0:
            return None
        arena = HostArena(total, self.ops, touch=self.touch)
        self._arenas.append(arena)
        offset = 0
        for ptr, data in allocs:  # address order: device neighbours are host neighbours
            self._slots[ptr] = Slot(arena, offset, nbytes_of(data))
            offset += nbytes_of(data)
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
        missing = [(p, d) for p, d in allocs if p not in self._slots or self._slots[p].nbytes != nbytes_of(d)]
        if missing:
            started = time.perf_counter()
            arena = self._new_arena(missing)
            self.stats.late_arena_bytes += arena.nbytes if arena else 0
            self.stats.late_arena_s += time.perf_counter() - started
            log.warning(
                "fast backend: %d allocations (%.3f GiB) to offload were not in the prepared arena; "
                "registered %.3f s of host memory during this sleep",
                len(missing),
                sum(nbytes_of(d) for _, d in missing) / 2**30,
                time.perf_counter() - started,
            )

    # ------------------------------------------------------------------ sleep / wake

    def sleep(
        self,
        offload: Iterable[str],
        discard: Iterable[str],
        links: Sequence[LinkShare] = (),
        *,
        release_late: bool = False,
    ) -> dict[str, Any]:
        """Release every mapped allocation of `offload | discard`; copy `offload` first, over
        the planned `links` (the own link alone when empty). A relay that fails finishes the
        sleep on the own link: an allocation is released only once its bytes have landed.

        Each allocation is released as soon as its copy lands, so that a stage waking on the
        same device meanwhile gets the memory early. With `release_late` (a swap whose
        incoming stage fits beside this one: Sleep.incoming_bytes) nothing is released until
        the last copy has landed, then everything at once: releases during the copies slow
        the incoming stage's host->device copies (benchmarks/results/swap_gpu.md)."""
        offload, discard = frozenset(offload), frozenset(discard)
        if not links:
            return self._sleep(offload, discard, (), release_late)
        try:
            return self._sleep(offload, discard, links, release_late)
        except RelayFailed as exc:
            log.warning("fast backend: %s; finishing the sleep on the own link", exc)
            self.ops.synchronize()
            last = self._sleep(offload, discard, (), release_late)
            last["relay_failed"] = str(exc)
            return last

    def _sleep(
        self, offload: frozenset[str], discard: frozenset[str], links: Sequence[LinkShare], release_late: bool
    ) -> dict[str, Any]:
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
        late = release_late and bool(kept)  # with nothing to copy, there is nothing to wait for
        # Discarded memory first: the caller has synchronized, so nothing is reading it, and
        # the driver's unmap (synchronous for most uses) has no copy to wait for yet. Clean
        # allocations: their slot already holds their bytes.
        if not late:
            self._release_all(dropped, clean, [])
        unmapped = time.perf_counter()
        copies: list[Copy] = []
        by_lane: dict[str, int] = {}
        if kept:
            self._ensure_slots(kept)
            copies = plan_copies([(p, self._slots[p].host, nbytes_of(d)) for p, d in kept], self.chunk_bytes)
            lanes, relays = self._lanes(links)
            try:
                events = self._issue_copies_out(copies, lanes)
                # Events complete in any order across lanes; waiting in issue order means that
                # after event k every copy up to k is done, so the allocations ending in k are free.
                for c, (lane, event) in zip(copies, events, strict=True):
                    wait_on(self.ops, lane, event)
                    for i in c.completes if not late else ():
                        self._release(*kept[i], backed=True)
            finally:
                self._close_relays(relays)
            by_lane = lanes.bytes_by_lane()
        copied = time.perf_counter()
        if late:  # every copy has landed
            self._release_all(dropped, clean, kept)
        done = time.perf_counter()
        self.stats.last = {
            "op": "sleep",
            "offloaded_bytes": sum(nbytes_of(d) for _, d in kept),
            "clean_bytes": sum(nbytes_of(d) for _, d in clean),
            "discarded_bytes": sum(nbytes_of(d) for _, d in dropped),
            "allocations": len(allocs),
            "copies": len(copies),
            "wait_prepare_s": waited - started,
            "discard_s": unmapped - waited,
            "offload_s": copied - unmapped,
            "release_late": late,
            "late_release_s": done - copied,
            "total_s": done - started,
            "bytes_by_lane": by_lane,
        }
        return self.stats.last

    def _release_all(
        self, dropped: list[tuple[int, Any]], clean: list[tuple[int, Any]], kept: list[tuple[int, Any]]
    ) -> None:
        for ptr, data in dropped:
            self._release(ptr, data, backed=False)
        for ptr, data in (*clean, *kept):
            self._release(ptr, data, backed=True)

    def _verify(self, clean: list[tuple[int, Any]]) -> None:
        """Debug mode: the device bytes of every clean allocation equal its host copy."""
        verify_clean(clean, self._slots, self.ops, lambda spans: self._copy_out(plan_copies(spans, self.chunk_bytes)))

    def _release(self, ptr: int, data: Any, *, backed: bool) -> None:
        self._unmap_one(ptr, data)
        if backed:
            self._backed.add(ptr)
            data.cpu_backup_tensor = self._slots[ptr].arena.view(self._slots[ptr].offset, nbytes_of(data))
        else:
            self._backed.discard(ptr)
            self._clean.discard(ptr)
            data.cpu_backup_tensor = None

    def wake(
        self, tags: Iterable[str] | None = None, gate: MemoryGate | None = None, links: Sequence[LinkShare] = ()
    ) -> dict[str, Any]:
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
            gate.expect(sum(nbytes_of(d) for _, d in allocs))
        self.ops.streams_after_current()
        lanes, relays = self._lanes(links)
        copies = RestoreCopies(lanes, self.chunk_bytes, self.observer)
        map_s = 0.0
        # Allocations with bytes to restore first, so that their copies start at once; the
        # others (discarded KV) are mapped while the last copies are still in flight.
        restored = self._groups([a for a in allocs if a[0] in self._backed])
        groups = restored + self._groups([a for a in allocs if a[0] not in self._backed])
        mapped: list[tuple[int, Any]] = []
        try:
            for k, group in enumerate(groups):
                if k == len(restored):
                    copies.flush()
                t = time.perf_counter()
                admit(gate, sum(nbytes_of(d) for _, d in group), partial(self._map_group, group))
                map_s += time.perf_counter() - t
                for ptr, data in group:
                    self._mark(ptr, data, asleep=False)
                    mapped.append((ptr, data))
                    if ptr in self._backed:
                        copies.add(ptr, self._slots[ptr].host, nbytes_of(data))
            copies.flush()
            self.ops.current_after_streams()
            synchronize_lanes(self.ops, relays)
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
        self.stats.last = {
            "op": "wake",
            "restored_bytes": copies.restored_bytes,
            "allocations": len(allocs),
            "copies": copies.issued,
            "map_s": map_s,
            "total_s": done - started,
            "bytes_by_lane": lanes.bytes_by_lane(),
        }
        return self.stats.last

    def _unmap_refused(self, mapped: list[tuple[int, Any]], gate: MemoryGate | None) -> None:
        """Undo the maps of a refused wake. The issued copies land first (they write into
        these allocations); the slots keep their bytes, so `_backed` and `_clean` stand."""
        self.ops.current_after_streams()
        self.ops.synchronize()
        for ptr, data in mapped:
            self._unmap_one(ptr, data)
            if gate is not None:
                gate.release(nbytes_of(data))

    def _groups(self, allocs: list[tuple[int, Any]]) -> list[list[tuple[int, Any]]]:
        return self.runs.group(allocs) if self.runs is not None else [[a] for a in allocs]

    def _map_group(self, group: list[tuple[int, Any]]) -> None:
        started_s = time.monotonic()
        ptr, data = group[0]
        if self.runs is not None and len(group) > 1:
            self.runs.map(group)
        elif self.runs is not None and self.runs.owns(ptr):
            self.runs.readopt(ptr)
        else:
            self._map(data.handle)
        if self.observer is not None:
            self.observer.mapped(sum(nbytes_of(d) for _, d in group), started_s)

    def _unmap_one(self, ptr: int, data: Any) -> None:
        try:
            if self.runs is not None and self.runs.owns(ptr):
                self.runs.release(ptr)
            else:
                self._unmap(data.handle)
        finally:
            self._mark(ptr, data, asleep=True)
        if self.observer is not None:
            self.observer.unmapped(nbytes_of(data))

    # ------------------------------------------------------------------ figures, teardown

    def backed_bytes(self) -> int:
        return sum(self._slots[p].nbytes for p in self._backed)

    def arena_bytes(self) -> int:
        return sum(a.nbytes for a in self._arenas)

    def release(self) -> None:
        self.wait_prepared()
        self.ops.synchronize()
        self._drop_arenas()
