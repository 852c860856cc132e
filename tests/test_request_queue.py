"""The stage's request queue (`fsm/request_queue.py`): first in, first out; each request at
its own deadline; stale deadline entries never remove a request that arrived later under the
same id; the deadline heap stays bounded however many requests pass through."""

from __future__ import annotations

import pytest
from test_stage_core import reach_stage

from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.request_queue import RequestQueue
from omni_core.fsm.stage_step import StageRequest
from omni_core.protocol import StageState


def req(request_id: str, deadline_at: float = 100.0) -> StageRequest:
    return StageRequest(request_id, None, deadline_at)


def test_requests_leave_in_arrival_order() -> None:
    q = RequestQueue()
    for i in range(5):
        q.append(req(f"r{i}", deadline_at=10.0 - i))  # later arrivals expire sooner
    assert [q.popleft().request_id for _ in range(5)] == ["r0", "r1", "r2", "r3", "r4"]
    with pytest.raises(IndexError):
        q.popleft()


def test_expired_requests_leave_by_deadline_and_the_rest_keep_their_order() -> None:
    q = RequestQueue()
    for name, deadline_at in [("slow", 50.0), ("fast", 5.0), ("mid", 20.0), ("fast2", 5.0)]:
        q.append(req(name, deadline_at))
    assert [r.request_id for r in q.pop_expired(4.9)] == []
    assert [r.request_id for r in q.pop_expired(20.0)] == ["fast", "fast2", "mid"]
    assert [r.request_id for r in q] == ["slow"] and len(q) == 1 and "slow" in q


def test_a_stale_deadline_never_removes_a_later_request_of_the_same_id() -> None:
    q = RequestQueue()
    q.append(req("again", deadline_at=1.0))
    assert q.popleft().request_id == "again"  # dispatched: its heap entry is stale now
    q.append(req("again", deadline_at=9.0))  # the same id, queued again with a later deadline
    assert q.pop_expired(5.0) == []
    assert [r.request_id for r in q] == ["again"]
    assert [r.request_id for r in q.pop_expired(9.0)] == ["again"]


def test_a_duplicate_id_is_refused_by_the_queue() -> None:
    q = RequestQueue()
    q.append(req("x"))
    with pytest.raises(ValueError, match="already queued"):
        q.append(req("x"))


def test_the_deadline_heap_stays_bounded_however_many_requests_pass() -> None:
    q = RequestQueue()
    for i in range(10_000):
        q.append(req(f"r{i}", deadline_at=1e9))
        q.popleft()
        assert not q.check_invariants()
    assert len(q._deadlines) <= 64 + 1  # only the compaction floor's worth of stale entries


def test_a_stage_refuses_a_request_id_that_is_already_queued() -> None:
    h = reach_stage(StageState.SLEEPING)
    first = h.stage.step(I.Submit("dup", None, 30.0), h.now)
    assert not first.requests and len(h.stage.queue) == 1
    second = h.stage.step(I.Submit("dup", None, 30.0), h.now)
    [answer] = second.requests
    assert answer.error is RequestError.REJECTED and "already queued or in flight" in answer.detail
    assert len(h.stage.queue) == 1  # the first one still waits
