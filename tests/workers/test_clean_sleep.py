"""Clean-weights sleep: a level-1 sleep of weights the runner declares
read-only releases them without copying, because the host arena already holds them.

On the fast backend's CPU doubles (test_fast_backend.DeferredOps over the CuMemAllocator
stand-ins): every device->host copy is counted, and a copy that would read released memory
fails, so "no copy" and "the right bytes came back" are both observable.
"""

from __future__ import annotations

import pytest
import torch
import zmq

from omni_core.fsm.effects import ReloadEffect
from omni_core.runners.base import ModelRunner
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers import process as worker_process
from omni_core.workers.backends.fast import FastBackend
from omni_core.workers.backends.host_arena import CleanCopyMismatch
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.config import WorkerConfig

from .test_cumem_versions import GARBAGE, KV, FakeCumemModule, W, content
from .test_fast_backend import DeferredOps, snapshot

SIZES_W, SIZES_KV = (4096, 8192, 12288), (16384,)
WEIGHTS_BYTES = sum(SIZES_W)


def make_clean(read_only=(W,), verify=False):
    """Weights written before the backend tracks them (the runner's load), then declared."""
    module = FakeCumemModule("0.26")
    ops = DeferredOps(module)
    backend = FastBackend(torch.device("cpu"), module=module, ops=ops, chunk_bytes=5000)
    backend.declare_read_only(read_only, verify=verify)
    ptrs = {}
    for tag, sizes in ((W, SIZES_W), (KV, SIZES_KV)):
        with backend.pool(tag):
            ptrs[tag] = [backend.allocator.malloc(size, 0x22) for size in sizes]
        if tag == W:
            for i, p in enumerate(ptrs[W]):
                module.memory[p][:] = bytes((i * 31 + j) % 251 for j in range(len(module.memory[p])))
        backend.track(tag, [])
    return module, ops, backend, ptrs


def d2h_bytes(ops) -> int:
    return sum(n for d, n in ops.copies if d == "d2h")


def overwrite(module, ptrs, value: int) -> None:
    for p in ptrs:
        module.memory[p][:] = bytes([value]) * len(module.memory[p])


def test_read_only_weights_are_copied_once_after_load_and_never_at_a_sleep():
    module, ops, backend, ptrs = make_clean()
    before = snapshot(module, ptrs[W])
    assert d2h_bytes(ops) == WEIGHTS_BYTES  # the host copy, made at load
    assert backend.stats()["snapshot_bytes"] == WEIGHTS_BYTES and backend.stats()["arena_bytes"] == WEIGHTS_BYTES
    for _ in range(3):  # the first sleep included
        copied = d2h_bytes(ops)
        backend.sleep({W}, {KV})
        assert module.memory == {} and d2h_bytes(ops) == copied
        last = backend.stats()["last"]
        assert last["clean_bytes"] == WEIGHTS_BYTES and last["offloaded_bytes"] == 0 and last["copies"] == 0
        assert backend.host_bytes() == WEIGHTS_BYTES  # the arena, 1.0 x the weights
        backend.wake({W, KV})
        assert snapshot(module, ptrs[W]) == before and content(module, ptrs[KV]) == {GARBAGE}


def test_a_runner_that_writes_its_weights_gets_a_copy_at_every_sleep():
    module, ops, backend, ptrs = make_clean(read_only=())
    assert d2h_bytes(ops) == 0  # nothing declared: no copy ahead of time
    for cycle in range(2):
        overwrite(module, ptrs[W], 0x40 + cycle)  # execution wrote the weights
        backend.sleep({W}, {KV})
        assert d2h_bytes(ops) == WEIGHTS_BYTES * (cycle + 1)
        backend.wake({W, KV})
        assert content(module, ptrs[W]) == {0x40 + cycle}  # the written values came back


