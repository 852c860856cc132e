"""The node's device ledger: wakes that wait for memory on one device run one at a time
across engines, and the one that cannot get its turn is refused before it maps anything,
naming the wake that holds the device. Unit cases on a controlled clock, then a real rank
process against a lock held by another process (the test's)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from types import SimpleNamespace

import pytest

from omni_core.protocol import Ack, Nack, NackReason, Shutdown, Sleep, Wake, WorkerState
from omni_core.workers.device_ledger import (
    INCOMING_LOCK,
    MAX_OWNER_BYTES,
    gpu_ledger_directory,
    incoming_owner,
    one_incoming_wake,
)
from omni_core.workers.device_memory import CudaFreeMemory
from omni_core.workers.ledger_files import ENV_LEDGER_DIR, LedgerError
from omni_core.workers.memory_gate import WakeRefused
from omni_core.workers.simulated_device import SimulatedDevice, SimulatedResidency

from ._harness import TestOrchestrator
from .test_memory_gate import Clock
from .test_process_swap import EPOCH, RUNNER_ARGS


def test_a_second_wake_waits_its_turn_and_is_refused_past_its_wait_naming_the_first(tmp_path) -> None:
    directory = str(tmp_path / "gpu0")
    clock = Clock()
    with one_incoming_wake(directory, "stage talker rank 0, pid 11 (engine pid 10)", 1.0):
        assert incoming_owner(directory) == "stage talker rank 0, pid 11 (engine pid 10)"
        entered = []
        refused = pytest.raises(WakeRefused, match=r"holds the device's incoming lock \(stage talker rank 0, pid 11")
        with refused, one_incoming_wake(directory, "stage dit rank 0", 0.5, clock=clock, pause=clock.sleep):
            entered.append(True)  # never: nothing is mapped by a refused wake
        assert not entered and sum(clock.sleeps) >= 0.5
    # Released with the first wake: the next one gets it at once and names itself.
    with one_incoming_wake(directory, "stage dit rank 0", 0.0, clock=clock, pause=clock.sleep) as waited_s:
        assert waited_s == 0.0 and incoming_owner(directory) == "stage dit rank 0"


def _hold(directory: str, held, release) -> None:  # a wake of another engine, in its own process
    with one_incoming_wake(directory, f"stage other rank 0, pid {os.getpid()} (engine pid {os.getppid()})", 5.0):
        held.set()
        release.wait(30)


def test_the_lock_is_one_per_device_across_processes(tmp_path) -> None:
    directory = str(tmp_path / "gpu0")
    ctx = multiprocessing.get_context("spawn")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold, args=(directory, held, release))
    other.start()
    try:
        assert held.wait(30)
        refused = pytest.raises(WakeRefused, match=f"stage other rank 0, pid {other.pid}")
        with refused, one_incoming_wake(directory, "stage dit rank 0", 0.05):
            pass
    finally:
        release.set()
        other.join(30)
    with one_incoming_wake(directory, "stage dit rank 0", 5.0):
        pass  # the other process released it (its exit would have too)


def test_each_gpu_has_its_own_ledger_of_this_user() -> None:
    a, b = gpu_ledger_directory("GPU-aaaa"), gpu_ledger_directory("GPU-bbbb")
    assert a != b and os.path.basename(a) == "GPU-aaaa" and f"omni-core-devices-{os.getuid()}" in a


@pytest.fixture
def orch():
    o = TestOrchestrator()
    yield o
    o.close()


def test_a_rank_wake_that_waits_takes_its_turn_and_one_that_does_not_takes_its_chance(orch, tmp_path) -> None:
    device = SimulatedDevice(str(tmp_path / "gpu0"), 64 << 20)  # room for all: only the lock binds
    worker = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, epoch=EPOCH, simulated_device=device)
    orch.wait_hello(worker)
    assert isinstance(orch.request(worker, Sleep(task_id="sleep-1", epoch=EPOCH, level=1)), Ack)
    asleep_free = device.free_bytes()
    with one_incoming_wake(device.directory, f"stage other rank 0, pid {os.getpid()} (engine pid 1)", 1.0):
        reply = orch.request(worker, Wake(task_id="wake-1", epoch=EPOCH, memory_wait_s=0.3))
        assert isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY, reply
        assert reply.state is WorkerState.SLEEPING and f"stage other rank 0, pid {os.getpid()}" in reply.detail
        assert device.free_bytes() == asleep_free  # refused before anything was mapped
        # A wake that does not wait for memory does not wait for the lock either.
        reply = orch.request(worker, Wake(task_id="wake-2", epoch=EPOCH))
        assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply
    assert isinstance(orch.request(worker, Sleep(task_id="sleep-2", epoch=EPOCH, level=1)), Ack)
    reply = orch.request(worker, Wake(task_id="wake-3", epoch=EPOCH, memory_wait_s=5.0))
    assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply  # its turn: the lock is free
    assert incoming_owner(device.directory).startswith("stage test rank 0, pid ")
    assert isinstance(orch.request(worker, Shutdown(task_id="stop", epoch=EPOCH)), Ack)


@pytest.mark.parametrize("plant", ["symlink", "fifo"])
def test_a_planted_lock_file_refuses_the_wake_naming_what_to_remove(tmp_path, plant) -> None:
    directory = tmp_path / "gpu0"
    directory.mkdir(mode=0o700)
    lock = directory / INCOMING_LOCK
    if plant == "symlink":
        (tmp_path / "victim").write_text("keep me")
        lock.symlink_to(tmp_path / "victim")
    else:
        os.mkfifo(lock)
    entered = []
    refused = pytest.raises(WakeRefused, match=f"cannot take its turn.*remove it.*{lock}")
    with refused, one_incoming_wake(str(directory), "stage dit rank 0", 0.0):
        entered.append(True)
    assert not entered
    if plant == "symlink":
        assert (tmp_path / "victim").read_text() == "keep me"  # never truncated through the link
    lock.unlink()
    with one_incoming_wake(str(directory), "stage dit rank 0", 0.0):
        pass  # removed as the message says: the next wake makes a fresh one


def test_the_lock_holder_is_shown_as_printable_text_up_to_a_cap(tmp_path) -> None:
    directory = tmp_path / "gpu0"
    directory.mkdir(mode=0o700)
    (directory / INCOMING_LOCK).write_bytes(b"stage x\x1b[2J\nrank 0" + b"y" * 4096)
    owner = incoming_owner(str(directory))
    assert owner.startswith("stage x?[2J?rank 0y") and len(owner) <= MAX_OWNER_BYTES


def test_the_operator_sets_the_ledger_directory_and_a_uuid_is_only_a_name(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(ENV_LEDGER_DIR, str(tmp_path / "ledgers"))
    directory = gpu_ledger_directory("GPU-8f2e0000-aaaa")
    assert directory == str(tmp_path / "ledgers" / "GPU-8f2e0000-aaaa")
    with one_incoming_wake(directory, "stage s rank 0", 0.0):
        pass
    assert os.stat(tmp_path / "ledgers").st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(directory, INCOMING_LOCK)).st_mode & 0o777 == 0o600
    for hostile in ("../../etc", "GPU/x", "", "."):
        with pytest.raises(LedgerError, match="cannot name a ledger directory"):
            gpu_ledger_directory(hostile)


def test_a_group_writable_base_or_device_directory_is_refused(tmp_path, monkeypatch) -> None:
    base = tmp_path / "ledgers"
    base.mkdir()
    base.chmod(0o777)
    monkeypatch.setenv(ENV_LEDGER_DIR, str(base))
    with pytest.raises(LedgerError, match=f"{base}.* writable by group or others.*{ENV_LEDGER_DIR}"):
        gpu_ledger_directory("GPU-1")  # at the rank's start: anyone could swap the GPU's directory
    base.chmod(0o700)
    directory = gpu_ledger_directory("GPU-1")
    os.makedirs(directory, mode=0o777)
    os.chmod(directory, 0o777)
    refused = pytest.raises(WakeRefused, match="writable by group or others")
    with refused, one_incoming_wake(directory, "stage s rank 0", 0.0):
        pass


def test_a_gpu_rank_whose_ledger_breaks_after_its_start_logs_it_and_goes_on(tmp_path, caplog) -> None:
    directory = tmp_path / "gpu0"
    ledger = SimulatedResidency(SimulatedDevice(str(directory), 1 << 30), "s", 0)
    memory = SimpleNamespace(device=SimpleNamespace(type="cuda"), physical=None)
    source = CudaFreeMemory(memory, ledger=ledger)  # type: ignore[arg-type]
    source.report(5)
    directory.chmod(0o777)  # someone opened it up after the start
    source.report(6)
    source.report(7)
    assert [r.message.count("writable by group or others") for r in caplog.records] == [1]  # once, not per effect
    assert source._ledger_holders() == ({}, source._ledger_holders()[1])
    assert "the node ledger is unreadable" in source._ledger_holders()[1]


def test_a_rank_wake_refused_by_a_planted_lock_stays_asleep_and_serves_on(orch, tmp_path) -> None:
    device = SimulatedDevice(str(tmp_path / "gpu0"), 64 << 20)
    worker = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, epoch=EPOCH, simulated_device=device)
    orch.wait_hello(worker)
    assert isinstance(orch.request(worker, Sleep(task_id="sleep-1", epoch=EPOCH, level=1)), Ack)
    lock = os.path.join(device.directory, INCOMING_LOCK)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(lock)
    os.symlink("/etc/passwd", lock)
    reply = orch.request(worker, Wake(task_id="wake-1", epoch=EPOCH, memory_wait_s=1.0))
    assert isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY, reply
    assert reply.state is WorkerState.SLEEPING and f"rm {lock}" in reply.detail
    os.unlink(lock)
    reply = orch.request(worker, Wake(task_id="wake-2", epoch=EPOCH, memory_wait_s=1.0))
    assert isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE, reply
    assert isinstance(orch.request(worker, Shutdown(task_id="stop", epoch=EPOCH)), Ack)


def test_two_waiting_wakes_on_a_device_for_one_never_both_stall(orch, tmp_path) -> None:
    """vLLM #36753's shape: two wakes at once, each alone fits, both together do not. Without
    one incoming wake per device both may map half and wait for each other until both expire;
    with it one wakes whole and the other is refused after its wait, naming the first."""
    # Both ranks' weights fit beside each other, a rank's weights and KV cache beside the other's
    # weights do not: two wakes that map their weights at once then wait for each other.
    args = dict(RUNNER_ARGS, weights_bytes=30 << 20, kv_bytes=20 << 20)
    device = SimulatedDevice(str(tmp_path / "gpu0"), 72 << 20)  # one rank awake (50 MiB), not two
    workers = [
        orch.spawn(rank, runner="synthetic", runner_args=args, epoch=EPOCH, simulated_device=device) for rank in (0, 1)
    ]
    pids = [orch.wait_hello(worker).pid for worker in workers]
    for rank, worker in enumerate(workers):
        assert isinstance(orch.request(worker, Sleep(task_id=f"sleep-{rank}", epoch=EPOCH, level=1)), Ack)
    for rank, worker in enumerate(workers):
        orch.send(worker, Wake(task_id=f"wake-{rank}", epoch=EPOCH, memory_wait_s=1.0))
    replies = [orch.next_message(worker) for worker in workers]
    woke = [r for r, reply in enumerate(replies) if isinstance(reply, Ack) and reply.state is WorkerState.ACTIVE]
    assert len(woke) == 1, replies  # never both refused: the device did not sit idle
    [refused] = [replies[1 - woke[0]]]
    assert (
        isinstance(refused, Nack) and refused.reason is NackReason.NO_MEMORY and refused.state is WorkerState.SLEEPING
    )
    assert f"stage test rank {woke[0]}, pid {pids[woke[0]]}" in refused.detail, refused.detail
    # It took its turn after the first wake, so every map it tried was on the device's true free
    # figure. Without the turn both map their weights on the same free figure, the device refuses
    # the later maps ("the driver refused a map the free figure allowed"), both wait for each
    # other, and one wakes only when the other's wait expires.
    assert "driver refused" not in refused.detail, refused.detail
    assert [h.label for h in device.read()[0] if h.nbytes > 0] == [f"stage test rank {woke[0]}"]  # rolled back
    for rank, worker in enumerate(workers):
        assert isinstance(orch.request(worker, Shutdown(task_id=f"stop-{rank}", epoch=EPOCH)), Ack)
