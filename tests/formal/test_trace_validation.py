"""Trace validation: traces of real runs replay on the spec, tampered ones do not.

The demo's trace, the engine's crash scenario (a rank killed mid-sleep, FAILED, restart,
a sleep/wake cycle), many requests in flight across a sleep that drains them, the
AsyncEngine round trip and a stage whose ranks fail to load must be accepted by TLC; copies
of the demo trace with one logged state changed, one ACK removed, or two events swapped,
and of the concurrent trace with the drain's Sleep sent before the last request in flight
was answered, must be rejected at the tampered line.
"""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
from pathlib import Path

import pytest

from omni_core.demo import Demo
from omni_core.engine import AsyncEngine, Engine, StageFailedError
from omni_core.formal import check, trace_check, trace_export
from omni_core.formal.tlc import TlcNotFoundError, find_jar, find_java
from omni_core.fsm import trace_records as T
from omni_core.trace import TraceFormatError, decode_line, encode_line, read_trace
from tests.engine.conftest import PROBE, rank_pid, resume, small_spec, wait_for

try:
    find_java(), find_jar()
    NO_TLC = ""
except TlcNotFoundError as exc:
    NO_TLC = str(exc)

needs_tlc = pytest.mark.skipif(bool(NO_TLC), reason=NO_TLC)


