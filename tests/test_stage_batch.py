"""A stage with several requests in flight on its ranks: every lifecycle waits for (or aborts)
them all, and a rank that dies fails each request it held, answered once."""

from __future__ import annotations

from collections import Counter

import stage_inputs
from lifecycle_helpers import StageHarness

from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError
from omni_core.protocol import Result
from omni_core.protocol import StageState as S


def _batch(h: StageHarness, n: int) -> tuple[list[str], list]:
    ids, sends = [f"r{i}" for i in range(n)], []
    for request_id in ids:
        sends += h.stage.step(I.Submit(request_id, {"n": request_id}, 60.0), h.now).sends
    assert len(h.stage.in_flight) == n
    return ids, sends


def _answer(h: StageHarness, request_id: str, rank: int):
    core = h.stage
    result = Result(task_id=request_id, epoch=core.epoch, rank=rank, output=request_id, weights_version=0)
    return core.step(I.Received(result), h.now)


def test_a_rank_that_dies_fails_every_request_it_held_each_answered_once() -> None:
    h = StageHarness(2, max_in_flight=8)
    ids, _ = _batch(h, 5)
    answered = [a for rank in (0, 1) for a in _answer(h, ids[0], rank).requests]  # one finished first
    step = stage_inputs.on_rank_died(h.stage, 1, "SIGKILL", h.now)
    answered += step.requests
    # Late results of the dead rank's peer change nothing: each request has its one answer.
    for request_id in ids:
        answered += _answer(h, request_id, 0).requests
    counts = Counter(a.request_id for a in answered)
    assert counts == Counter(ids), counts
    failed = {a.request_id: a for a in answered if a.error is not None}
    assert set(failed) == set(ids[1:]) and {a.error for a in failed.values()} == {RequestError.FAILED}
    assert all("process died: SIGKILL" in a.detail for a in failed.values())
    assert h.stage.state is S.FAILED and not h.stage.in_flight


def test_a_sleep_waits_for_every_request_of_the_batch() -> None:
    h = StageHarness(2, max_in_flight=8)
    ids, _ = _batch(h, 3)
    assert stage_inputs.sleep(h.stage, "s", 1, None, h.now, 30.0).sends == () and h.stage.state is S.DRAINING
    for request_id in ids[:-1]:
        for rank in (0, 1):
            assert _answer(h, request_id, rank).sends == ()  # still draining: one left
    assert _answer(h, ids[-1], 0).sends == ()  # the last request, one rank still running it
    step = _answer(h, ids[-1], 1)
    assert {type(out.command).__name__ for out in step.sends} == {"Sleep"} and len(step.sends) == 2


def test_an_aborting_sleep_answers_every_request_of_the_batch_once() -> None:
    h = StageHarness(2, max_in_flight=8)
    ids, _ = _batch(h, 4)
    step = h.stage.step(I.SleepCall("s", 1, None, 30.0, abort_in_flight=True), h.now)
    assert Counter(a.request_id for a in step.requests) == Counter(ids)
    assert {a.error for a in step.requests} == {RequestError.ABORTED} and step.sends == ()
    # The callers heard; the drain still waits for the ranks, which may be running them.
    late = [a for request_id in ids for rank in (0, 1) for a in _answer(h, request_id, rank).requests]
    assert late == [] and h.stage.state is S.TRANSITIONING
