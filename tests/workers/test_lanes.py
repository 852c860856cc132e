"""Lanes on CPU: relays through a peer GPU, checked against a scheduler that runs the
streams' queued work in a random order, as a GPU's engines may.

`ScheduledOps` keeps one FIFO per stream (the rank's copy streams, a peer's stream, the hop
stream) and runs, at each step, the head of a random stream that can run (a wait on an
event not yet reached cannot). A relay that writes a staging slot before its previous hop
has read it, or hops before the bytes landed, then moves the wrong bytes for some seed, and
the round trips below compare every byte. Staging memory, the fake device's memory and the
registered host arena are three address spaces; a copy touching anything else fails.
"""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from omni_core.protocol import LinkShare
from omni_core.workers.backends.base import BackendStateError
from omni_core.workers.backends.fast import FastBackend
from omni_core.workers.backends.lanes import LanePicker, RelayFailed
from omni_core.workers.backends.portable import PortableBackend

from .test_cumem_versions import KV, FakeCumemModule, W

STAGING_BASE = 0x5000_0000_0000


class Event:
    def __init__(self, stream: str, index: int) -> None:
        self.stream, self.index = stream, index


class ScheduledOps:
    def __init__(
        self, module: FakeCumemModule, seed: int, *, fail_relay_at: int | None = None, fail_staging: bool = False
    ) -> None:
        self.m = module
        self.rng = random.Random(seed)
        self.streams = ["s0", "s1"]
        self.queues: dict[str, list] = {s: [] for s in self.streams}
        self.done: dict[str, int] = dict.fromkeys(self.streams, 0)
        self.registered: dict[int, int] = {}
        self.staging_memory: dict[int, bytearray] = {}
        self.relay_copies = 0
        self.fail_relay_at, self.fail_staging = fail_relay_at, fail_staging

    # -- streams and events
    def _stream(self, name: str) -> str:
        if name not in self.queues:
            self.queues[name], self.done[name] = [], 0
        return name

    def peer_stream(self, peer: int) -> str:
        return self._stream(f"peer{peer}")

    def hop_stream(self, peer: int) -> str:
        return self._stream(f"hop{peer}")

    def record(self, stream: str) -> Event:
        return Event(stream, len(self.queues[stream]))

    def stream_wait(self, stream: str, event: Event) -> None:
        self.queues[stream].append(("wait", event))

    def after_current(self, stream: str) -> None:
        pass

    def streams_after_current(self) -> None:
        pass

    def current_after_streams(self) -> None:
        pass

    def _reached(self, event: Event) -> bool:
        return self.done[event.stream] >= event.index

    def _runnable(self) -> list[str]:
        ready = []
        for s, q in self.queues.items():
            if self.done[s] < len(q):
                op = q[self.done[s]]
                if op[0] != "wait" or self._reached(op[1]):
                    ready.append(s)
        return ready

    def _step(self) -> bool:
        ready = self._runnable()
        if not ready:
            return False
        s = self.rng.choice(ready)
        op = self.queues[s][self.done[s]]
        if op[0] == "copy":
            self._move(*op[1:])
        self.done[s] += 1
        return True

    def wait(self, event: Event) -> None:
        while not self._reached(event):
            assert self._step(), f"deadlock waiting on {event.stream}@{event.index}"

    def synchronize(self) -> None:
        while self._step():
            pass
        assert all(self.done[s] == len(q) for s, q in self.queues.items()), "a stream waits on an event never reached"

    # -- memory: a range may span neighbouring device allocations
    def _pieces(self, address: int, nbytes: int):
        """(buffer or None for host, offset, length) covering [address, address + nbytes)."""
        end = address + nbytes
        while address < end:
            for spaces in (self.m.memory, self.staging_memory):
                base = max((b for b in spaces if b <= address), default=None)
                if base is not None and address < base + len(spaces[base]):
                    n = min(end, base + len(spaces[base])) - address
                    yield spaces[base], address - base, n
                    address += n
                    break
            else:
                if not any(p <= address and end <= p + n for p, n in self.registered.items()):
                    raise RuntimeError(f"copy touches {address:#x}+{end - address}: not mapped, staged or registered")
                yield None, address, end - address
                address = end

    def _move(self, dst: int, src: int, nbytes: int) -> None:
        data = b"".join(
            bytes(buf[o : o + n]) if buf is not None else ctypes.string_at(o, n)
            for buf, o, n in list(self._pieces(src, nbytes))
        )
        done = 0
        for buf, o, n in list(self._pieces(dst, nbytes)):
            if buf is not None:
                buf[o : o + n] = data[done : done + n]
            else:
                ctypes.memmove(o, data[done : done + n], n)
            done += n

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool, stream: str) -> None:
        self.queues[stream].append(("copy", dst, src, nbytes))

    def copy_any(self, dst: int, src: int, nbytes: int, stream: str) -> None:
        self.relay_copies += 1
        if self.fail_relay_at is not None and self.relay_copies >= self.fail_relay_at:
            raise RuntimeError("CUDA error 999 (peer gone)")
        self.queues[stream].append(("copy", dst, src, nbytes))

    def staging(self, peer: int, nbytes: int) -> int:
        if self.fail_staging:
            raise RuntimeError(f"cudaMalloc of {nbytes} staging bytes on cuda:{peer} failed: out of memory")
        base = STAGING_BASE + peer * (1 << 32)
        self.staging_memory[base] = bytearray(b"\xee") * nbytes
        return base

    def release_staging(self, peer: int) -> None:
        base = STAGING_BASE + peer * (1 << 32)
        for s, q in self.queues.items():  # freeing what a queued copy will touch: a use after free
            queued = q[self.done[s] :]
            pending = [op for op in queued if op[0] == "copy" and base <= max(op[1], op[2]) < base + (1 << 32)]
            assert not pending, f"staging on cuda:{peer} freed while {len(pending)} copies on {s} still use it"
        self.staging_memory.pop(base, None)

    def register(self, ptr: int, nbytes: int) -> None:
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> None:
        del self.registered[ptr]


