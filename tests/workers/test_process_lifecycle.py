"""A real worker process (portable backend, synthetic runner) driven over a real socket.

The tests of this module share one worker and run in file order: each leaves it ACTIVE,
except the last, which shuts it down.
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_core.fsm import trace_records as T
from omni_core.protocol import (
    Ack,
    AckStatus,
    Capability,
    Execute,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    Shutdown,
    Sleep,
    Status,
    Wake,
    WorkerState,
)
from omni_core.trace import read_trace

from ._harness import TestOrchestrator

RUNNER_ARGS = {
    "weights_bytes": 2 << 20,
    "tensor_count": 16,
    "kv_bytes": 256 << 10,
    "hidden": 64,
    "seed": 5,
    "cpu_threads": 1,
}
PAYLOAD = {"seed": 11, "batch": 3}
_ids = itertools.count()


def tid(name: str) -> str:
    return f"{name}-{next(_ids)}"


@pytest.fixture(scope="module")
def orch():
    o = TestOrchestrator()
    yield o
    o.close()


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("trace") / "worker.jsonl")


@pytest.fixture(scope="module")
def worker(orch, trace_path):
    w = orch.spawn(0, runner="synthetic", runner_args=RUNNER_ARGS, epoch=2, trace_path=trace_path)
    orch.wait_hello(w)
    return w


def execute(orch, worker, payload=PAYLOAD):
    return orch.request(worker, Execute(task_id=tid("exec"), epoch=2, payload=payload))


def ack(reply, state: WorkerState, command: str) -> Ack:
    assert isinstance(reply, Ack), reply
    assert reply.command == command and reply.state is state, reply
    return reply


def refused(reply, reason: NackReason, state: WorkerState) -> Nack:
    assert isinstance(reply, Nack), reply
    assert reply.reason is reason and reply.state is state, reply
    return reply


def test_hello_describes_the_worker(worker):
    hello = worker.hello
    assert hello.task_id == "hello" and hello.epoch == 2 and hello.rank == 0
    assert hello.pid == worker.process.pid
    assert hello.state is WorkerState.ACTIVE
    assert hello.backend == "portable" and hello.device == "cpu"
    assert hello.tags == ("weights", "kv_cache")
    # SWAP: the portable backend gates a wake (here on CPU without a simulated device, nothing to wait for);
    # WEIGHT_UPDATE: the synthetic runner takes weight updates (P-17); ADAPTERS: and adapters (P-20);
    # SAVE_WEIGHTS: it writes what its reload reads (P-21)
    assert set(hello.capabilities) == {
        Capability.ADAPTERS,
        Capability.LEVEL2,
        Capability.PARTIAL_WAKE,
        Capability.PROFILE,
        Capability.HOST_REFIT,  # the synthetic runner writes into the portable backend's host copy
        Capability.SAVE_WEIGHTS,
        Capability.SWAP,
        Capability.TRANSFER,  # the synthetic runner exports and lands 'hidden' (P-22)
        Capability.WEIGHT_UPDATE,
    }
    assert hello.weights_version == 0


def test_sleep_wake_reload_round_trips_are_bit_exact(orch, worker):
    first = execute(orch, worker)
    assert isinstance(first, Result)
    reference = first.output["data"]
    assert first.output["shape"] == [3, 64] and len(reference) == 3 * 64 * 4

    # Level 1: weights offloaded, kv discarded; nothing executes while asleep.
    slept = ack(orch.request(worker, Sleep(task_id=tid("s1"), epoch=2, level=1)), WorkerState.SLEEPING, "Sleep")
    assert slept.asleep_tags == ("kv_cache", "weights")
    mem = slept.memory
    assert mem is not None
    assert mem.pool_bytes_before == {"weights": 2 * 1024 * 1024 + 64 * 4, "kv_cache": 256 * 1024}
    assert mem.pool_bytes_after == {"weights": 0, "kv_cache": 0}
    assert mem.process_bytes_before is None and mem.process_bytes_after is None
    assert mem.process_bytes_source.startswith("none: no CUDA")
    refused(execute(orch, worker), NackReason.INVALID_STATE, WorkerState.SLEEPING)
    woke = ack(orch.request(worker, Wake(task_id=tid("w1"), epoch=2)), WorkerState.ACTIVE, "Wake")
    assert woke.memory.pool_bytes_after == mem.pool_bytes_before and woke.asleep_tags == ()
    assert execute(orch, worker).output["data"] == reference

    # Level 2: nothing kept but the runner's calibration buffer; weights need a reload.
    ack(orch.request(worker, Sleep(task_id=tid("s2"), epoch=2, level=2)), WorkerState.SLEEPING, "Sleep")
    ack(orch.request(worker, Wake(task_id=tid("w2"), epoch=2)), WorkerState.NEEDS_RELOAD, "Wake")
    refused(execute(orch, worker), NackReason.INVALID_STATE, WorkerState.NEEDS_RELOAD)
    reloaded = ack(orch.request(worker, ReloadWeights(task_id=tid("r"), epoch=2)), WorkerState.ACTIVE, "ReloadWeights")
    assert reloaded.memory is not None and reloaded.duration_s > 0
    assert execute(orch, worker).output["data"] == reference


def test_partial_wake_refuses_execute(orch, worker):
    ack(orch.request(worker, Sleep(task_id=tid("s"), epoch=2, level=1)), WorkerState.SLEEPING, "Sleep")
    partial = ack(orch.request(worker, Wake(task_id=tid("w"), epoch=2, tags=("weights",))), WorkerState.PARTIAL, "Wake")
    assert partial.asleep_tags == ("kv_cache",)
    assert partial.memory.pool_bytes_after["kv_cache"] == 0 and partial.memory.pool_bytes_after["weights"] > 0
    refused(execute(orch, worker), NackReason.INVALID_STATE, WorkerState.PARTIAL)
    ack(orch.request(worker, Wake(task_id=tid("w"), epoch=2, tags=("kv_cache",))), WorkerState.ACTIVE, "Wake")
    assert isinstance(execute(orch, worker), Result)


def test_repeats_are_answered_without_a_second_effect(orch, worker):
    sleep = Sleep(task_id=tid("dup"), epoch=2, level=1)
    first = orch.request(worker, sleep)
    again = orch.request(worker, sleep)  # same task_id: the cached reply, no second sleep
    assert again == first
    already = ack(orch.request(worker, Sleep(task_id=tid("s"), epoch=2)), WorkerState.SLEEPING, "Sleep")
    assert already.status is AckStatus.ALREADY
    ack(orch.request(worker, Wake(task_id=tid("w"), epoch=2)), WorkerState.ACTIVE, "Wake")
    refused(orch.request(worker, Status(task_id=tid("old"), epoch=1)), NackReason.STALE_EPOCH, WorkerState.ACTIVE)


BLOBS = [
    b"",
    b"\x00",
    b"\xff" * 7,
    b"not msgpack at all",
    b"\x81\xa4type\xa5Sleep",  # map with only a type
    b"\x93\x01\x02\x03",
    random.Random(1).randbytes(512),
]


@pytest.mark.parametrize("blob", BLOBS, ids=range(len(BLOBS)))
def test_garbage_gets_bad_message_and_the_worker_keeps_serving(orch, worker, blob):
    orch.send_raw(worker, blob)
    refused(orch.next_message(worker), NackReason.BAD_MESSAGE, WorkerState.ACTIVE)
    status = ack(orch.request(worker, Status(task_id=tid("st"), epoch=2)), WorkerState.ACTIVE, "Status")
    assert status.memory is not None and status.memory.pool_bytes_after["weights"] > 0


def test_garbage_is_refused_as_bad_bytes_not_as_a_failure_of_the_worker(orch, worker):
    """Undecodable bytes are the sender's fault: the refusal says what the decoder found, not
    that the worker failed handling a frame (its frame isolation, which would answer the same
    reason, is for the worker's own faults)."""
    orch.send_raw(worker, b"not msgpack at all")
    nack = refused(orch.next_message(worker), NackReason.BAD_MESSAGE, WorkerState.ACTIVE)
    assert "could not handle the frame" not in nack.detail, nack.detail


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(blob=st.binary(max_size=300))
def test_random_bytes_get_a_refusal(orch, worker, blob):
    orch.send_raw(worker, blob)
    reply = orch.next_message(worker)
    assert isinstance(reply, Nack) and reply.reason in (NackReason.BAD_MESSAGE, NackReason.UNSUPPORTED_VERSION)


def test_worker_still_executes_identically_after_garbage(orch, worker):
    first, second = execute(orch, worker), execute(orch, worker)
    assert first.output["data"] == second.output["data"]


def test_shutdown_exits_cleanly(orch, worker, trace_path):
    reply = ack(orch.request(worker, Shutdown(task_id=tid("bye"), epoch=2)), WorkerState.STOPPED, "Shutdown")
    assert reply.memory is not None
    assert worker.exit_code(timeout_s=15) == 0
    lines = read_trace(trace_path)
    assert [line.seq for line in lines] == list(range(len(lines)))
    assert {(line.stage, line.rank, line.epoch) for line in lines} == {("test", 0, 2)}
    assert len({line.pid for line in lines}) == 1 and lines[0].pid != os.getpid()
    seen = {(line.kind, getattr(line.record, "command", "")) for line in lines}
    assert {
        ("WorkerStarted", ""),
        ("WorkerReceived", "Sleep"),
        ("WorkerChanged", ""),
        ("BadMessage", ""),
        ("EffectDone", "Sleep"),
        ("EffectDone", "Execute"),
    } <= seen, seen
    assert any(isinstance(line.record, T.ReplySent) and line.record.reply == "ack" for line in lines)
    assert isinstance(lines[-1].record, T.ReplySent) and lines[-1].record.state == "STOPPED"
