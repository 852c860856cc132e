"""The fast backend's bookkeeping on CPU: copy planning, arena layout, release order, and
the lifecycle against the CuMemAllocator stand-ins of test_cumem_versions.

The device calls are replaced by `DeferredOps`, which queues each copy on its stream and
runs it only when an event recorded after it is waited on (or at synchronize), the way a
GPU would: an allocation unmapped before its copy has run makes the queued copy fail, so
the tests catch a release that does not wait for its bytes. Copies from or to host memory
outside a registered arena fail too. The real device path runs in test_gpu_backends.py.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from omni_core.workers.backends import BackendUnavailable, select_backend
from omni_core.workers.backends.base import BackendStateError
from omni_core.workers.backends.copy_plan import plan_copies
from omni_core.workers.backends.fast import FastBackend
from omni_core.workers.backends.host_room import (
    GiB,
    HostMemory,
    choose_arena,
    host_arena_lock,
    margin_bytes,
    read_host_memory,
)

from .test_cumem_versions import GARBAGE, KV, VARIANTS, FakeCumemModule, W, content


class DeferredOps:
    def __init__(self, module: FakeCumemModule, streams: int = 2) -> None:
        self.m = module
        self.streams = [f"stream{i}" for i in range(streams)]
        self.queues: dict[str, list] = {s: [] for s in self.streams}
        self.done = dict.fromkeys(self.streams, 0)
        self.registered: dict[int, int] = {}
        self.copies: list[tuple[str, int]] = []  # (direction, bytes), in issue order
        self.register_calls = 0

    # -- device memory of the fake module: a range may span neighbouring allocations
    def _pieces(self, address: int, nbytes: int):
        end = address + nbytes
        while address < end:
            base = max((p for p in self.m.memory if p <= address), default=None)
            if base is None or address >= base + len(self.m.memory[base]):
                raise RuntimeError(f"copy touches {address:#x}, which is not mapped")
            n = min(end, base + len(self.m.memory[base])) - address
            yield base, address - base, n
            address += n

    def _check_host(self, ptr: int, nbytes: int) -> None:
        if not any(p <= ptr and ptr + nbytes <= p + n for p, n in self.registered.items()):
            raise RuntimeError(f"host range {ptr:#x}+{nbytes} is not in a registered arena")

    def _run(self, op) -> None:
        dst, src, nbytes, to_device = op
        if to_device:
            self._check_host(src, nbytes)
            done = 0
            for base, offset, n in list(self._pieces(dst, nbytes)):
                self.m.memory[base][offset : offset + n] = ctypes.string_at(src + done, n)
                done += n
        else:
            self._check_host(dst, nbytes)
            done = 0
            for base, offset, n in list(self._pieces(src, nbytes)):
                ctypes.memmove(dst + done, bytes(self.m.memory[base][offset : offset + n]), n)
                done += n

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool, stream: str) -> None:
        self.queues[stream].append((dst, src, nbytes, to_device))
        self.copies.append(("h2d" if to_device else "d2h", nbytes))

    def record(self, stream: str):
        return (stream, len(self.queues[stream]))

    def wait(self, event) -> None:
        stream, upto = event  # every op issued on `stream` before the event runs now
        while self.done[stream] < upto:
            self._run(self.queues[stream][self.done[stream]])
            self.done[stream] += 1

    def streams_after_current(self) -> None:
        pass

    def current_after_streams(self) -> None:
        pass

    def synchronize(self) -> None:
        for stream in self.streams:
            self.wait((stream, len(self.queues[stream])))

    def register(self, ptr: int, nbytes: int) -> None:
        self.register_calls += 1
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]


def make(variant: str, sizes_w=(4096, 8192, 12288), sizes_kv=(16384,), **kwargs):
    module = FakeCumemModule(variant)
    ops = DeferredOps(module)
    backend = FastBackend(torch.device("cpu"), module=module, ops=ops, chunk_bytes=5000, **kwargs)
    ptrs = {}
    for tag, fill, sizes in ((W, 0x11, sizes_w), (KV, 0x22, sizes_kv)):
        with backend.pool(tag):
            ptrs[tag] = [backend.allocator.malloc(size, fill) for size in sizes]
        backend.track(tag, [])
    # distinct bytes per allocation and position: a copy landing in the wrong place shows
    for i, p in enumerate(ptrs[W]):
        module.memory[p][:] = bytes((i * 31 + j) % 251 for j in range(len(module.memory[p])))
    return module, ops, backend, ptrs


def snapshot(module, ptrs):
    return [bytes(module.memory[p]) for p in ptrs]


# ---------------------------------------------------------------------- planning


def test_plan_copies_joins_neighbours_and_cuts_chunks():
    copies = plan_copies([(0, 100, 4), (4, 104, 4), (20, 108, 4), (24, 200, 3)], 3)
    assert [(c.device, c.host, c.nbytes, c.completes) for c in copies] == [
        (0, 100, 3, ()),
        (3, 103, 3, (0,)),
        (6, 106, 2, (1,)),  # one run of 8 bytes in 3 copies
        (20, 108, 3, ()),
        (23, 111, 1, (2,)),  # device gap: a run of its own
        (24, 200, 3, (3,)),  # host gap: a run of its own
    ]


def test_plan_copies_covers_every_byte_once_and_completes_every_span_once():
    rng = random.Random(7)
    for _ in range(300):
        spans, dev, host = [], 1000, 50_000
        for _ in range(rng.randint(0, 12)):
            size = rng.choice([0, 1, 5, 64, 100])
            dev += rng.choice([0, 0, 3])
            host += rng.choice([0, 0, 0, 7])
            spans.append((dev, host, size))
            dev, host = dev + size, host + size
        chunk = rng.choice([1, 7, 64, 1000])
        copies = plan_copies(spans, chunk)
        assert all(0 <= c.nbytes <= chunk for c in copies)
        assert sorted(i for c in copies for i in c.completes) == list(range(len(spans)))
        covered = [(c.device + k, c.host + k) for c in copies for k in range(c.nbytes)]
        expected = [(d + k, h + k) for d, h, n in spans for k in range(n)]
        assert sorted(covered) == sorted(expected) and len(set(covered)) == len(covered)
        for c in copies:  # a span is complete only once all its bytes are in copies up to there
            for i in c.completes:
                d, _, n = spans[i]
                last = copies.index(c)
                assert all(any(x.device <= d + k < x.device + x.nbytes for x in copies[: last + 1]) for k in range(n))


def test_plan_copies_refuses_bad_input():
    with pytest.raises(ValueError, match="chunk_bytes"):
        plan_copies([(0, 0, 1)], 0)
    with pytest.raises(ValueError, match="negative"):
        plan_copies([(0, 0, -1)], 4)


# ---------------------------------------------------------------------- lifecycle


@pytest.mark.parametrize("variant", VARIANTS)
def test_level1_round_trip_restores_weights_through_the_prepared_arena(variant):
    module, ops, backend, ptrs = make(variant)
    before = snapshot(module, ptrs[W])
    stats = backend.stats()
    assert stats["arena_bytes"] == 4096 + 8192 + 12288  # exactly the weights, prepared at track()
    assert ops.register_calls == 1 and backend.host_bytes() == 0
    backend.sleep({W}, {KV})
    assert list(backend.sleep_paths) == ["fast"] and module.memory == {}
    assert ops.register_calls == 1  # nothing registered during the sleep
    assert backend.usage() == {W: 0, KV: 0} and backend.host_bytes() == 24576
    # neighbouring allocations travel together, cut at chunk_bytes=5000
    assert [n for d, n in ops.copies if d == "d2h"] == [5000] * 4 + [4576]
    for p in ptrs[W]:  # vLLM's bookkeeping: a view of the slot, and the version's flag
        data = backend.allocator.pointer_to_data[p]
        assert data.cpu_backup_tensor is not None and data.cpu_backup_tensor.numel() == data.handle[1]
        assert backend._is_asleep(data)
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before and content(module, ptrs[KV]) == {GARBAGE}
    assert backend.host_bytes() == 0 and backend.usage() == {W: 24576, KV: 16384}
    assert all(backend.allocator.pointer_to_data[p].cpu_backup_tensor is None for p in ptrs[W])
    for _ in range(3):  # later cycles reuse the arena
        backend.sleep({W}, {KV})
        backend.wake({W, KV})
        assert snapshot(module, ptrs[W]) == before
    assert ops.register_calls == 1
    backend.release()
    assert ops.registered == {}


@pytest.mark.parametrize("variant", VARIANTS)
def test_level2_discards_everything_and_wake_maps_without_copying(variant):
    module, ops, backend, ptrs = make(variant)
    backend.sleep(set(), {W, KV})
    assert module.memory == {} and backend.host_bytes() == 0 and ops.copies == []
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {GARBAGE} and ops.copies == []


@pytest.mark.parametrize("variant", VARIANTS)
def test_partial_sleeps_and_wakes_touch_each_allocation_once(variant):
    module, _, backend, ptrs = make(variant)
    before = snapshot(module, ptrs[W])
    backend.sleep(set(), {KV})
    assert set(module.memory) == set(ptrs[W]) and backend.usage() == {W: 24576, KV: 0}
    backend.sleep({W}, set())  # KV already asleep: not unmapped twice (the fake would raise)
    assert module.memory == {}
    backend.wake({W})
    assert set(module.memory) == set(ptrs[W]) and snapshot(module, ptrs[W]) == before
    backend.wake({KV})
    assert set(module.memory) == set(ptrs[W] + ptrs[KV])
    backend.sleep({W}, {KV})
    backend.wake({KV})  # KV first, weights still asleep with their bytes on the host
    assert set(module.memory) == set(ptrs[KV]) and backend.host_bytes() == 24576
    backend.wake({W})
    assert snapshot(module, ptrs[W]) == before


def test_offloading_a_tag_without_an_arena_registers_a_late_one():
    module, ops, backend, ptrs = make("0.26")
    kv_before = snapshot(module, ptrs[KV])
    backend.sleep({W, KV}, set())  # KV offloaded too: not in the prepared arena
    assert ops.register_calls == 2
    stats = backend.stats()
    assert stats["late_arena_bytes"] == 16384 and stats["arena_bytes"] == 24576 + 16384
    backend.wake({W, KV})
    assert snapshot(module, ptrs[KV]) == kv_before
    backend.sleep({W, KV}, set())
    assert ops.register_calls == 2  # the late slots stay


def test_prepare_is_a_no_op_when_the_arena_fits_and_rebuilds_when_it_does_not():
    _module, ops, backend, ptrs = make("0.26")
    backend.track(W, [])  # e.g. after ReloadWeights: same allocations
    assert ops.register_calls == 1
    with backend.pool(W):
        ptrs[W].append(backend.allocator.malloc(2048, 0x33))
    backend.track(W, [])
    assert ops.register_calls == 2 and backend.stats()["arena_bytes"] == 24576 + 2048
    assert len(ops.registered) == 1  # the old arena was unregistered


@pytest.mark.parametrize("mode", ["background", "sleep"])
def test_prepare_modes(mode):
    module, ops, backend, ptrs = make("0.26", prepare=mode)
    before = snapshot(module, ptrs[W])
    if mode == "sleep":
        assert ops.register_calls == 0
    backend.sleep({W}, {KV})  # joins the background thread, or lays the arena out now
    assert ops.register_calls == 1 and backend.stats()["late_arena_bytes"] == (0 if mode == "background" else 24576)
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before


def test_release_order_is_checked_by_the_deferred_copies():
    """Self-check of the double: unmapping before waiting makes the queued copy fail."""
    module, ops, backend, ptrs = make("0.26")
    path = backend.path
    slot = path._slots[ptrs[W][0]]
    ops.copy(slot.host, ptrs[W][0], 4096, False, ops.streams[0])
    module.unmap_and_release(backend.allocator.pointer_to_data[ptrs[W][0]].handle)
    with pytest.raises(RuntimeError, match="not mapped"):
        ops.synchronize()


def test_select_fast_names_itself_when_unavailable():
    with pytest.raises(BackendUnavailable, match=r"backend 'fast' is unavailable: the cumem backend needs a CUDA"):
        select_backend("fast", torch.device("cpu"))


def test_a_prepare_mode_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match=r"prepare='sometimes': use one of \('load', 'background', 'sleep'\)"):
        make("0.26", prepare="sometimes")


def test_mapping_goes_through_the_driver_only_for_vllms_own_cuda_handles():
    # On CPU doubles the fake module maps; on CUDA with vLLM's extension the driver does
    # (cuda_driver.py; the GPU tests run that path). An unknown choice is refused by name.
    _, _, backend, _ = make("0.26")
    assert backend.path.map_with == "vllm"
    with pytest.raises(ValueError, match=r"map_with='ctypes': use one of \('driver', 'vllm'\)"):
        make("0.26", map_with="ctypes")


class Recorder:
    """A CopyObserver that keeps what it is told, in order."""

    def __init__(self) -> None:
        self.events: list[tuple] = []

    def copy_issued(self, stream, nbytes: int, to_device: bool) -> None:
        self.events.append(("copy", stream, nbytes, to_device))

    def mapped(self, nbytes: int, started_s: float) -> None:
        self.events.append(("map", nbytes, started_s))

    def unmapped(self, nbytes: int) -> None:
        self.events.append(("unmap", nbytes))


def test_an_observer_sees_every_copy_map_and_unmap_with_its_bytes_and_changes_nothing():
    module, _ops, backend, ptrs = make("0.26")
    before = snapshot(module, ptrs[W])
    seen = Recorder()
    backend.path.observer = seen
    backend.sleep({W}, {KV})
    # KV discarded first, then each weight allocation unmapped once its copies landed
    assert [e for e in seen.events if e[0] == "unmap"] == [
        ("unmap", 16384),
        ("unmap", 4096),
        ("unmap", 8192),
        ("unmap", 12288),
    ]
    copies = [e for e in seen.events if e[0] == "copy"]
    assert [(n, to_dev) for _, _, n, to_dev in copies] == [(5000, False)] * 4 + [(4576, False)]
    assert [s for _, s, _, _ in copies] == ["stream0", "stream1"] * 2 + ["stream0"]  # the streams the copies ran on
    assert seen.events.index(("unmap", 16384)) < seen.events.index(copies[0])  # the discard frees before any copy
    seen.events.clear()
    backend.wake({W, KV})
    maps = [e for e in seen.events if e[0] == "map"]
    assert sorted(n for _, n, _ in maps) == [4096, 8192, 12288, 16384]
    assert all(isinstance(t, float) for _, _, t in maps)
    assert sum(n for kind, _, n, to_dev in (e for e in seen.events if e[0] == "copy") if to_dev) == 24576
    assert snapshot(module, ptrs[W]) == before
    # off again: the same cycle runs without calling anything
    backend.path.observer = None
    seen.events.clear()
    backend.sleep({W}, {KV})
    backend.wake({W, KV})
    assert seen.events == [] and snapshot(module, ptrs[W]) == before


# ---------------------------------------------------------------------- auto: fast when the host can hold the arena

WEIGHT_BYTES = 4096 + 8192 + 12288  # make()'s weights: the arena `auto` must find room for


def host(available_bytes: int, total_bytes: int = 64 * GiB):
    return lambda: HostMemory(total_bytes, available_bytes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_auto_registers_the_arena_when_the_host_holds_it_with_the_margin(variant):
    room = WEIGHT_BYTES + margin_bytes(64 * GiB)
    module, ops, backend, ptrs = make(variant, host_memory=host(room))
    before = snapshot(module, ptrs[W])
    assert backend.name == "fast" and backend.arena_choice.fits and ops.register_calls == 1
    assert backend.choice_reason.startswith("auto chose 'fast': the pinned weight arena needs 24.0 KiB")
    assert backend.stats()["choice_reason"] == backend.choice_reason
    backend.sleep({W}, {KV})
    backend.wake({W, KV})
    assert list(backend.sleep_paths) == ["fast"] and snapshot(module, ptrs[W]) == before


@pytest.mark.parametrize("variant", VARIANTS)
def test_auto_runs_as_cumem_when_the_host_lacks_room_for_the_arena(variant):
    room = WEIGHT_BYTES + margin_bytes(64 * GiB) - 1  # one byte short
    module, ops, backend, ptrs = make(variant, host_memory=host(room))
    before = snapshot(module, ptrs[W])
    assert backend.name == "cumem" and not backend.arena_choice.fits
    assert ops.register_calls == 0 and backend.stats()["arena_bytes"] == 0  # nothing pinned at load
    assert "auto chose 'cumem'" in backend.choice_reason and "backend='fast'" in backend.choice_reason
    backend.sleep({W}, {KV})
    assert backend.sleep_paths[-1] != "fast" and ops.copies == []  # vLLM's own path moved the bytes
    assert backend.host_bytes() == WEIGHT_BYTES
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before
    backend.track(W, [])  # a reload's track: the choice stands, still no arena
    assert ops.register_calls == 0 and backend.name == "cumem"


def test_auto_counts_the_arenas_of_stages_registered_before_it():
    """Each rank reads the host's memory under the host-wide lock, after the arenas registered
    before it took their bytes: the second of two stages that fit only alone runs as cumem."""
    available = [WEIGHT_BYTES + margin_bytes(64 * GiB) + 100]

    def shrinking() -> HostMemory:  # what /proc/meminfo would say after each registration
        return HostMemory(64 * GiB, available[0])

    first = make("flags", host_memory=shrinking)[2]
    available[0] -= first.stats()["arena_bytes"]
    second = make("flags", host_memory=shrinking)[2]
    assert (first.name, second.name) == ("fast", "cumem")


def test_the_host_memory_figures_and_the_margin():
    assert margin_bytes(8 * GiB) == 4 * GiB and margin_bytes(512 * GiB) == int(51.2 * GiB)
    assert choose_arena(GiB, HostMemory(64 * GiB, 64 * GiB)).fits
    assert not choose_arena(58 * GiB, HostMemory(64 * GiB, 64 * GiB)).fits  # 6.4 GiB margin


def test_read_host_memory_parses_meminfo_and_names_a_bad_file(tmp_path):
    good = tmp_path / "meminfo"
    good.write_text("MemTotal:       65536 kB\nMemFree:   100 kB\nMemAvailable:   32768 kB\n")
    assert read_host_memory(str(good)) == HostMemory(65536 * 1024, 32768 * 1024)
    bad = tmp_path / "bad"
    bad.write_text("MemTotal: 1 kB\n")
    with pytest.raises(RuntimeError, match="MemAvailable"):
        read_host_memory(str(bad))
    assert read_host_memory().available_bytes > 0  # this machine's own


def test_the_host_arena_lock_is_exclusive_and_released(tmp_path):
    import fcntl
    import os

    with host_arena_lock(str(tmp_path)):
        fd = os.open(tmp_path / "omni-core-host-arena.lock", os.O_RDWR)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free again once the holder left
    os.close(fd)


def test_auto_with_a_prepare_mode_that_cannot_hold_the_lock_is_refused():
    with pytest.raises(ValueError, match="prepare='load'"):
        make("flags", host_memory=host(64 * GiB), prepare="background")


class _DeviceTensorAt:
    """A uint8 tensor of `nbytes` at `address` of the fake device: what host_view reads of one
    (its storage's address, dtype, shape and strides)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.address, self.like = address, torch.empty(nbytes, dtype=torch.uint8)
        self.dtype, self.shape = self.like.dtype, self.like.shape

    def untyped_storage(self):
        return type("Storage", (), {"data_ptr": lambda _: self.address})()

    def __getattr__(self, name):
        return getattr(self.like, name)


@pytest.mark.parametrize("read_only", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_an_update_written_into_the_arena_while_asleep_is_what_the_wake_brings(variant, read_only):
    module, ops, backend, ptrs = make(variant)
    assert backend.supports_host_refit
    if read_only:  # a later sleep copies nothing: the slot must hold the refit bytes
        backend.declare_read_only({W})
    before = snapshot(module, ptrs[W])
    with pytest.raises(BackendStateError, match="not asleep"):
        backend.host_view(W, _DeviceTensorAt(ptrs[W][1], 16))
    backend.sleep({W}, {KV})
    view = backend.host_view(W, _DeviceTensorAt(ptrs[W][1] + 64, 128))  # inside the second allocation
    view.copy_(torch.full((128,), 0x5A, dtype=torch.uint8))
    assert module.memory == {}  # written into the host copy, the device untouched
    backend.wake({W, KV})
    want = bytearray(before[1])
    want[64:192] = bytes([0x5A]) * 128
    assert snapshot(module, ptrs[W]) == [before[0], bytes(want), before[2]]
    copied = len(ops.copies)
    backend.sleep({W}, {KV})  # the refit bytes are the host copy from now on
    assert read_only == all(d == "h2d" for d, _ in ops.copies[copied:])  # read-only: no device->host copy
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == [before[0], bytes(want), before[2]]
    backend.sleep(set(), {W, KV})  # level 2: no host copy to write into
    with pytest.raises(BackendStateError, match="no host copy"):
        backend.host_view(W, _DeviceTensorAt(ptrs[W][1], 16))
    backend.release()