SIZES = (4096, 8192, 12288, 20000)


def make(seed: int, **ops_kwargs):
    module = FakeCumemModule("flags")
    ops = ScheduledOps(module, seed, **ops_kwargs)
    backend = FastBackend(torch.device("cpu"), module=module, ops=ops, chunk_bytes=5000)
    backend.path.relay_slot_bytes = 1500  # several pieces per copy, two slots: slot reuse is exercised
    with backend.pool(W):
        weights = [backend.allocator.malloc(size, 0) for size in SIZES]
    with backend.pool(KV):
        backend.allocator.malloc(8192, 0)
    backend.track(W, [])
    backend.track(KV, [])
    rng = random.Random(seed)
    for p in weights:
        module.memory[p][:] = bytes(rng.randrange(256) for _ in range(len(module.memory[p])))
    return module, ops, backend, weights


PLAN = (LinkShare(None, 1.0), LinkShare(1, 1.0))


@pytest.mark.parametrize("seed", range(12))
def test_sleep_and_wake_through_a_peer_move_every_byte_in_any_stream_order(seed):
    module, ops, backend, weights = make(seed)
    before = [bytes(module.memory[p]) for p in weights]
    backend.sleep({W}, {KV}, links=PLAN)
    assert all(p not in module.memory for p in weights)
    sleep_lanes = backend.path.stats.last["bytes_by_lane"]
    backend.wake({W, KV}, links=PLAN)
    assert [bytes(module.memory[p]) for p in weights] == before
    wake_lanes = backend.path.stats.last["bytes_by_lane"]
    for lanes in (sleep_lanes, wake_lanes):  # the plan's 1:1 split, to within one chunk
        direct = lanes["direct/0"] + lanes["direct/1"]
        assert direct + lanes["relay/1"] == sum(SIZES) and abs(direct - lanes["relay/1"]) <= 5000
    assert ops.staging_memory == {}  # staging held only during the command
    assert backend.sleep_paths[-1] == "fast over 2 links"


