"""Pause mode keep on one rank (HoldRequests): the batch frozen where it is, an update beside
it and nothing else, the release under the new version, and each Result's version spans."""

from __future__ import annotations

import pytest
from lifecycle_helpers import reach_worker

from omni_core.fsm import HoldEffect, InvariantViolation
from omni_core.fsm.worker import EffectCompleted, EffectRaised
from omni_core.protocol import (
    MAX_VERSION_SPANS,
    Ack,
    AckStatus,
    DiskSource,
    Execute,
    HoldRequests,
    Nack,
    NackReason,
    ResetPrefixCache,
    Result,
    Sleep,
    Status,
    UpdateWeights,
    VersionSpan,
)
from omni_core.protocol import WorkerState as W

SOURCE = DiskSource(path="/ckpt")


def _running(n: int, max_in_flight: int = 4):
    d = reach_worker(W.ACTIVE, max_in_flight=max_in_flight)
    for i in range(n):
        assert d.send(Execute(task_id=f"q{i}", epoch=0, payload=i)).effect is not None
    return d


def _hold(d, task_id: str = "h", boundaries: dict[str, int] | None = None, clear_cache: bool = False) -> Ack:
    step = d.send(HoldRequests(task_id=task_id, epoch=0, hold=True, clear_cache=clear_cache))
    assert step.effect == HoldEffect(task_id, clear_cache), step
    (ack,) = d.w.step(EffectCompleted(task_id, None, boundaries or {}, 0.0)).replies
    assert isinstance(ack, Ack) and ack.status is AckStatus.OK and d.w.holding
    return ack


def _update(d, version: int, task_id: str = "u") -> None:
    step = d.send(UpdateWeights(task_id=task_id, epoch=0, version=version, source=SOURCE))
    assert step.effect is not None and d.w.state is W.RELOADING, step
    (ack,) = d.w.step(EffectCompleted(task_id, None, (), 0.0)).replies
    assert isinstance(ack, Ack) and ack.weights_version == version


def _release(d, task_id: str = "r") -> tuple:
    replies = d.send(HoldRequests(task_id=task_id, epoch=0, hold=False)).replies
    assert isinstance(replies[0], Ack) and not d.w.holding
    return replies[1:]


def _result(d, task_id: str, output: object = "out") -> Result:
    (result,) = d.w.step(EffectCompleted(task_id, None, output, 0.0)).replies
    assert isinstance(result, Result)
    return result


def test_held_requests_resume_under_the_update_and_say_where_it_began() -> None:
    d = _running(2)
    _hold(d, boundaries={"q0": 3, "q1": 7})
    _update(d, 5)
    assert _release(d) == ()
    spans = (VersionSpan(weights_version=0, start_token=0), VersionSpan(weights_version=5, start_token=7))
    assert _result(d, "q1").version_spans == spans and _result(d, "q0").version_spans[1].start_token == 3


def test_a_request_held_through_two_updates_records_both_spans() -> None:
    d = _running(1)
    _hold(d, boundaries={"q0": 2})
    _update(d, 1)
    _release(d)
    _hold(d, "h2", boundaries={"q0": 6})
    _update(d, 2, "u2")
    _release(d, "r2")
    result = _result(d, "q0")
    assert [(s.weights_version, s.start_token) for s in result.version_spans] == [(0, 0), (1, 2), (2, 6)]
    assert result.weights_version == 2


def test_a_hold_without_an_update_records_no_span() -> None:
    d = _running(1)
    _hold(d, boundaries={"q0": 4})
    _release(d)
    result = _result(d, "q0")
    assert result.version_spans == () and result.discarded_tokens == 0


def test_clear_cache_restarts_each_request_under_the_new_version_and_says_what_it_discarded() -> None:
    d = _running(1)
    _hold(d, boundaries={"q0": 9}, clear_cache=True)
    _update(d, 3)
    _release(d)
    result = _result(d, "q0")
    assert result.version_spans == (VersionSpan(weights_version=3, start_token=0),)
    assert result.discarded_tokens == 9


@pytest.mark.parametrize(
    "command",
    [Sleep(task_id="s", epoch=0), ResetPrefixCache(task_id="x", epoch=0), Execute(task_id="q9", epoch=0)],
    ids=lambda c: type(c).__name__,
)
def test_only_an_update_runs_beside_held_requests(command) -> None:
    d = _running(1)
    _hold(d, boundaries={"q0": 1})
    (reply,) = d.send(command).replies
    assert isinstance(reply, Nack) and reply.reason is NackReason.BUSY and "held" in reply.detail
    assert isinstance(d.send(Status(task_id="st", epoch=0)).replies[0], Ack)


def test_a_failed_update_fails_every_held_request_once_and_ends_the_hold() -> None:
    d = _running(2)
    _hold(d, boundaries={"q0": 1, "q1": 1})
    d.send(UpdateWeights(task_id="u", epoch=0, version=1, source=SOURCE))
    replies = d.w.step(EffectRaised("u", "bucket 3 failed")).replies
    assert [type(r).__name__ for r in replies] == ["Nack", "Nack", "Nack"]
    assert {r.task_id: r.reason for r in replies[1:]} == {
        "q0": NackReason.EXECUTE_ERROR,
        "q1": NackReason.EXECUTE_ERROR,
    }
    assert d.w.in_progress == () and not d.w.holding and d.w.state is W.NEEDS_RELOAD


def test_a_hold_with_nothing_running_is_answered_at_once_and_a_second_is_already() -> None:
    d = reach_worker(W.ACTIVE, max_in_flight=2)
    (ack,) = d.send(HoldRequests(task_id="h", epoch=0, hold=True)).replies
    assert isinstance(ack, Ack) and ack.status is AckStatus.OK
    (again,) = d.send(HoldRequests(task_id="h2", epoch=0, hold=True)).replies
    assert again.status is AckStatus.ALREADY


def test_a_hold_is_refused_outside_active() -> None:
    d = reach_worker(W.SLEEPING)
    (nack,) = d.send(HoldRequests(task_id="h", epoch=0, hold=True)).replies
    assert isinstance(nack, Nack) and nack.reason is NackReason.INVALID_STATE


def test_a_request_held_past_the_span_bound_fails_at_its_release() -> None:
    d = _running(1)
    for v in range(1, MAX_VERSION_SPANS):
        _hold(d, f"h{v}", boundaries={"q0": v})
        _update(d, v, f"u{v}")
        assert _release(d, f"r{v}") == ()
    _hold(d, "hx", boundaries={"q0": 99})
    _update(d, MAX_VERSION_SPANS, "ux")
    (failed,) = _release(d, "rx")
    assert isinstance(failed, Nack) and failed.task_id == "q0" and "more updates" in failed.detail


def test_a_hold_completed_with_anything_but_token_counts_is_a_bug() -> None:
    d = _running(1)
    d.send(HoldRequests(task_id="h", epoch=0, hold=True))
    with pytest.raises(InvariantViolation, match="tokens so far"):
        d.w.step(EffectCompleted("h", None, {"q0": -1}, 0.0))


def hold_scenario() -> None:
    """The table's hold_requests row, for the coverage of every transition."""
    test_held_requests_resume_under_the_update_and_say_where_it_began()