@pytest.fixture(scope="module")
def demo_trace(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "demo.jsonl"
    out = io.StringIO()
    assert Demo(weights_mib=4, trace_path=str(path), out=out).run() == 0, out.getvalue()
    return path


@pytest.fixture(scope="module")
def demo_records(demo_trace) -> list[T.TraceLine]:
    return read_trace(demo_trace)


def _copy(lines: list[T.TraceLine]) -> list[T.TraceLine]:
    return [decode_line(encode_line(line)) for line in lines]


def _forged(lines: list[T.TraceLine]) -> list[T.TraceLine]:
    """A careful forger's copy: each process's lines renumbered 0, 1, ... in file order on a
    clock that never goes back, so that only the spec can tell what was tampered with."""
    seqs: dict[tuple, int] = {}
    clocks: dict[tuple, float] = {}
    for line in lines:
        key = (line.pid, line.rank, -1 if line.is_engine else line.epoch)
        line.seq = seqs.get(key, -1) + 1
        line.mono_s = max(line.mono_s, clocks.get(key, float("-inf")))
        seqs[key], clocks[key] = line.seq, line.mono_s
    return lines


def _engine_line(line: T.TraceLine, kind: type, stage: str = "talker") -> bool:
    return line.is_engine and line.stage == stage and isinstance(line.record, kind)


def _first_sleeping(records: list[T.TraceLine]) -> int:
    """Index of the talker's first commit to SLEEPING (the end of its first sleep)."""
    return next(i for i, r in enumerate(records) if _engine_line(r, T.StageChanged) and r.record.after == "SLEEPING")


def _received(line: T.TraceLine, reply: str, stage: str = "talker") -> bool:
    return _engine_line(line, T.StageReceived, stage) and line.record.reply == reply


def _last_ack_before(records: list[T.TraceLine], index: int) -> int:
    return max(i for i in range(index) if _received(records[i], "ack"))


def _assert_accepted(verdicts: list[trace_check.TraceVerdict]) -> None:
    assert verdicts, "no stage validated"
    for v in verdicts:
        assert v.accepted, v.line()
        assert v.states is not None and v.states >= v.events  # one state per consumed event, at least


# ---------------------------------------------------------------- projection (no TLC)


def test_projection_maps_lines_to_events_and_drops_what_the_spec_does_not_model(demo_records) -> None:
    assert trace_export.stages_in(demo_records) == ["talker", "decoder"]
    talker = trace_export.project(demo_records, "talker")
    assert talker.ranks == 2 and talker.max_epoch == 0 and talker.faults == [] and talker.max_faults == 0
    kinds = {e.kind for e in talker.events}
    assert kinds == {
        *("issue", "dispatch", "send", "recv", "state", "start", "wrecv", "wstate", "done", "wsend"),
        *("ended", "answered"),  # what the callers heard, tied to the ranks' answers
    }, kinds
    # Each event is its record: the kind names the action, nothing is read off other lines.
    assert all(trace_export.RECORD_EVENTS[type(e.record.record)] == e.kind for e in talker.events)
    assert talker.dropped["RankSpawned"] == 2 and talker.dropped["StageStarting"] == 1
    assert not any("shutdown" in getattr(e.record.record, "task_id", "") for e in talker.events)
    assert {e.record.stage for e in talker.events} == {"talker"}
    # Tasks are numbered in the order the engine first names them; a lifecycle call is its
    # own record, with its command, level and tags (ALREADY included: the second sleep).
    assert sorted(talker.tasks.values()) == list(range(1, len(talker.tasks) + 1))
    issues = [e for e in talker.events if e.kind == "issue"]
    assert [e.cmd for e in issues] == ["Sleep", "Sleep", "Wake", "Sleep", "Wake", "Sleep", "Wake"]
    assert [e.before == e.state for e in issues] == [False, True, False, False, False, False, False]
    assert all(e.level == 1 and e.tags == ("all",) for e in issues if e.cmd == "Sleep")
    assert issues[-1].record.record.auto  # the request that woke the stage (admission "wake")
    decoder = trace_export.project(demo_records, "decoder")
    assert [e.level for e in decoder.events if e.kind == "issue" and e.cmd == "Sleep"] == [2]
    assert "ReloadWeights" in {e.cmd for e in decoder.events if e.kind == "done"}
    module = trace_export.render_module(talker)
    assert module.startswith("---- MODULE TraceData ----") and module.count("[k |-> ") == len(talker.events)
    config = trace_export.render_config(talker, trace_check.SPEC_INVARIANTS)
    assert "Ranks = {0, 1}" in config and "TraceAccepted" in config and "P5_CommitOnlyOnAllAcks" in config
    assert 'Tags = {"weights", "kv_cache"}' in config and 'SleepTags = {"all", "weights", "kv_cache"}' in config


def test_progress_lines_are_read_back_even_when_tlc_breaks_them() -> None:
    output = (
        '<<"@trace", 3, "RUNNING", 0, <<"ACTIVE">>, <<TRUE>>, "-", 0, <<"-">>>>\n'
        '<< "@trace",\n   18,\n   "TRANSITIONING",\n   0,\n   <<"OFFLOADING">>,\n   <<TRUE>>,\n'
        '   "-",\n   0,\n   <<"OFFLOADING">> >>\n'
    )
    assert [i for i, _ in trace_check.progress_of(output)] == [3, 18]


# ---------------------------------------------------------------- real traces are accepted


@needs_tlc
def test_the_demo_trace_is_accepted(demo_trace) -> None:
    verdicts = trace_check.validate_file(demo_trace)
    assert [v.stage for v in verdicts] == ["talker", "decoder"]
    _assert_accepted(verdicts)
    for v in verdicts:
        print(v.line())  # per-stage TLC time, shown with -s


@needs_tlc
def test_the_crash_scenario_trace_is_accepted(tmp_path) -> None:
    """A rank frozen, then killed mid-sleep: FAILED naming it, restart under epoch 1, a
    request and a sleep/wake cycle (tests/engine/test_engine.py's crash scenario)."""
    path = tmp_path / "crash.jsonl"
    engine = Engine([small_spec("talker", ranks=2), small_spec("decoder")], trace_path=str(path))
    victim = 0
    try:
        engine.execute("talker", PROBE)
        engine.execute("decoder", PROBE)
        victim = rank_pid(engine, "talker", 1)
        os.kill(victim, signal.SIGSTOP)  # frozen: the sleep cannot complete before the kill
        outcome: dict[str, object] = {}

        def sleeper() -> None:
            try:
                outcome["report"] = engine.sleep("talker", level=1, timeout_s=30.0)
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=sleeper)
        thread.start()
        wait_for(lambda: engine.status()["talker"]["state"] == "TRANSITIONING", what="TRANSITIONING")
        os.kill(victim, signal.SIGKILL)
        thread.join(30.0)
        assert isinstance(outcome.get("error"), StageFailedError), outcome
        engine.restart("talker")
        engine.execute("talker", PROBE)
        assert engine.sleep("talker").state == "SLEEPING"
        assert engine.wake("talker").state == "RUNNING"
    finally:
        if victim:
            resume(victim)
        engine.shutdown()
    records = read_trace(path)
    talker = trace_export.project(records, "talker")
    assert {e.kind for e in talker.events} >= {"died", "state"} and talker.max_epoch == 1
    assert "crash" in talker.faults
    verdicts = trace_check.validate_records(records)
    _assert_accepted(verdicts)
    for v in verdicts:
        print(v.line())


CONCURRENT_REQUESTS = 12  # tests/engine's scenario has 50; 12 keep the replay short


