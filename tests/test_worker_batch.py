"""A rank with many requests in flight (`max_in_flight`): the core takes Executes into one
batch, answers each once with its own version, and lets nothing else run beside them."""

from __future__ import annotations

import pytest
from lifecycle_helpers import reach_worker

from omni_core.fsm import InvariantViolation
from omni_core.fsm.worker import EffectCompleted, EffectRaised, WorkerCore
from omni_core.protocol import (
    DiskSource,
    Execute,
    Nack,
    NackReason,
    ResetPrefixCache,
    Result,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
)
from omni_core.protocol import WorkerState as W


def _batch(d, n: int) -> list[str]:
    ids = [f"q{i}" for i in range(n)]
    for task_id in ids:
        step = d.send(Execute(task_id=task_id, epoch=0, payload=task_id))
        assert step.effect is not None and not step.replies, step
    return ids


def test_a_rank_takes_up_to_max_in_flight_requests_and_refuses_the_next_busy() -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=3)
    assert _batch(d, 3) == list(d.w.in_progress)
    (busy,) = d.send(Execute(task_id="q3", epoch=0)).replies
    assert isinstance(busy, Nack) and busy.reason is NackReason.BUSY and "max_in_flight" in busy.detail
    d.w.step(EffectCompleted("q1", output="one"))
    assert d.w.in_progress == ("q0", "q2")
    # The refusal is the stage's answer: a copy of q3 gets it again, never runs (P-1).
    assert d.send(Execute(task_id="q3", epoch=0)).replies == (busy,)
    assert d.send(Execute(task_id="q4", epoch=0)).effect is not None


@pytest.mark.parametrize(
    "command",
    [
        Sleep(task_id="s", epoch=0),
        Wake(task_id="w", epoch=0),
        UpdateWeights(task_id="u", epoch=0, version=1, source=DiskSource(path="/ckpt")),
        ResetPrefixCache(task_id="r", epoch=0),
    ],
    ids=lambda c: type(c).__name__,
)
def test_nothing_else_starts_beside_a_running_batch(command) -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=4)
    _batch(d, 2)
    step = d.send(command)
    (reply,) = step.replies
    assert step.effect is None and isinstance(reply, Nack) and reply.reason is NackReason.BUSY, reply
    assert "2 requests are running" in reply.detail and d.w.state is W.ACTIVE
    d.w.step(EffectCompleted("q0"))
    d.w.step(EffectCompleted("q1"))
    assert d.send(Sleep(task_id="s2", epoch=0)).effect is not None  # after the batch, it runs


def test_every_request_of_a_batch_is_answered_once_with_its_version() -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=8, weights_version=5)
    ids = _batch(d, 3)
    replies = [d.w.step(EffectCompleted(t, output=t.upper())).replies for t in ids[:2]]
    (failed,) = d.w.step(EffectRaised(ids[2], "ValueError: bad prompt")).replies
    results = [r for (r,) in replies]
    assert [(r.task_id, r.output, r.weights_version) for r in results] == [("q0", "Q0", 5), ("q1", "Q1", 5)]
    assert all(isinstance(r, Result) for r in results)
    assert isinstance(failed, Nack) and failed.reason is NackReason.EXECUTE_ERROR and d.w.state is W.ACTIVE
    # A copy of an answered request is answered from the cache, never run again (P-2).
    assert d.send(Execute(task_id="q0", epoch=0, payload="q0")).replies == (results[0],)
    assert not d.w.busy


def test_a_copy_of_a_running_request_is_ignored_and_a_reused_id_refused() -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=4)
    _batch(d, 2)
    assert d.send(Execute(task_id="q1", epoch=0, payload="q1")).replies == ()
    (reused,) = d.send(Execute(task_id="q1", epoch=0, payload="other")).replies
    assert reused.reason is NackReason.TASK_ID_REUSED
    assert d.w.counters.duplicates_in_flight_ignored == 1 and d.w.in_progress == ("q0", "q1")


def test_status_beside_a_batch_is_answered_by_the_core() -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=4)
    _batch(d, 2)
    step = d.send(Status(task_id="st", epoch=0))
    assert step.effect is None and step.replies[0].state is W.ACTIVE


def test_no_request_is_taken_beside_a_lifecycle_effect() -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=4)
    assert d.send(Sleep(task_id="s", epoch=0)).effect is not None
    (busy,) = d.send(Execute(task_id="q", epoch=0)).replies
    assert busy.reason is NackReason.BUSY and d.w.in_progress == ("s",)


def test_the_invariant_catches_a_sleep_beside_a_batch() -> None:
    # The bug the BUSY rule keeps out: a Sleep started while a request is in the batch.
    d = reach_worker(W.ACTIVE, max_in_flight=4)
    _batch(d, 1)
    d.w.work.busy_with = lambda command: ""  # type: ignore[method-assign]
    with pytest.raises(InvariantViolation, match=r"taken on while \['q0'\] are in progress"):
        d.send(Sleep(task_id="s", epoch=0))


def test_max_in_flight_is_bounded() -> None:
    with pytest.raises(ValueError, match=r"max_in_flight must be in 1\.\.4096"):
        WorkerCore(0, max_in_flight=0)
