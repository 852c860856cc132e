"""PAUSED in traces: trace validation replays a pause (OmniTrace's EnginePause and Shown), so
a traced run with a pause, a sleep and wake of the paused stage and a resume is accepted, and
each tampered copy of it is rejected at the line that gives it away: a wake that ends the
pause (it lasts until resume), a sleep from a PAUSED the stage never entered, a request
dispatched to a stage still paused."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check, trace_export
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, small_spec
from tests.formal.tamper import generate
from tests.formal.test_trace_validation import needs_tlc


def test_a_pause_is_projected_as_the_stage_logged_it(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    with Engine([small_spec("s")], trace_path=str(path)) as engine:
        engine.execute("s", PROBE)
        engine.pause("s")
        engine.resume("s")
    events = trace_export.project(read_trace(path), "s").events
    changes = [(e.before, e.state) for e in events if e.kind == "state"]
    assert ("RUNNING", "PAUSED") in changes and ("PAUSED", "RUNNING") in changes, changes
    assert not [e for e in events if e.note], [e.note for e in events if e.note]  # nothing outside the model


@needs_tlc
def test_a_pause_sleep_wake_resume_trace_is_accepted() -> None:
    verdicts = trace_check.validate_records(read_trace(generate.LEGAL / "pause.jsonl"))
    assert verdicts and all(v.accepted for v in verdicts), "\n".join(v.line() for v in verdicts)


NO_ACTION = "no spec action matches this event"
# tampered class -> why the replay must stop, and the record it stops at (as it reads). The
# request after a deleted resume is refuted where it comes in, before its dispatch: it says
# the stage was RUNNING, which the lines before it (a pause, no resume) deny (trace_admission).
STOPS = {
    "wake_ends_pause": (NO_ACTION, "StageChanged epoch=0 before=WAKING after=RUNNING"),
    "pause_line_removed": (NO_ACTION, "StageIssued epoch=0 task_id=sleep-"),
    "request_while_paused": (
        "refuted by the records around it: request 'req-p-2' came in with the stage RUNNING; "
        "its lines put it in PAUSED",
        "RequestSubmitted request_id=req-p-2",
    ),
}


@needs_tlc
@pytest.mark.parametrize("name", sorted(STOPS))
def test_a_tampered_pause_is_rejected_where_it_lies(name: str) -> None:
    verdict = trace_check.validate_records(read_trace(generate.TAMPERED / f"{name}.jsonl"), "p")[-1]
    reason, event = STOPS[name]
    assert not verdict.accepted and verdict.reason == reason, verdict.line()
    assert event in verdict.event, verdict.line()
