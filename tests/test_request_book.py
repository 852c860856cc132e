"""The stage's request book (`fsm/request_queue.py`, `RequestBook`) on its own: a request is
queued or in flight, never both; each is answered once; ending them all tells queued and
running requests apart; its check names what is over its bound."""

from __future__ import annotations

import pytest

from omni_core.fsm.inputs import RequestError
from omni_core.fsm.request_queue import RequestBook
from omni_core.fsm.stage_step import StageRequest
from omni_core.fsm.worker_step import InvariantViolation


def req(request_id: str) -> StageRequest:
    return StageRequest(request_id, None, 100.0)


def test_a_request_is_known_queued_or_in_flight_and_started_once() -> None:
    book = RequestBook(queue_limit=4, max_in_flight=2)
    queued, running = req("q"), req("f")
    book.queue.append(queued)
    book.start(running)
    assert "q" in book and "f" in book and "x" not in book
    with pytest.raises(InvariantViolation, match="both queued and in flight"):
        book.start(req("q"))
    with pytest.raises(InvariantViolation, match="both queued and in flight"):
        book.start(req("f"))
    book.retire(running)
    assert "f" not in book


def test_room_is_counted_against_max_in_flight() -> None:
    book = RequestBook(queue_limit=4, max_in_flight=2)
    book.start(req("a"))
    assert book.has_room()
    book.start(req("b"))
    assert not book.has_room()
    book.retire(book.in_flight["a"])
    assert book.has_room()


def test_each_request_is_answered_once_and_answers_are_taken_in_order() -> None:
    book = RequestBook(queue_limit=4, max_in_flight=2)
    a, b = req("a"), req("b")
    book.answer(a, RequestError.ABORTED, "aborted")
    book.answer(b, None, "", output="out", weights_version=3)
    book.answer(a, None, "", output="late")  # its ranks' result after the abort: dropped
    answers = book.take_answers()
    assert [(x.request_id, x.error, x.output) for x in answers] == [
        ("a", RequestError.ABORTED, None),
        ("b", None, "out"),
    ]
    assert answers[1].weights_version == 3
    assert book.take_answers() == ()


def test_fail_all_tells_queued_from_running_and_empties_the_book() -> None:
    book = RequestBook(queue_limit=4, max_in_flight=2)
    book.queue.append(req("q"))
    book.start(req("f"))
    book.fail_all(RequestError.REJECTED, "never ran", running=RequestError.FAILED, running_detail="ran")
    answers = {x.request_id: (x.error, x.detail) for x in book.take_answers()}
    assert answers == {"q": (RequestError.REJECTED, "never ran"), "f": (RequestError.FAILED, "ran")}
    assert not book.queue and not book.in_flight


def test_the_check_names_a_queue_over_its_limit() -> None:
    book = RequestBook(queue_limit=1, max_in_flight=1)
    book.queue.append(req("a"))
    assert book.check_invariants() == ""
    book.queue.append(req("b"))  # past the stage's own check of the limit
    assert "over queue_limit 1" in book.check_invariants()


def test_limits_out_of_range_are_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="max_in_flight >= 1"):
        RequestBook(queue_limit=4, max_in_flight=0)
