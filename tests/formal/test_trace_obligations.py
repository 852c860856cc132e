"""Trace lines are obligations (issue 17, item 3): each process's lines in program order, a
worker's ReplySent only where that process's step produced that reply, nothing from a rank
after its death, a deadline only at or after its time naming the ranks that were silent; and
a restart from a serving state (live ranks killed with a request in flight) is accepted.

Tampered copies are made by a careful forger (`_forged`: every process's lines renumbered,
its clock kept monotonic), so that the spec, not the sequence check, is what rejects them;
`test_a_line_out_of_program_order_is_rejected_there` covers the sequence check itself.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from omni_core.engine import Engine, RequestFailedError, StageFailedError
from omni_core.formal import trace_check, trace_export
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, rank_pid, resume, small_spec, wait_for

# the demo trace fixtures, shared: pytest finds them by name in this module
from tests.formal.test_trace_validation import _assert_accepted, _copy, _forged, demo_records, demo_trace, needs_tlc  # noqa: F401

pytestmark = needs_tlc

DEADLINE_S = 3.0  # the sleep's deadline in the deadline scenario: a frozen rank never answers


def _worker(line: T.TraceLine, rank: int, kind: type, stage: str) -> bool:
    return not line.is_engine and line.stage == stage and line.rank == rank and isinstance(line.record, kind)


def _rejected_at(records: list[T.TraceLine], stage: str, k: int) -> trace_check.TraceVerdict:
    verdicts = trace_check.validate_records(records, stage)
    verdict = verdicts[-1]
    print(verdict.line())
    assert not verdict.accepted
    assert verdict.event.startswith(f"line {k + 1}:"), verdict.line()
    return verdict


@pytest.fixture(scope="module")
def restart_trace(tmp_path_factory) -> Path:
    """Rank 1 frozen, a request in flight (rank 0 answered it, rank 1 cannot), then
    restart() from RUNNING: the live ranks are killed, the request fails, epoch 1 serves."""
    path = tmp_path_factory.mktemp("restart") / "restart.jsonl"
    engine = Engine([small_spec("talker", ranks=2)], trace_path=str(path))
    frozen = 0
    try:
        reference = engine.execute("talker", PROBE)
        frozen = rank_pid(engine, "talker", 1)
        os.kill(frozen, signal.SIGSTOP)
        future = engine.submit("talker", PROBE)
        wait_for(
            lambda: any(
                _worker(r, 0, T.ReplySent, "talker")
                and r.record.reply == "result"
                and r.record.task_id != "req-talker-1"
                for r in read_trace(path)
            ),
            what="rank 0 answered the second request",
        )
        engine.restart("talker")
        with pytest.raises(RequestFailedError, match="restarted while this request ran"):
            future.result(timeout=30)
        assert engine.execute("talker", PROBE) == reference
    finally:
        if frozen:
            resume(frozen)
        engine.shutdown()
    return path


def test_a_restart_from_running_with_a_request_in_flight_is_accepted(restart_trace) -> None:
    records = read_trace(restart_trace)
    trace = trace_export.project(records, "talker")
    [restart] = [e for e in trace.events if e.kind == "restart"]
    assert (restart.before, restart.state, restart.epoch) == ("RUNNING", "STARTING", 1)
    assert "kill" in trace.faults and trace.max_epoch == 1
    verdicts = trace_check.validate_records(records, "talker")
    _assert_accepted(verdicts)


def test_without_kill_a_restart_from_running_is_not_a_behaviour_of_the_spec(restart_trace, monkeypatch) -> None:
    """The spec itself follows the table: take "kill" away and the restart line diverges."""
    records = read_trace(restart_trace)
    original = trace_export._finish

    def without_kill(*args, **kwargs):
        trace = original(*args, **kwargs)
        trace.faults = [f for f in trace.faults if f != "kill"]
        return trace

    monkeypatch.setattr(trace_export, "_finish", without_kill)
    k = next(i for i, r in enumerate(records) if r.is_engine and isinstance(r.record, T.StageRestarted))
    _rejected_at(records, "talker", k)


def _reply_line(records: list[T.TraceLine], stage: str, rank: int, reply: str) -> int:
    """A worker's reply that is followed by more lines of that process (a later task)."""
    return next(
        i
        for i, r in enumerate(records)
        if _worker(r, rank, T.ReplySent, stage)
        and r.record.reply == reply
        and r.record.task_id != "hello"
        and any(_worker(q, rank, T.WorkerReceived, stage) for q in records[i + 1 :])
    )


def _first_use(records: list[T.TraceLine], start: int, gone: T.TraceLine) -> int:
    """The first line from `start` on that needs the reply logged: the engine taking it, or
    the next line of the process that wrote it."""
    task = gone.record.task_id
    return next(
        i
        for i in range(start, len(records))
        if (
            records[i].is_engine
            and isinstance(records[i].record, T.StageReceived)
            and records[i].record.task_id == task
            and records[i].record.rank == gone.rank
        )
        or (records[i].pid == gone.pid and not records[i].is_engine)
    )


def test_a_deleted_worker_reply_is_rejected_where_it_is_owed(demo_records) -> None:  # noqa: F811
    records = _copy(demo_records)
    k = _reply_line(records, "talker", 0, "result")
    gone = records.pop(k)
    _forged(records)
    verdict = _rejected_at(records, "talker", _first_use(records, k, gone))
    assert verdict.reason == "no spec action matches this event" and "spec there:" in verdict.line()


