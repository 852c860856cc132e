"""The engine with real processes: the demo, failures, deadlines, retries, admission."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import threading
import time
from concurrent.futures import Future

import pytest

from omni_core.demo import Demo
from omni_core.engine import (
    AsyncEngine,
    Engine,
    InvalidArgumentError,
    OmniCoreError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    StageSpec,
)
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, rank_pid, resume, small_spec, wait_for


def test_demo_scenario_passes_and_traces_every_node(tmp_path) -> None:
    out = io.StringIO()
    trace = tmp_path / "trace.jsonl"
    code = Demo(weights_mib=4, trace_path=str(trace), out=out).run()
    text = out.getvalue()
    assert code == 0, text
    assert "verdict: PASS" in text
    for step in ("2 sleep L1", "3 wake", "4 sleep L2", "4 reload", "5 reject", "5 queue", "5 wake"):
        assert step in text
    records = read_trace(trace)
    nodes = {r["node"] for r in records}
    assert "engine" in nodes
    assert len(nodes) >= 4, nodes  # the engine and three ranks
    states = [r["state"] for r in records if r["node"] == "engine" and r["event"] == "state"]
    assert "SLEEPING" in states and "NEEDS_RELOAD" in states


def test_rank_killed_mid_sleep_fails_the_stage_naming_it_and_restart_recovers(engine_factory) -> None:
    engine = engine_factory(small_spec("talker", ranks=2), small_spec("decoder"))
    talker_ref = engine.execute("talker", PROBE)
    decoder_ref = engine.execute("decoder", PROBE)
    victim = rank_pid(engine, "talker", 1)
    os.kill(victim, signal.SIGSTOP)  # frozen: the sleep cannot complete before the kill
    outcome: dict[str, BaseException | object] = {}

    def sleeper() -> None:
        try:
            outcome["report"] = engine.sleep("talker", level=1, timeout_s=30.0)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=sleeper)
    started = time.monotonic()
    thread.start()
    wait_for(lambda: engine.status()["talker"]["state"] == "TRANSITIONING", what="TRANSITIONING")
    os.kill(victim, signal.SIGKILL)
    thread.join(30.0)
    elapsed_s = time.monotonic() - started
    error = outcome.get("error")
    assert isinstance(error, StageFailedError), outcome
    assert set(error.failures) == {1}, error.failures
    assert "died" in error.failures[1] and "rank 1" in str(error)
    assert elapsed_s < 15.0, f"failure took {elapsed_s:.1f} s; the sentinel should beat the 30 s deadline"
    assert engine.status()["talker"]["state"] == "FAILED"
    assert engine.execute("decoder", PROBE) == decoder_ref  # the other stage keeps serving
    with pytest.raises(RequestRejectedError, match="FAILED"):
        engine.execute("talker", PROBE)
    with pytest.raises(InvalidArgumentError, match="restart"):
        engine.wake("talker")
    epoch_before = engine.status()["talker"]["epoch"]
    engine.restart("talker")
    status = engine.status()["talker"]
    assert status["state"] == "RUNNING" and status["epoch"] == epoch_before + 1
    assert engine.execute("talker", PROBE) == talker_ref
    assert engine.sleep("talker").state == "SLEEPING"
    assert engine.wake("talker").state == "RUNNING"


def test_silent_rank_ends_in_failed_at_the_deadline_naming_it(engine_factory) -> None:
    engine = engine_factory(small_spec("solo", ranks=2))
    silent = rank_pid(engine, "solo", 0)
    os.kill(silent, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(StageFailedError) as caught:
            engine.sleep("solo", timeout_s=1.5)
        elapsed_s = time.monotonic() - started
        assert 1.4 <= elapsed_s < 5.0, elapsed_s
        assert set(caught.value.failures) == {0}
        assert "no reply to Sleep within 1.5 s" in caught.value.failures[0]
        assert engine.status()["solo"]["state"] == "FAILED"
    finally:
        resume(silent)
    engine.restart("solo")
    assert engine.status()["solo"]["state"] == "RUNNING"


def test_retries_with_the_same_task_id_are_idempotent(engine_factory) -> None:
    engine = engine_factory(small_spec("s", ranks=2))
    first = engine.sleep("s", task_id="sleep-A")
    again = engine.sleep("s", task_id="sleep-A")
    assert again == first  # answered from the record: no second effect, same figures
    assert first.status == "OK" and first.state == "SLEEPING"
    assert all(r.freed_bytes > 0 for r in first.ranks.values())
    with pytest.raises(InvalidArgumentError, match="task_id 'sleep-A' was used"):
        engine.wake("s", task_id="sleep-A")
    # Concurrent retries of one wake: both callers get the one outcome.
    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(engine.wake("s", task_id="wake-A")))
               for _ in range(2)]  # fmt: skip
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 2 and results[0] == results[1]
    assert results[0].state == "RUNNING" and results[0].status == "OK"
    counters = engine.status()["s"]["counters"]
    assert counters["retries"] >= 2


@pytest.mark.parametrize("policy", ["queue", "reject", "wake"])
def test_fifty_concurrent_requests_across_a_sleep_wake_cycle(engine_factory, policy: str) -> None:
    engine = engine_factory(small_spec("s", ranks=2, admission=policy))
    reference = engine.execute("s", PROBE)
    futures: list[Future] = []
    cycle_errors: list[BaseException] = []

    def cycle() -> None:
        try:
            engine.sleep("s", level=1)
            if policy != "wake":  # under "wake" the queued requests wake the stage themselves
                time.sleep(0.05)
                engine.wake("s")
        except BaseException as exc:
            cycle_errors.append(exc)

    thread = threading.Thread(target=cycle)
    thread.start()
    for _ in range(50):
        futures.append(engine.submit("s", PROBE))
        time.sleep(0.004)
    thread.join(60)
    assert not cycle_errors, cycle_errors
    outcomes = []
    for future in futures:
        try:
            outcomes.append(("ok", future.result(timeout=60)))
        except OmniCoreError as exc:
            outcomes.append(("error", exc))
    assert len(outcomes) == 50  # every request got exactly one result or error
    oks = [value for kind, value in outcomes if kind == "ok"]
    errors = [value for kind, value in outcomes if kind == "error"]
    assert all(value == reference for value in oks)
    if policy == "reject":
        assert all(isinstance(e, RequestRejectedError) and "reject" in str(e) for e in errors)
    else:
        assert not errors, errors[:3]
    assert engine.status()["s"]["state"] == "RUNNING"
    assert engine.execute("s", PROBE) == reference


def test_bad_arguments_are_refused_before_anything_is_sent(engine_factory) -> None:
    with pytest.raises(InvalidArgumentError, match="ranks must be"):
        StageSpec("x", ranks=0)
    with pytest.raises(InvalidArgumentError, match="devices for 2 ranks"):
        StageSpec("x", ranks=2, devices=("0",))
    with pytest.raises(InvalidArgumentError, match="admission"):
        StageSpec("x", admission="sometimes")
    with pytest.raises(InvalidArgumentError, match="backend"):
        StageSpec("x", backend="magic")
    engine = engine_factory(small_spec("s"))
    with pytest.raises(InvalidArgumentError, match="unknown stage 'nope'"):
        engine.sleep("nope")
    with pytest.raises(InvalidArgumentError, match="level must be 1 or 2"):
        engine.sleep("s", level=3)
    with pytest.raises(InvalidArgumentError, match="unknown tag"):
        engine.sleep("s", tags=["activations"])
    with pytest.raises(InvalidArgumentError, match="timeout_s"):
        engine.wake("s", timeout_s=-1)
    with pytest.raises(InvalidArgumentError, match="cannot reload"):
        engine.reload_weights("s")
    status = engine.status()["s"]
    assert status["state"] == "RUNNING" and status["counters"]["retries"] == 0


def test_async_engine_round_trip() -> None:
    async def scenario() -> None:
        async with AsyncEngine([small_spec("a")]) as engine:
            ref = await engine.execute("a", PROBE)
            report = await engine.sleep("a", level=2)
            assert report.state == "SLEEPING"
            assert (await engine.wake("a")).state == "NEEDS_RELOAD"
            assert (await engine.reload_weights("a")).state == "RUNNING"
            results = await asyncio.gather(*(engine.execute("a", PROBE) for _ in range(5)))
            assert all(r == ref for r in results)

    asyncio.run(scenario())


def test_a_rank_that_cannot_load_fails_the_start_with_its_reason() -> None:
    spec = small_spec("broken", runner="no_such_package.model:Runner", start_deadline_s=60.0)
    started = time.monotonic()
    with pytest.raises(StageFailedError) as caught:
        Engine([spec])
    assert time.monotonic() - started < 30.0
    message = str(caught.value)
    assert "rank 0" in message and "no_such_package" in message, message


def test_abort_in_flight_answers_callers_but_sleeps_only_after_every_rank_answered(engine_factory) -> None:
    engine = engine_factory(small_spec("s", ranks=2))
    reference = engine.execute("s", PROBE)
    busy = rank_pid(engine, "s", 1)
    os.kill(busy, signal.SIGSTOP)  # rank 1 "still running" the request below
    try:
        request = engine.submit("s", PROBE)
        wait_for(lambda: engine.status()["s"]["in_flight"] == 1, what="request in flight")
        outcome: dict[str, object] = {}
        thread = threading.Thread(target=lambda: outcome.setdefault(
            "report", engine.sleep("s", timeout_s=30, abort_in_flight=True)))
        thread.start()
        with pytest.raises(RequestFailedError, match="aborted"):
            request.result(timeout=10)
        time.sleep(0.3)
        # The caller has its answer, but rank 1 has not answered the request: no Sleep yet.
        assert engine.status()["s"]["state"] == "DRAINING"
    finally:
        resume(busy)
    thread.join(30)
    assert outcome["report"].state == "SLEEPING"
    engine.wake("s")
    assert engine.execute("s", PROBE) == reference


def test_a_rank_silent_on_a_request_fails_the_stage_naming_it(engine_factory) -> None:
    engine = engine_factory(small_spec("s", ranks=2))
    silent = rank_pid(engine, "s", 1)
    os.kill(silent, signal.SIGSTOP)
    try:
        with pytest.raises(RequestFailedError, match=r"ranks \[1\] gave no result"):
            engine.execute("s", PROBE, timeout_s=1.0)
        wait_for(lambda: engine.status()["s"]["state"] == "FAILED", timeout_s=5, what="FAILED")
        assert "rank 1: no result for request" in engine.status()["s"]["failure"]
    finally:
        resume(silent)
    engine.restart("s")
    assert engine.status()["s"]["state"] == "RUNNING"


def test_requests_beyond_max_in_flight_wait_in_the_queue_and_all_complete(engine_factory) -> None:
    engine = engine_factory(small_spec("s", max_in_flight=2, queue_limit=30))
    reference = engine.execute("s", PROBE)
    futures = [engine.submit("s", PROBE) for _ in range(30)]
    assert all(f.result(timeout=60) == reference for f in futures)
    overflow = [engine.submit("s", PROBE) for _ in range(40)]
    outcomes = []
    for future in overflow:
        try:
            outcomes.append(future.result(timeout=60) == reference)
        except RequestRejectedError as exc:
            assert "max_in_flight" in str(exc)
            outcomes.append("rejected")
    assert "rejected" in outcomes and True in outcomes