def test_a_peer_alone_carries_everything_when_the_plan_gives_the_own_link_no_share():
    module, _, backend, weights = make(3)
    before = [bytes(module.memory[p]) for p in weights]
    backend.sleep({W}, {KV}, links=(LinkShare(1, 1.0),))
    assert backend.path.stats.last["bytes_by_lane"] == {"relay/1": sum(SIZES)}
    backend.wake({W, KV}, links=(LinkShare(1, 1.0), LinkShare(2, 1.0)))
    assert [bytes(module.memory[p]) for p in weights] == before
    lanes = backend.path.stats.last["bytes_by_lane"]
    assert set(lanes) == {"relay/1", "relay/2"} and min(lanes.values()) > 0


@pytest.mark.parametrize("fail_at", [1, 2, 7])
def test_a_relay_failing_mid_sleep_finishes_the_sleep_on_the_own_link(fail_at):
    module, ops, backend, weights = make(5, fail_relay_at=fail_at)
    before = [bytes(module.memory[p]) for p in weights]
    backend.sleep({W}, {KV}, links=PLAN)
    assert "relay through cuda:1 failed" in backend.path.stats.last["relay_failed"]
    assert all(p not in module.memory for p in weights) and ops.staging_memory == {}
    ops.fail_relay_at = None
    backend.wake({W, KV})
    assert [bytes(module.memory[p]) for p in weights] == before


@pytest.mark.parametrize("fail_at", [1, 4])
def test_a_relay_failing_mid_wake_rolls_back_and_wakes_on_the_own_link(fail_at):
    module, ops, backend, weights = make(6)
    before = [bytes(module.memory[p]) for p in weights]
    backend.sleep({W}, {KV})
    ops.fail_relay_at, ops.relay_copies = fail_at, 0
    backend.wake({W, KV}, links=PLAN)
    assert "relay through cuda:1 failed" in backend.path.stats.last["relay_failed"]
    assert [bytes(module.memory[p]) for p in weights] == before and ops.staging_memory == {}


def test_a_peer_without_room_for_staging_leaves_the_command_on_the_own_link():
    module, ops, backend, weights = make(7, fail_staging=True)
    before = [bytes(module.memory[p]) for p in weights]
    backend.sleep({W}, {KV}, links=PLAN)
    assert "out of memory" in backend.path.stats.last["relay_failed"]
    backend.wake({W, KV}, links=PLAN)
    assert [bytes(module.memory[p]) for p in weights] == before and ops.staging_memory == {}


def test_the_picker_splits_by_share_and_refuses_a_plan_without_a_positive_share():
    class Named:
        def __init__(self, name):
            self.name = name

    picker = LanePicker([(Named("a"), 3.0), (Named("b"), 1.0)])
    for _ in range(400):
        picker.pick(10)
    assert picker.bytes_by_lane() == {"a": 3000, "b": 1000}
    with pytest.raises(ValueError, match="positive shares"):
        LanePicker([(Named("a"), 0.0)])
    with pytest.raises(ValueError, match="positive shares"):
        LanePicker([])


def test_a_backend_without_links_refuses_a_plan_naming_the_capability():
    backend = PortableBackend(torch.device("cpu"))
    with backend.pool(W):
        torch.ones(4)
    backend.track(W, [])
    with pytest.raises(BackendStateError, match="multi_path"):
        backend.sleep({W}, set(), links=PLAN)


def test_relay_failed_names_the_peer_and_the_cause():
    error = RelayFailed(3, RuntimeError("CUDA error 700"))
    assert "cuda:3" in str(error) and "CUDA error 700" in str(error) and error.peer == 3


def test_warming_a_relay_at_load_moves_a_byte_there_and_back_and_frees_its_staging():
    module, ops, backend, weights = make(8)
    before = [bytes(module.memory[p]) for p in weights]
    backend.path.warm_relays([1, 2])
    assert ops.relay_copies == 8 and ops.staging_memory == {}  # 2 hops each way, per peer
    assert [bytes(module.memory[p]) for p in weights] == before


def test_a_peer_that_cannot_relay_is_logged_at_warm_up_not_raised(caplog):
    _, ops, backend, _ = make(9, fail_staging=True)
    backend.path.warm_relays([1])
    assert "cuda:1 cannot relay" in caplog.text and ops.staging_memory == {}
