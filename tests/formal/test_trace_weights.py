"""A run with weight updates (P-17): its trace carries the weights versions (the version an
update sends, the one each rank reports, the one the stage commits), and OmniTrace replays
the updates on OmniWeights' actions: a real run is accepted, a trace whose versions lie is
rejected where they do. The corpus (tests/formal/tamper) holds longer runs and forgeries."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check, trace_export
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, small_spec
from tests.engine.test_weight_updates import new_weights, reference
from tests.formal.test_trace_validation import _copy, _forged, needs_tlc


@pytest.fixture(scope="module")
def update_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "update.jsonl"
    with Engine([small_spec("r")], trace_path=str(path)) as engine, WeightSender(bucket_bytes=1 << 20) as sender:
        engine.execute("r", PROBE)
        engine.update_weights("r", sender.share(new_weights(reference(1), 7)), version=1)
        engine.execute("r", PROBE)
    return read_trace(path)


def _of(records, kind: type, **fields) -> list[T.TraceLine]:
    return [
        r for r in records if isinstance(r.record, kind) and all(getattr(r.record, k) == v for k, v in fields.items())
    ]


def test_the_records_carry_the_versions(update_records) -> None:
    (issue,) = _of(update_records, T.StageIssued, command="UpdateWeights")
    (sent,) = _of(update_records, T.StageSent, command="UpdateWeights")
    assert issue.record.version == sent.record.version == 1
    ack = next(r for r in _of(update_records, T.ReplySent, reply="ack") if r.record.task_id == issue.record.task_id)
    assert ack.record.weights_version == 1
    commits = _of(update_records, T.StageChanged, before="WAKING", after="RUNNING")
    assert [c.record.weights_version for c in commits] == [1]
    results = _of(update_records, T.ReplySent, reply="result")
    assert [r.record.weights_version for r in results] == [0, 1]  # before the update, after it


def test_the_export_notes_nothing_and_puts_the_version_on_the_wire(update_records) -> None:
    trace = trace_export.project(update_records, "r")
    assert not any(e.note for e in trace.events)
    (send,) = [e for e in trace.events if e.kind == "send" and e.cmd == "UpdateWeights"]
    assert send.level == send.version == 1  # the spec's wire carries the version as the level
    assert "v |-> 1" in send.tla()


@needs_tlc
def test_a_run_with_an_update_is_accepted(update_records) -> None:
    (verdict,) = trace_check.validate_records(update_records)
    assert verdict.accepted, verdict.line()


def _ack_taken_at_version_0(lines: list[T.TraceLine]) -> None:
    """Only the engine's receipt lies (the rank reported the version sent): the stage would
    fail the update, so its commit to RUNNING matches no action."""
    (ack,) = _of(lines, T.StageReceived, reply="ack", state="WAKING")
    ack.record.weights_version = 0


def _commit_names_version_2(lines: list[T.TraceLine]) -> None:
    _of(lines, T.StageChanged, before="WAKING", after="RUNNING")[0].record.weights_version = 2


def _result_taken_at_version_0(lines: list[T.TraceLine]) -> None:
    """Only the engine's receipt of the request after the update names version 0."""
    _of(lines, T.StageReceived, reply="result")[-1].record.weights_version = 0


@needs_tlc
@pytest.mark.parametrize(
    ("edit", "where"),
    [
        (_ack_taken_at_version_0, ("StageChanged", "before=WAKING after=RUNNING")),
        (_commit_names_version_2, ("StageChanged", "weights_version=2")),
        (_result_taken_at_version_0, ("StageReceived", "reply=result")),
    ],
)
def test_a_version_that_lies_is_rejected_where_it_does(update_records, edit, where: tuple[str, ...]) -> None:
    lines = _copy(update_records)
    edit(lines)
    (verdict,) = trace_check.validate_records(_forged(lines))
    assert not verdict.accepted and verdict.reason == "no spec action matches this event", verdict.line()
    assert all(part in verdict.event for part in where), verdict.line()


@needs_tlc
def test_a_chunked_replay_carries_the_versions_across_its_cuts() -> None:
    """Each chunk starts from the versions the previous one ended with (the corpus's run
    commits 1, 3, 4 and 5): a chunk that started from version 0 would refuse the first
    result it replays."""
    from tests.formal.tamper import generate

    verdicts = trace_check.validate_records(read_trace(generate.LEGAL / "weights.jsonl"), chunk_events=40)
    assert len(verdicts) >= 3 and all(v.accepted for v in verdicts), "\n".join(v.line() for v in verdicts)
