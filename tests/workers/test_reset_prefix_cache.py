"""ResetPrefixCache through a real rank process: the runner's cache across requests is emptied,
no pool memory is released or remapped, and the command is refused where its row says."""

from __future__ import annotations

import pytest

from omni_core.protocol import Ack, AckStatus, Execute, Nack, NackReason, ResetPrefixCache, Sleep, WorkerState

from ._harness import TestOrchestrator

SMALL = {"weights_bytes": 256 << 10, "tensor_count": 4, "kv_bytes": 64 << 10, "hidden": 32, "cpu_threads": 1}
RUNNER = "omni_testing.faults:PrefixCachingRunner"


@pytest.fixture(scope="module")
def ranks():
    """Both ranks start at once (their torch imports overlap), under one test orchestrator."""
    orch = TestOrchestrator()
    started = {
        "counting": orch.spawn(0, runner=RUNNER, runner_args=SMALL),
        "failing": orch.spawn(1, runner=RUNNER, runner_args={**SMALL, "fail_on": ["reset"]}),
    }
    for worker in started.values():
        orch.wait_hello(worker)
    yield orch, started
    orch.close()


def _cache(orch, worker, task_id: str) -> dict:
    reply = orch.request(worker, Execute(task_id=task_id, epoch=0, payload={"op": "prefix_cache"}))
    return reply.output


def test_the_runner_cache_is_emptied_and_no_pool_memory_moves(ranks):
    orch, workers = ranks
    worker = workers["counting"]
    for seed in (1, 2, 3):
        orch.request(worker, Execute(task_id=f"q{seed}", epoch=0, payload={"seed": seed}))
    assert _cache(orch, worker, "c1") == {"entries": 3, "dropped": 0}
    ack = orch.request(worker, ResetPrefixCache(task_id="r1", epoch=0))
    assert isinstance(ack, Ack), ack
    assert (ack.command, ack.status, ack.state) == ("ResetPrefixCache", AckStatus.OK, WorkerState.ACTIVE)
    assert ack.memory is not None and ack.memory.pool_bytes_before == ack.memory.pool_bytes_after
    assert ack.memory.pool_bytes_after["kv_cache"] > 0 and ack.memory.pool_bytes_after["weights"] > 0
    assert _cache(orch, worker, "c2") == {"entries": 0, "dropped": 3}
    copy = orch.request(worker, ResetPrefixCache(task_id="r1", epoch=0))
    assert copy == ack  # the same task again: its reply, not a second reset
    assert _cache(orch, worker, "c3") == {"entries": 0, "dropped": 3}


def test_a_runner_that_raises_answers_execute_error_and_the_rank_serves_on(ranks):
    orch, workers = ranks
    worker = workers["failing"]
    nack = orch.request(worker, ResetPrefixCache(task_id="r1", epoch=0))
    assert isinstance(nack, Nack), nack
    assert (nack.reason, nack.state) == (NackReason.EXECUTE_ERROR, WorkerState.ACTIVE)
    assert "InjectedFault: injected fault in reset" in nack.detail
    served = orch.request(worker, Execute(task_id="q1", epoch=0, payload={"seed": 1}))
    assert served.task_id == "q1" and not isinstance(served, Nack)


def test_refused_asleep_by_its_row(ranks):
    orch, workers = ranks
    worker = workers["counting"]
    orch.request(worker, Execute(task_id="q9", epoch=0, payload={"seed": 9}))
    slept = orch.request(worker, Sleep(task_id="s1", epoch=0, level=1, tags=("weights",)))
    assert isinstance(slept, Ack) and slept.state is WorkerState.SLEEPING
    nack = orch.request(worker, ResetPrefixCache(task_id="r2", epoch=0))
    assert isinstance(nack, Nack), nack
    assert (nack.reason, nack.state) == (NackReason.INVALID_STATE, WorkerState.SLEEPING)
    assert "ResetPrefixCache is not allowed in state SLEEPING" in nack.detail


def test_every_command_of_the_worker_template_has_a_handler_in_the_rank():
    """A command the worker core takes by WORKER_CALLS is performed by the rank's one table;
    one missing there would raise at every call (its NACK), never run."""
    from omni_core.fsm.worker_table import WORKER_CALLS
    from omni_core.workers.process import COMMAND_HANDLERS

    assert set(COMMAND_HANDLERS) == set(WORKER_CALLS)
