"""Traces as obligations, content included: what a careful forger or a careless edit of
the cores must not get past the trace check.

Each test here fails on a projection that trusts a line it should check: a successful
swap's waiting wake (accepted), a deadline tied to no task or fired before its issue's
time plus timeout (rejected), a relabelled Profile line that would hide its task
(rejected), the lines of a process after its recorded death (rejected, not dropped).
Tampered copies are renumbered and re-clocked (`_forged`), so only content gives them away.
"""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check, trace_export
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, rank_pid, small_spec, wait_for
from tests.formal.test_trace_obligations import DEADLINE_S, _rejected_at, deadline_trace, frozen_sleep_trace  # noqa: F401

# the demo trace fixtures, shared: pytest finds them by name in this module
from tests.formal.test_trace_validation import _assert_accepted, _copy, _forged, demo_records, demo_trace, needs_tlc  # noqa: F401

pytestmark = needs_tlc


@pytest.mark.parametrize("level", [1, 2])
def test_a_successful_swap_is_accepted(tmp_path, level: int) -> None:
    """`sleep("decoder"); swap("talker", "decoder")` with nothing refused: the decoder's
    waiting wake (level 1 on the wire) is a behaviour of the spec without any refusal."""
    from omni_core.workers.simulated_device import SimulatedDevice

    device = SimulatedDevice(str(tmp_path / "gpu0"), 64 << 20)
    path = tmp_path / "swap.jsonl"
    specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs, trace_path=str(path)) as engine:
        engine.sleep("decoder")
        report = engine.swap("talker", "decoder", level=level)
        assert report.incoming.state == "RUNNING" and report.outgoing.state == "SLEEPING"
    records = read_trace(path)
    decoder = trace_export.project(records, "decoder")
    assert [e.level for e in decoder.events if e.kind == "issue" and e.cmd == "Wake"] == [1]
    assert not any(e.kind == "refused" for e in decoder.events)
    _assert_accepted(trace_check.validate_records(records))


# ---------------------------------------------------------------- deadlines tied to their issue


def _line_of(records: list[T.TraceLine], kind: type) -> int:
    return next(i for i, r in enumerate(records) if r.is_engine and isinstance(r.record, kind))


def test_a_deadline_names_the_task_whose_issue_set_it(deadline_trace) -> None:  # noqa: F811
    records = read_trace(deadline_trace)
    issue = next(r.record for r in records if r.is_engine and isinstance(r.record, T.StageIssued))
    deadline = records[_line_of(records, T.StageDeadline)].record
    assert deadline.task_id == issue.task_id and deadline.deadline_at_s == issue.deadline_at_s
    assert issue.timeout_s == DEADLINE_S
    _assert_accepted(trace_check.validate_records(records, "talker"))


def test_a_premature_deadline_edited_consistently_is_rejected(deadline_trace) -> None:  # noqa: F811
    """The deadline line's own fields agree (fired at its deadline, stamped then), but that
    deadline is not the one its issue set: the check reads the issue, not the line alone."""
    records = _copy(read_trace(deadline_trace))
    k = _line_of(records, T.StageDeadline)
    early_s = max(r.mono_s for r in records[:k] if r.is_engine)  # the engine's previous line
    records[k].mono_s = early_s
    records[k].record.now_s = records[k].record.deadline_at_s = early_s
    verdict = _rejected_at(_forged(records), "talker", k)
    assert "refuted" in verdict.reason and "deadline" in verdict.reason


def test_a_deadline_tied_to_no_task_is_rejected(deadline_trace) -> None:  # noqa: F811
    records = _copy(read_trace(deadline_trace))
    k = _line_of(records, T.StageDeadline)
    records[k].record.task_id = ""
    _rejected_at(records, "talker", k)


def test_a_deadline_computed_in_the_wrong_unit_is_rejected(tmp_path, monkeypatch) -> None:
    """A real bug in the core: its sleep takes the timeout as milliseconds. Every line is what
    the code wrote; the issue's deadline is not its time plus the call's timeout."""
    import dataclasses

    from omni_core.fsm.stage import StageCore

    sleep = StageCore._sleep

    def in_ms(self, call, now):  # type: ignore[no-untyped-def]
        return sleep(self, dataclasses.replace(call, deadline_s=call.deadline_s / 1000), now)

    monkeypatch.setattr(StageCore, "_sleep", in_ms)
    path = tmp_path / "wrong_unit.jsonl"
    frozen_sleep_trace(path, 30.0)
    records = read_trace(path)
    verdict = _rejected_at(records, "talker", _line_of(records, T.StageDeadline))
    assert "timeout of 30 s" in verdict.reason


# ---------------------------------------------------------------- no line hides its task


@pytest.mark.parametrize("label", ["Profile", "Status", "Shutdown"])
def test_a_relabelled_send_hides_no_task(demo_records, label: str) -> None:  # noqa: F811
    """One send of a sleep and one of the wake after it relabelled: a projection that
    dropped every line of a task naming such a command would drop both tasks whole and
    accept what is left."""
    records = _copy(demo_records)
    talker = [i for i, r in enumerate(records) if r.is_engine and r.stage == "talker"]
    issues = [i for i in talker if isinstance(records[i].record, T.StageIssued) and not records[i].record.already]
    pair = next(
        (a, b)
        for a, b in itertools.pairwise(issues)
        if records[a].record.command == "Sleep" and records[b].record.command == "Wake"
    )
    sent = [
        next(
            i
            for i in talker
            if isinstance(records[i].record, T.StageSent) and records[i].record.task_id == records[k].record.task_id
        )
        for k in pair
    ]
    for i in sent:
        records[i].record.command = label
    _rejected_at(_forged(records), "talker", sent[0])


# ---------------------------------------------------------------- the dead write nothing


def test_a_dead_rank_answering_after_a_restart_is_rejected(tmp_path) -> None:
    """Rank 1 killed (its death recorded), restart under epoch 1, a request: copies of the
    new rank 1's lines for that request, signed by the dead process, are rejected where the
    first one stands; a projection that dropped them as superseded would accept them."""
    path = tmp_path / "dead.jsonl"
    engine = Engine([small_spec("talker", ranks=2)], trace_path=str(path))
    try:
        engine.execute("talker", PROBE)
        os.kill(rank_pid(engine, "talker", 1), signal.SIGKILL)
        wait_for(lambda: engine.status()["talker"]["state"] == "FAILED", what="FAILED")
        engine.restart("talker")
        engine.execute("talker", PROBE)
    finally:
        engine.shutdown()
    records = read_trace(path)
    _assert_accepted(trace_check.validate_records(records, "talker"))
    records = _copy(records)
    died = _line_of(records, T.RankDied)
    dead = next(r for r in records[:died] if not r.is_engine and r.rank == 1 and r.epoch == 0)
    new = [
        i
        for i, r in enumerate(records)
        if not r.is_engine and r.rank == 1 and r.epoch == 1 and getattr(r.record, "task_id", "").startswith("req-")
    ]
    assert new, "rank 1 of epoch 1 ran no request"
    for offset, i in enumerate(new):
        ghost = _copy([records[i + offset]])[0]
        ghost.pid, ghost.epoch = dead.pid, 0
        records.insert(i + offset + 1, ghost)
    verdict = _rejected_at(_forged(records), "talker", new[0] + 1)
    assert "after its death was recorded" in verdict.reason