@pytest.fixture(scope="module")
def concurrent_trace(tmp_path_factory) -> Path:
    """Requests in flight when a sleep comes (admission "queue"): rank 1 is frozen so that
    the sleep must drain 4 requests; 8 more queue while the stage drains, sleeps and wakes,
    and go out together once it runs again (tests/engine/test_engine.py's 50-request
    scenario, made deterministic)."""
    path = tmp_path_factory.mktemp("concurrent") / "concurrent.jsonl"
    engine = Engine([small_spec("s", ranks=2, admission="queue")], trace_path=str(path))
    frozen = 0
    try:
        reference = engine.execute("s", PROBE)
        frozen = rank_pid(engine, "s", 1)
        os.kill(frozen, signal.SIGSTOP)  # the first requests stay in flight until it resumes
        futures = [engine.submit("s", PROBE) for _ in range(4)]
        errors: list[BaseException] = []

        def cycle() -> None:
            try:
                assert engine.sleep("s", level=1).state == "SLEEPING"
                assert engine.wake("s").state == "RUNNING"
            except BaseException as exc:
                errors.append(exc)

        thread = threading.Thread(target=cycle)
        thread.start()
        wait_for(lambda: engine.status()["s"]["state"] == "DRAINING", what="DRAINING")
        futures += [engine.submit("s", PROBE) for _ in range(CONCURRENT_REQUESTS - 4)]
        resume(frozen)
        frozen = 0
        thread.join(60)
        assert not errors, errors
        assert [f.result(timeout=60) for f in futures] == [reference] * CONCURRENT_REQUESTS
        assert engine.execute("s", PROBE) == reference
    finally:
        if frozen:
            resume(frozen)
        engine.shutdown()
    return path


@needs_tlc
def test_many_requests_in_flight_across_a_drained_sleep_are_accepted(concurrent_trace) -> None:
    records = read_trace(concurrent_trace)
    trace = trace_export.project(records, "s")
    changes = [(e.kind, e.before, e.state) for e in trace.events if e.kind in ("issue", "state")]
    assert ("issue", "RUNNING", "DRAINING") in changes and ("state", "DRAINING", "TRANSITIONING") in changes, changes
    assert trace.max_requests >= 4  # the drained ones; the queued ones go out together after the wake
    assert "MaxRequests = " + str(trace.max_requests) in trace_export.render_config(trace)
    assert not any(e.note for e in trace.events)
    verdicts = trace_check.validate_records(records)
    _assert_accepted(verdicts)
    print(verdicts[0].line())


@needs_tlc
def test_a_sleep_released_before_the_last_request_is_answered_is_rejected(concurrent_trace) -> None:
    """The drain's commit (DRAINING -> TRANSITIONING, after which the Sleep goes out) moved
    before the engine took the last answer to a request in flight."""
    records = read_trace(concurrent_trace)
    drained = ("DRAINING", "TRANSITIONING")
    k = next(
        i
        for i, r in enumerate(records)
        if _engine_line(r, T.StageChanged, "s") and (r.record.before, r.record.after) == drained
    )
    j = max(i for i in range(k) if _received(records[i], "result", "s"))
    records.insert(j, records.pop(k))
    _forged(records)
    [verdict] = trace_check.validate_records(records, "s")
    print(verdict.line())
    assert not verdict.accepted
    assert verdict.event.startswith(f"line {j + 1}:"), verdict.line()
    assert verdict.reason == "no spec action matches this event"


@needs_tlc
def test_the_async_engine_round_trip_is_accepted(tmp_path) -> None:
    """tests/engine's AsyncEngine round trip: a level-2 cycle with a reload, then several
    requests at once through asyncio.gather."""
    path = tmp_path / "async.jsonl"

    async def scenario() -> None:
        async with AsyncEngine([small_spec("a")], trace_path=str(path)) as engine:
            reference = await engine.execute("a", PROBE)
            assert (await engine.sleep("a", level=2)).state == "SLEEPING"
            assert (await engine.wake("a")).state == "NEEDS_RELOAD"
            assert (await engine.reload_weights("a")).state == "RUNNING"
            results = await asyncio.gather(*(engine.execute("a", PROBE) for _ in range(5)))
            assert results == [reference] * 5

    asyncio.run(scenario())
    records = read_trace(path)
    assert trace_export.project(records, "a").max_requests > 1
    verdicts = trace_check.validate_records(records)
    _assert_accepted(verdicts)
    print(verdicts[0].line())