def test_a_worker_reply_moved_after_its_next_task_is_rejected(demo_records) -> None:  # noqa: F811
    records = _copy(demo_records)
    k = _reply_line(records, "talker", 0, "result")
    moved = records[k]
    # after the lines of that process's next task, up to and including its reply
    after = next(i for i in range(k + 1, len(records)) if _worker(records[i], 0, T.ReplySent, "talker"))
    records.insert(after, records.pop(k))
    _forged(records)
    _rejected_at(records, "talker", _first_use(records, k, moved))


@pytest.fixture(scope="module")
def crash_trace(tmp_path_factory) -> Path:
    """Rank 1 killed while the stage runs: RankDied, FAILED naming it."""
    path = tmp_path_factory.mktemp("crash") / "crash.jsonl"
    engine = Engine([small_spec("talker", ranks=2)], trace_path=str(path))
    try:
        engine.execute("talker", PROBE)
        os.kill(rank_pid(engine, "talker", 1), signal.SIGKILL)
        wait_for(lambda: engine.status()["talker"]["state"] == "FAILED", what="FAILED")
    finally:
        engine.shutdown()
    return path


def test_a_dead_rank_that_keeps_logging_is_rejected(crash_trace) -> None:
    records = read_trace(crash_trace)
    _assert_accepted(trace_check.validate_records(records, "talker"))
    records = _copy(records)
    died = next(i for i, r in enumerate(records) if r.is_engine and isinstance(r.record, T.RankDied))
    victim = records[died].record.rank
    last = max(i for i in range(died) if _worker(records[i], victim, T.ReplySent, "talker"))
    ghost = _copy([records[last]])[0]
    records.insert(died + 1, ghost)  # a send logged by the rank after its death was seen
    _forged(records)
    _rejected_at(records, "talker", died + 1)


def frozen_sleep_trace(path: Path, timeout_s: float) -> Path:
    """Rank 1 frozen during a sleep of `timeout_s`: StageDeadline, FAILED naming it."""
    engine = Engine([small_spec("talker", ranks=2)], trace_path=str(path))
    frozen = 0
    try:
        engine.execute("talker", PROBE)
        frozen = rank_pid(engine, "talker", 1)
        os.kill(frozen, signal.SIGSTOP)
        with pytest.raises(StageFailedError):
            engine.sleep("talker", level=1, timeout_s=timeout_s)
    finally:
        if frozen:
            resume(frozen)
        engine.shutdown()
    return path


@pytest.fixture(scope="module")
def deadline_trace(tmp_path_factory) -> Path:
    return frozen_sleep_trace(tmp_path_factory.mktemp("deadline") / "deadline.jsonl", DEADLINE_S)


def _deadline_line(records: list[T.TraceLine]) -> int:
    return next(i for i, r in enumerate(records) if r.is_engine and isinstance(r.record, T.StageDeadline))


def test_a_real_deadline_is_accepted_with_its_time_and_silent_rank(deadline_trace) -> None:
    records = read_trace(deadline_trace)
    k = _deadline_line(records)
    assert records[k].record.failed_ranks.keys() == {1} and records[k].record.now_s >= records[k].record.deadline_at_s
    [event] = [e for e in trace_export.project(records, "talker").events if e.kind == "deadline"]
    assert event.late_us >= 0 and event.failed == (1,)
    _assert_accepted(trace_check.validate_records(records, "talker"))


def test_a_deadline_that_fired_1_ms_into_its_time_is_rejected(deadline_trace) -> None:
    records = _copy(read_trace(deadline_trace))
    k = _deadline_line(records)
    record = records[k].record
    record.now_s = record.deadline_at_s - DEADLINE_S + 0.001  # the core's clock: 1 ms after the issue
    _rejected_at(records, "talker", k)
    records = _copy(read_trace(deadline_trace))
    records[k].mono_s = records[k].record.deadline_at_s - 0.5  # the line's stamp before the deadline
    _rejected_at(_forged(records[: k + 1]) + records[k + 1 :], "talker", k)


def test_a_deadline_naming_a_rank_that_answered_is_rejected(deadline_trace) -> None:
    records = _copy(read_trace(deadline_trace))
    k = _deadline_line(records)
    records[k].record.failed_ranks = {0: "no answer within the deadline"}
    _rejected_at(records, "talker", k)


def test_a_line_out_of_program_order_is_rejected_there(demo_records) -> None:  # noqa: F811
    """Without renumbering, a moved line breaks its process's sequence, even where the spec
    would take either order (two sends of one step); a deleted one leaves a gap."""
    records = _copy(demo_records)
    k = next(i for i, r in enumerate(records) if _engine_sent(r) and _engine_sent(records[i + 1]))
    records[k], records[k + 1] = records[k + 1], records[k]
    verdict = _rejected_at(records, "talker", k)
    assert verdict.reason.startswith("out of program order") and "seq" in verdict.reason
    records = _copy(demo_records)
    del records[k]
    line, why = trace_export.program_order(records)
    assert line == k + 1 and "missing" in why


def _engine_sent(line: T.TraceLine) -> bool:
    return line.is_engine and line.stage == "talker" and isinstance(line.record, T.StageSent)