def test_reload_invalidates_the_copy_and_the_next_track_copies_the_new_weights():
    module, ops, backend, ptrs = make_clean()
    backend.sleep(set(), {W, KV})  # level 2: the weights are discarded, their copy is stale
    backend.wake({W, KV})
    backend.invalidate({W})
    overwrite(module, ptrs[W], 0x77)  # the reload writes new weights in place
    copied = d2h_bytes(ops)
    backend.track(W, [])  # the worker tracks the weights again after a reload
    assert d2h_bytes(ops) == copied + WEIGHTS_BYTES
    backend.sleep({W}, {KV})
    assert d2h_bytes(ops) == copied + WEIGHTS_BYTES  # clean again: no copy at the sleep
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {0x77}


def test_without_a_new_copy_an_invalidated_tag_is_copied_at_its_sleep():
    module, ops, backend, ptrs = make_clean()
    backend.invalidate({W})
    overwrite(module, ptrs[W], 0x55)  # an in-place update the copy did not see
    copied = d2h_bytes(ops)
    backend.sleep({W}, {KV})
    assert d2h_bytes(ops) == copied + WEIGHTS_BYTES
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {0x55}


def test_verification_catches_a_runner_that_lied_and_releases_nothing():
    module, _ops, backend, ptrs = make_clean(verify=True)
    backend.sleep({W}, {KV})  # honest so far: verified and released without a copy
    backend.wake({W, KV})
    overwrite(module, ptrs[W][1:2], 0x99)  # execution wrote a weight it said it never writes
    with pytest.raises(CleanCopyMismatch, match="declares 'weights' read-only"):
        backend.sleep({W}, {KV})
    assert set(module.memory) == set(ptrs[W] + ptrs[KV])  # the sleep was refused before any release


def test_without_verification_a_lying_runner_wakes_stale_weights():
    """Why the declaration matters (and why the verification mode exists)."""
    module, _ops, backend, ptrs = make_clean()
    before = snapshot(module, ptrs[W])
    overwrite(module, ptrs[W], 0x99)
    backend.sleep({W}, {KV})
    backend.wake({W, KV})
    assert snapshot(module, ptrs[W]) == before


class RecordingBackend(PortableBackend):
    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.calls: list[tuple] = []

    def declare_read_only(self, tags, *, verify=False) -> None:
        self.calls.append(("declare", frozenset(tags), verify))

    def invalidate(self, tags) -> None:
        self.calls.append(("invalidate", frozenset(tags)))


class TrainerRunner(SyntheticRunner):
    execute_writes_weights = True


@pytest.mark.parametrize(
    ("runner", "declared"), [("synthetic", {W}), ("tests.workers.test_clean_sleep:TrainerRunner", set())]
)
def test_the_worker_passes_the_runners_word_and_invalidates_before_a_reload(monkeypatch, runner, declared):
    assert ModelRunner.execute_writes_weights  # a user's runner claims nothing unless it says so
    backend = RecordingBackend(torch.device("cpu"))
    monkeypatch.setattr(worker_process, "select_backend", lambda name, device: backend)
    context = zmq.Context()
    sock, peer = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    sock.bind("inproc://clean-sleep")
    peer.connect("inproc://clean-sleep")  # takes the worker's Hello
    try:
        config = WorkerConfig(
            address="inproc://unused",
            rank=0,
            runner=runner,
            verify_clean_sleep=True,
            runner_args={"weights_bytes": 65536, "kv_bytes": 8192},
        )
        worker = worker_process.WorkerProcess(config, sock)
        worker.start()
        assert backend.calls == [("declare", frozenset(declared), True)]
        worker._apply(ReloadEffect(task_id="t1", source=None))
        assert backend.calls[-1] == ("invalidate", frozenset({W}))
    finally:
        sock.close(linger=0)
        peer.close(linger=0)
        context.term()


def test_a_discard_drops_the_copy_even_without_an_invalidation():
    module, ops, backend, ptrs = make_clean()
    backend.sleep(set(), {W, KV})  # level 2
    backend.wake({W, KV})
    overwrite(module, ptrs[W], 0x31)  # whatever is there now is not what the arena holds
    copied = d2h_bytes(ops)
    backend.sleep({W}, {KV})
    assert d2h_bytes(ops) == copied + WEIGHTS_BYTES
    backend.wake({W, KV})
    assert content(module, ptrs[W]) == {0x31}