@needs_tlc
def test_ranks_that_fail_to_load_are_accepted(tmp_path) -> None:
    """Both ranks' runner cannot be imported: each says Hello FAILED, the stage goes FAILED
    naming them and Engine() raises (LoadFailed, then StageReceive of the Hellos)."""
    path = tmp_path / "broken.jsonl"
    spec = small_spec("broken", ranks=2, runner="no_such_package.model:Runner", start_deadline_s=60.0)
    with pytest.raises(StageFailedError, match="started in FAILED"):
        Engine([spec], trace_path=str(path))
    records = read_trace(path)
    trace = trace_export.project(records, "broken")
    assert [e.wstate for e in trace.events if e.kind == "start"] == ["FAILED", "FAILED"]
    assert "error" in trace.faults and trace.max_faults >= 2
    assert [(e.before, e.state) for e in trace.events if e.kind == "state"] == [("STARTING", "FAILED")]
    verdicts = trace_check.validate_records(records)
    _assert_accepted(verdicts)
    print(verdicts[0].line())


@needs_tlc
def test_a_long_trace_is_replayed_in_chunks_each_starting_where_the_last_ended(demo_records) -> None:
    """Small chunks stand in for a long run: every chunk after the first starts from the
    state TLC printed at the end of the previous one; a tampered line late in the trace is
    still caught, in its chunk."""
    talker = trace_export.project(demo_records, "talker")
    chunks = trace_export.split(talker, 40)
    assert len(chunks) >= 3 and sum(len(c) for c in chunks) == len(talker.events)
    assert all(trace_export._is_commit(c[-1]) or c[-1].kind in ("wsend", "wstate") for c in chunks[:-1])
    verdicts = trace_check.validate_records(demo_records, "talker", chunk_events=40)
    assert [v.stage for v in verdicts] == [f"talker [{i}/{len(chunks)}]" for i in range(1, len(chunks) + 1)]
    _assert_accepted(verdicts)
    records = _copy(demo_records)
    k = max(i for i, r in enumerate(records) if _engine_line(r, T.StageChanged) and r.record.after == "SLEEPING")
    records[k].record.after = "PARTIAL"  # the talker's last commit
    verdicts = trace_check.validate_records(records, "talker", chunk_events=40)
    assert all(v.accepted for v in verdicts[:-1]) and not verdicts[-1].accepted
    assert len(verdicts) > 1 and verdicts[-1].event.startswith(f"line {k + 1}:"), verdicts[-1].line()


# ---------------------------------------------------------------- tampered traces are rejected


def _state_changed(records: list[T.TraceLine]) -> tuple[list[T.TraceLine], int]:
    """The talker's first commit records RUNNING instead of SLEEPING."""
    out = _copy(records)
    k = _first_sleeping(out)
    out[k].record.after = "RUNNING"
    return out, k


def _ack_state_changed(records: list[T.TraceLine]) -> tuple[list[T.TraceLine], int]:
    """The last ACK of that sleep says the rank is ACTIVE."""
    out = _copy(records)
    k = _last_ack_before(out, _first_sleeping(out))
    out[k].record.worker_state = "ACTIVE"
    return out, k


def _ack_removed(records: list[T.TraceLine]) -> tuple[list[T.TraceLine], int]:
    """The last ACK of that sleep is gone: the commit that follows lacks a rank."""
    out = _copy(records)
    k = _last_ack_before(out, _first_sleeping(out))
    del out[k]
    return _forged(out), _first_sleeping(out)


def _swapped(records: list[T.TraceLine]) -> tuple[list[T.TraceLine], int]:
    """The commit to SLEEPING is recorded before the last ACK it needs."""
    out = _copy(records)
    k = _first_sleeping(out)
    j = _last_ack_before(out, k)
    out.insert(j, out.pop(k))
    return _forged(out), j


@needs_tlc
@pytest.mark.parametrize(
    "tamper",
    [_state_changed, _ack_state_changed, _ack_removed, _swapped],
    ids=["state-changed", "ack-state-changed", "ack-removed", "swapped"],
)
def test_a_tampered_demo_trace_is_rejected_at_the_tampered_line(demo_records, tamper) -> None:
    records, k = tamper(demo_records)
    [verdict] = trace_check.validate_records(records, "talker")
    print(verdict.line())
    assert not verdict.accepted
    assert verdict.index is not None and verdict.event.startswith(f"line {k + 1}:"), verdict.line()
    assert verdict.reason == "no spec action matches this event"
    assert "spec there:" in verdict.line()


