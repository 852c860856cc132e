"""The checks of omni_core/formal/trace_admission.py, without TLC: the projection marks the
lie of each tamper class of the corpus refuted, where the corpus test (with TLC) expects the
replay to stop, and leaves every legal trace unrefuted; a trace of an older omni-core (no
policy recorded) is held to the table's decisions under some policy."""

from __future__ import annotations

import json

import msgspec
import pytest

from omni_core.formal import trace_export
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.formal.tamper import generate
from tests.formal.test_tamper_corpus import STOPS
from tests.formal.test_trace_validation import _copy

CORPUS = json.loads(generate.MANIFEST.read_text())
CHECKED = (  # the classes these checks catch (the others are the replay's)
    "refused_by_policy_while_running",
    "auto_wake_under_queue",
    "queued_request_unanswered",
    "request_deadline_rewritten",
    "fenced_hides_death",
    "no_memory_before_wait",
    "wake_wait_shortened",
    "incoming_wakes_overlap",
    "incoming_wake_unheld",
)


def _refuted(lines: list[T.TraceLine], stage: str) -> list[trace_export.TraceEvent]:
    return [e for e in trace_export.project(lines, stage).events if e.kind == trace_export.REFUTED]


@pytest.mark.parametrize("name", CORPUS["legal"])
def test_a_legal_trace_has_nothing_refuted(name: str) -> None:
    lines = read_trace(generate.LEGAL / f"{name}.jsonl")
    for stage in trace_export.stages_in(lines):
        assert not _refuted(lines, stage), [e.refuted for e in _refuted(lines, stage)]


@pytest.mark.parametrize("name", CHECKED)
def test_the_lie_is_refuted_where_the_replay_must_stop(name: str) -> None:
    entry = CORPUS["tampered"][name]
    refuted = _refuted(read_trace(generate.TAMPERED / f"{name}.jsonl"), entry["stage"])
    assert refuted, f"{name} ({entry['what']}) was not refuted"
    assert STOPS[name] in refuted[0].refuted, refuted[0].refuted


def _demo() -> list[T.TraceLine]:
    return _copy(read_trace(generate.LEGAL / "demo.jsonl"))


def _edit(lines: list[T.TraceLine], kind: type, **fields: object) -> None:
    """Every talker line of `kind` given `fields`."""
    for k, line in enumerate(lines):
        if line.stage == "talker" and isinstance(line.record, kind):
            lines[k] = msgspec.structs.replace(line, record=msgspec.structs.replace(line.record, **fields))


def test_a_trace_that_records_the_policy_must_record_it_on_every_request() -> None:
    lines = _demo()
    k = next(i for i, ln in enumerate(lines) if ln.stage == "talker" and isinstance(ln.record, T.RequestSubmitted))
    lines[k] = msgspec.structs.replace(lines[k], record=msgspec.structs.replace(lines[k].record, policy=""))
    (first, *_) = _refuted(lines, "talker")
    assert "names no admission policy, though the stage's start named one" in first.refuted


def test_an_older_trace_is_held_to_some_policy_for_each_decision() -> None:
    """Without the policy in the records (an older omni-core's trace), the policy's changes are
    not recorded either: each decision must be one some policy makes there, no more."""
    lines = _demo()
    for kind in (T.StageStarting, T.RequestSubmitted, T.StageIssued):
        _edit(lines, kind, policy="")
    lines = [ln for ln in lines if not isinstance(ln.record, T.AdmissionChanged)]
    assert not _refuted(lines, "talker")
    k = next(i for i, ln in enumerate(lines) if ln.stage == "talker" and isinstance(ln.record, T.RequestSubmitted))
    lines[k] = msgspec.structs.replace(lines[k], record=msgspec.structs.replace(lines[k].record, admission="queue"))
    (first, *_) = _refuted(lines, "talker")
    assert "admitted 'queue' in RUNNING; the admission table decides otherwise" in first.refuted


def test_a_trace_cut_short_owes_no_answer() -> None:
    """A killed engine's trace is a prefix: nothing is owed at its end without its stop."""
    lines = _demo()
    stop = next(i for i, ln in enumerate(lines) if ln.stage == "talker" and isinstance(ln.record, T.StageStopped))
    cut = [ln for ln in lines[:stop] if not (isinstance(ln.record, T.RequestAnswered) and ln.stage == "talker")]
    assert not any("never answered" in e.refuted for e in _refuted(cut, "talker"))
    assert any("never answered" in e.refuted for e in _refuted(cut + lines[stop : stop + 1], "talker"))


def test_a_request_answered_twice_or_never_submitted_is_refuted() -> None:
    lines = _demo()
    k = next(i for i, ln in enumerate(lines) if ln.stage == "talker" and isinstance(ln.record, T.RequestAnswered))
    lines.insert(k + 1, _copy([lines[k]])[0])
    assert "answered a second time" in _refuted(lines, "talker")[0].refuted
    lines = _demo()
    lines[k] = msgspec.structs.replace(lines[k], record=T.RequestAnswered("req-never"))
    assert "answered, but no line says it came in" in _refuted(lines, "talker")[0].refuted


def test_a_swap_records_its_incoming_wakes_hold_and_its_admission(tmp_path) -> None:
    """The engine writes what these checks read: each waiting wake's IncomingHeld before its
    issue and IncomingFreed after its end, the policy at start and with each request."""
    path = tmp_path / "swap.jsonl"
    generate.SCENARIOS["swap"](path)
    lines = read_trace(path)
    holds = [(ln.stage, type(ln.record).__name__, ln.record.task_id) for ln in lines if "Incoming" in ln.kind]
    assert holds == [
        ("decoder", "IncomingHeld", "fits/in"),
        ("decoder", "IncomingFreed", "fits/in"),
        ("talker", "IncomingHeld", "refused/in"),
        ("talker", "IncomingFreed", "refused/in"),
        ("talker", "IncomingHeld", "again/in"),
        ("talker", "IncomingFreed", "again/in"),
    ]
    assert all(ln.record.policy == "queue" for ln in lines if isinstance(ln.record, T.StageStarting))
    for stage in trace_export.stages_in(lines):
        assert not _refuted(lines, stage)