@needs_tlc
def test_check_cli_exit_codes(demo_records, tmp_path, capsys) -> None:
    records, _ = _swapped(demo_records)
    bad = tmp_path / "swapped.jsonl"
    bad.write_bytes(b"".join(encode_line(r) for r in records))
    assert check.main(["--trace", str(bad), "--stage", "talker"]) == 1
    out = capsys.readouterr().out
    assert "DIVERGED at event" in out and "1 diverged" in out
    assert check.main(["--trace", str(bad), "--stage", "decoder"]) == 0  # the decoder's lines are untouched
    assert check.main(["--trace", str(bad), "--stage", "nope"]) == 2
    assert check.main(["--trace", str(tmp_path / "missing.jsonl")]) == 2
    old = tmp_path / "old.jsonl"  # a trace from before typed records: refused, saying so
    old.write_text('{"seq":0,"time":1.0,"node":"engine","event":"state","task_id":"","epoch":0,"state":"RUNNING"}\n')
    assert check.main(["--trace", str(old)]) == 2
    assert "before typed records" in capsys.readouterr().out
    with pytest.raises(TraceFormatError, match=r"old\.jsonl:1"):
        read_trace(old)


@needs_tlc
def test_a_trace_with_profiles_across_a_sleep_is_accepted(tmp_path) -> None:
    """Profile start, a request, a sleep and a wake, Profile stop, all traced: the Profile
    tasks replay as the spec's IssueProfile (P-15: they change no state), start and stop."""
    path = tmp_path / "profile.jsonl"
    with Engine([small_spec("p", ranks=2, profile_dir=str(tmp_path / "traces"))], trace_path=str(path)) as engine:
        engine.profile("p", prefix="traced")
        engine.execute("p", PROBE)
        engine.sleep("p")
        engine.wake("p")
        assert len(engine.profile("p", start=False).all_paths) == 2
    records = read_trace(path)
    commands = {getattr(line.record, "command", "") for line in records}
    assert "Profile" in commands  # the engine's sends and the ranks' receipts and effects name it
    trace = trace_export.project(records, "p")
    assert [e.level for e in trace.events if e.kind == "issue" and e.cmd == "Profile"] == [1, 0]
    assert {e.kind for e in trace.events if e.cmd == "Profile"} >= {"issue", "send", "wrecv", "done"}
    _assert_accepted(trace_check.validate_records(records))


@needs_tlc
def test_a_swap_whose_wake_is_refused_for_lack_of_memory_is_accepted(tmp_path) -> None:
    """Engine.swap on a simulated device that a third process fills: the incoming stage's
    waiting wake is refused NO_MEMORY by its rank and goes back to SLEEPING (the spec's
    "nomemory" fault, a level-1 Wake on the wire), then a swap that fits succeeds."""
    from omni_core.engine import SwapFailedError
    from omni_core.workers.simulated_device import SimulatedDevice

    device = SimulatedDevice(str(tmp_path / "gpu0"), 9 << 20)
    path = tmp_path / "swap.jsonl"
    specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs, trace_path=str(path)) as engine:
        engine.sleep("decoder")
        device.write("trainer", 0, os.getpid(), device.capacity_bytes - (1 << 19))
        try:
            with pytest.raises(SwapFailedError):
                engine.swap("talker", "decoder", task_id="refused", memory_wait_s=0.2)
        finally:
            device.remove("trainer", 0, os.getpid())
        assert engine.swap("talker", "decoder", task_id="fits").incoming.state == "RUNNING"
    records = read_trace(path)
    decoder = trace_export.project(records, "decoder")
    assert "nomemory" in decoder.faults and "badsource" not in decoder.faults
    assert [e.level for e in decoder.events if e.kind == "issue" and e.cmd == "Wake"] == [1, 1]
    assert sum(e.kind == "wsend" and e.info == "NO_MEMORY" for e in decoder.events) == 1
    _assert_accepted(trace_check.validate_records(records))


@needs_tlc
def test_a_swap_whose_outgoing_stage_releases_late_is_accepted(tmp_path, monkeypatch) -> None:
    """The outgoing stage told what the incoming one wakes (Sleep.incoming_bytes), with room
    beside it, keeps its memory until its last copy: a hint that moves no state, so the run's
    trace replays as any swap's."""
    import json

    from omni_core.workers.simulated_device import SimulatedDevice

    log = tmp_path / "sleeps.jsonl"
    monkeypatch.setenv("OMNI_TEST_RELEASE_LOG", str(log))
    device = SimulatedDevice(str(tmp_path / "gpu0"), 64 << 20)
    backend = "tests.engine.release_backend:ReleaseRecordingBackend"
    path = tmp_path / "late.jsonl"
    specs = [small_spec(name, backend=backend, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs, trace_path=str(path)) as engine:
        engine.sleep("decoder")
        engine.swap("talker", "decoder", task_id="fits")
    assert [json.loads(line)["release_late"] for line in log.read_text().splitlines()] == [False, True]
    records = read_trace(path)
    assert any(isinstance(r.record, T.StageSent) and r.record.command == "Sleep" for r in records)
    _assert_accepted(trace_check.validate_records(records))
