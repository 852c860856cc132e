"""The engine with real processes: the demo, failures, deadlines, retries, admission."""

from __future__ import annotations

import asyncio
import io
import itertools
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
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import (
    AT_ONCE_BOUND_S,
    LONG_TIMEOUT_S,
    PROBE,
    in_thread,
    rank_pid,
    request_held_by_a_stopped_rank,
    resume,
    small_spec,
    wait_for,
)

# A deadline that has fired is late by at most the orchestrator's poll interval; the bound on
# how long a test waits for it is ten times the deadline, for a loaded 2-core machine.
DEADLINE_MARGIN = 10


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
    nodes = {(r.stage, r.rank) for r in records}
    assert {r.pid for r in records if r.is_engine} == {os.getpid()}
    assert len(nodes) >= 5, nodes  # the engine for each of two stages, and three ranks
    states = [r.record.after for r in records if isinstance(r.record, (T.StageChanged, T.StageIssued))]
    assert "SLEEPING" in states and "NEEDS_RELOAD" in states
    for pid in {r.pid for r in records}:  # program order, one clock per process
        mine = [r for r in records if r.pid == pid]
        assert [r.seq for r in mine] == list(range(len(mine)))
        assert all(a.mono_s <= b.mono_s for a, b in itertools.pairwise(mine))


def test_rank_killed_mid_sleep_fails_the_stage_naming_it_and_restart_recovers(engine_factory) -> None:
    engine = engine_factory(small_spec("talker", ranks=2), small_spec("decoder"))
    talker_ref = engine.execute("talker", PROBE)
    decoder_ref = engine.execute("decoder", PROBE)
    victim = rank_pid(engine, "talker", 1)
    os.kill(victim, signal.SIGSTOP)  # frozen: the sleep cannot complete before the kill
    sleeping = in_thread(lambda: engine.sleep("talker", level=1, timeout_s=LONG_TIMEOUT_S))
    wait_for(lambda: engine.status()["talker"]["state"] == "TRANSITIONING", what="TRANSITIONING")
    os.kill(victim, signal.SIGKILL)
    error = sleeping.exception(timeout=LONG_TIMEOUT_S + 30)
    assert isinstance(error, StageFailedError), error
    assert set(error.failures) == {1}, error.failures
    # The reason, not the clock, shows the process sentinel acted: the deadline's own failure
    # would read "no reply to Sleep within 30 s".
    assert "process died" in error.failures[1] and "rank 1" in str(error), error.failures
    assert "within" not in error.failures[1]
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
    deadline_s = 1.5
    try:
        started = time.monotonic()
        error = in_thread(lambda: engine.sleep("solo", timeout_s=deadline_s)).exception(
            timeout=deadline_s * DEADLINE_MARGIN
        )
        elapsed_s = time.monotonic() - started
        assert isinstance(error, StageFailedError), error
        assert elapsed_s >= deadline_s, elapsed_s  # the deadline ended it, nothing earlier
        assert set(error.failures) == {0}
        assert "no reply to Sleep within 1.5 s" in error.failures[0]
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
    threads = [threading.Thread(target=lambda: results.append(engine.wake("s", task_id="wake-A"))) for _ in range(2)]
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
    """20 requests race the sleep, 5 arrive while the stage is known to be asleep, 25 race
    the wake. Each has a long deadline of its own, so a request that ends early was refused
    or served by the policy, never expired by a deadline."""
    engine = engine_factory(small_spec("s", ranks=2, admission=policy))
    reference = engine.execute("s", PROBE)
    futures: list[Future] = []
    submitted_at: list[float] = []
    done_at: dict[int, float] = {}

    def submit() -> Future:
        index = len(futures)
        submitted_at.append(time.monotonic())
        future = engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S)
        future.add_done_callback(lambda _f, i=index: done_at.setdefault(i, time.monotonic()))
        futures.append(future)
        return future

    sleeping = in_thread(lambda: engine.sleep("s", level=1))
    for _ in range(20):
        submit()
        time.sleep(0.004)
    assert sleeping.result(timeout=60).state == "SLEEPING"
    # Nobody wakes the stage until these five are in (except "wake", whose requests do):
    # the orchestrator runs calls in order, so status() answers after all five were admitted.
    asleep = [submit() for _ in range(5)]
    status = engine.status()["s"]
    if policy == "reject":
        assert status["state"] == "SLEEPING", status
        for future in asleep:
            assert future.done(), "a request to a sleeping stage under 'reject' must be refused at once"
            error = future.exception()
            assert isinstance(error, RequestRejectedError) and "'reject'" in str(error), error
    elif policy == "queue":
        assert status["state"] == "SLEEPING" and status["queued"] >= len(asleep), status
        assert not any(f.done() for f in asleep), "queued requests ran on a sleeping stage"
    else:
        assert status["state"] in ("WAKING", "RUNNING"), f"no request woke the stage: {status}"
    waking = in_thread(lambda: engine.wake("s")) if policy != "wake" else None
    for _ in range(25):
        submit()
        time.sleep(0.004)
    if waking is not None:
        assert waking.result(timeout=60).state == "RUNNING"
    outcomes = []
    for future in futures:
        try:
            outcomes.append(("ok", future.result(timeout=LONG_TIMEOUT_S + 30)))
        except OmniCoreError as exc:
            outcomes.append(("error", exc))
    assert len(outcomes) == 50  # every request got exactly one result or error
    oks = [value for kind, value in outcomes if kind == "ok"]
    errors = [value for kind, value in outcomes if kind == "error"]
    assert all(value == reference for value in oks)
    if policy == "reject":
        assert len(errors) >= len(asleep)
        assert all(isinstance(e, RequestRejectedError) and "reject" in str(e) for e in errors)
        refused = [i for i, (kind, _) in enumerate(outcomes) if kind == "error"]
        slowest_s = max(done_at[i] - submitted_at[i] for i in refused)
        assert slowest_s < AT_ONCE_BOUND_S, f"a rejection took {slowest_s:.2f} s; 'reject' answers at once"
    else:
        assert not errors, errors[:3]
    assert engine.status()["s"]["state"] == "RUNNING"
    assert engine.execute("s", PROBE) == reference


def test_bad_arguments_are_refused_before_anything_is_sent(engine_factory) -> None:
    with pytest.raises(InvalidArgumentError, match="field 'ranks': expected an integer >= 1, got 0"):
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
            # A restart answers the version it came back at, and a reset says what it dropped.
            await engine.update_weights("a", "seed:4", version=2)
            back = await engine.restart("a")
            assert (back.state, back.weights_version, back.epoch) == ("RUNNING", 2, 1)
            reset = await engine.restart("a", from_checkpoint=True)
            assert (reset.weights_version, reset.version_reset_from) == (0, 2)
            assert await engine.execute("a", PROBE) == ref

    asyncio.run(scenario())


def test_a_rank_that_cannot_load_fails_the_start_with_its_reason() -> None:
    spec = small_spec("broken", runner="no_such_package.model:Runner", start_deadline_s=60.0)
    started = time.monotonic()
    with pytest.raises(StageFailedError) as caught:
        Engine([spec])
    assert time.monotonic() - started < 30.0
    message = str(caught.value)
    assert "rank 0" in message and "no_such_package" in message, message


@pytest.mark.parametrize("abort", [False, True], ids=["wait", "abort"])
def test_sleep_is_sent_only_after_every_rank_answered_the_request_in_flight(
    engine_factory, tmp_path, abort: bool
) -> None:
    """The drain: with abort_in_flight the caller hears at once, without it the caller gets
    its result; either way no Sleep goes out while a rank still runs the request."""
    trace = tmp_path / "trace.jsonl"
    engine = engine_factory(small_spec("s", ranks=2), trace_path=str(trace))
    reference = engine.execute("s", PROBE)
    with request_held_by_a_stopped_rank(engine, "s") as request:  # rank 1 "still running" it
        sleeping = in_thread(lambda: engine.sleep("s", timeout_s=LONG_TIMEOUT_S, abort_in_flight=abort))
        wait_for(lambda: engine.status()["s"]["state"] != "RUNNING", what="the sleep to close admission")
        if abort:
            assert request.done(), "abort_in_flight answers the callers when the sleep starts"
            with pytest.raises(RequestFailedError, match="aborted"):
                request.result()
        # Rank 1 is stopped, so it cannot have answered: whatever rank 0 did, the request
        # still holds the drain and the Sleep has not gone out.
        status = engine.status()["s"]
        assert (status["state"], status["in_flight"]) == ("DRAINING", 1), status
        assert not sleeping.done()
        assert abort or not request.done()
    assert sleeping.result(timeout=60).state == "SLEEPING"
    if not abort:
        assert request.result(timeout=10) == reference
    engine.wake("s")
    assert engine.execute("s", PROBE) == reference
    events = [r.record for r in read_trace(trace) if r.is_engine]
    sent = [r for r in events if isinstance(r, T.StageSent)]
    executes = [r.task_id for r in sent if r.command == "Execute" and r.rank == 1]
    held = executes[1]  # the request sent while rank 1 was stopped
    answered_at = next(
        i for i, r in enumerate(events) if isinstance(r, T.StageReceived) and r.task_id == held and r.rank == 1
    )
    sleep_sent_at = next(i for i, r in enumerate(events) if isinstance(r, T.StageSent) and r.command == "Sleep")
    assert answered_at < sleep_sent_at, "Sleep was sent before rank 1 answered the request in flight"


def test_a_rank_silent_on_a_request_fails_the_stage_naming_it(engine_factory) -> None:
    engine = engine_factory(small_spec("s", ranks=2))
    silent = rank_pid(engine, "s", 1)
    os.kill(silent, signal.SIGSTOP)
    deadline_s = 1.0
    try:
        started = time.monotonic()
        request = engine.submit("s", PROBE, timeout_s=deadline_s)
        error = request.exception(timeout=deadline_s * DEADLINE_MARGIN)
        assert time.monotonic() - started >= deadline_s
        assert isinstance(error, RequestFailedError) and "ranks [1] gave no result" in str(error), error
        # The tick that expired the request failed the stage before the loop took the next call.
        status = engine.status()["s"]
        assert status["state"] == "FAILED", status
        assert "rank 1: no result for request" in status["failure"]
    finally:
        resume(silent)
    engine.restart("s")
    assert engine.status()["s"]["state"] == "RUNNING"


def test_requests_beyond_max_in_flight_wait_in_the_queue_and_all_complete(engine_factory) -> None:
    engine = engine_factory(small_spec("s", max_in_flight=2, queue_limit=30))
    reference = engine.execute("s", PROBE)
    futures = [engine.submit("s", PROBE) for _ in range(30)]
    assert all(f.result(timeout=60) == reference for f in futures)
    # With the rank stopped nothing completes: exactly max_in_flight + queue_limit fit.
    busy = rank_pid(engine, "s", 0)
    os.kill(busy, signal.SIGSTOP)
    try:
        held = [engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S) for _ in range(2 + 30)]
        overflow = [engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S) for _ in range(5)]
        status = engine.status()["s"]  # answered after every submit above was admitted or refused
        assert (status["in_flight"], status["queued"]) == (2, 30), status
        assert not any(f.done() for f in held)
        for future in overflow:
            assert future.done(), "a request beyond max_in_flight + queue_limit must be refused at once"
            error = future.exception()
            assert isinstance(error, RequestRejectedError) and "max_in_flight" in str(error), error
    finally:
        resume(busy)
    assert all(f.result(timeout=60) == reference for f in held)


def test_a_queued_request_is_refused_at_its_own_deadline_if_the_stage_stays_asleep(engine_factory) -> None:
    engine = engine_factory(small_spec("s"))
    reference = engine.execute("s", PROBE)
    engine.sleep("s")
    deadline_s = 1.0
    started = time.monotonic()
    request = engine.submit("s", PROBE, timeout_s=deadline_s)
    error = request.exception(timeout=deadline_s * DEADLINE_MARGIN)
    assert time.monotonic() - started >= deadline_s
    assert isinstance(error, RequestRejectedError), error
    assert "waited in the queue" in str(error) and "SLEEPING" in str(error), error
    status = engine.status()["s"]
    assert (status["state"], status["queued"]) == ("SLEEPING", 0), status
    engine.wake("s")
    assert engine.execute("s", PROBE) == reference


def test_a_queued_request_expires_at_its_own_deadline_behind_a_longer_one(engine_factory) -> None:
    engine = engine_factory(small_spec("s"))
    engine.sleep("s")
    deadline_s = 1.0
    patient = engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S)
    hurried = engine.submit("s", PROBE, timeout_s=deadline_s)
    error = hurried.exception(timeout=deadline_s * DEADLINE_MARGIN)
    assert isinstance(error, RequestRejectedError) and "waited in the queue" in str(error), error
    assert not patient.done()


def test_a_sleeping_stage_refuses_beyond_its_queue_and_everything_while_it_needs_a_reload(engine_factory) -> None:
    engine = engine_factory(small_spec("s", queue_limit=3))
    reference = engine.execute("s", PROBE)
    engine.sleep("s", level=2)
    queued = [engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S) for _ in range(3)]
    overflow = [engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S) for _ in range(2)]
    status = engine.status()["s"]  # answered after all five submits were admitted or refused
    assert (status["state"], status["queued"]) == ("SLEEPING", 3), status
    assert not any(f.done() for f in queued)
    for future in overflow:
        assert future.done(), "a request beyond a sleeping stage's queue_limit must be refused at once"
        error = future.exception()
        assert isinstance(error, RequestRejectedError) and "queue is full" in str(error), error
    # Woken after level 2 the weights are garbage: what waited is refused, not left to expire.
    assert engine.wake("s").state == "NEEDS_RELOAD"
    status = engine.status()["s"]
    assert (status["state"], status["queued"]) == ("NEEDS_RELOAD", 0), status
    for future in queued:
        assert future.done(), "requests queued for a stage that lands in NEEDS_RELOAD must be refused"
        error = future.exception()
        assert isinstance(error, RequestRejectedError) and "NEEDS_RELOAD" in str(error), error
    late = engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S)
    engine.status()
    assert late.done(), "a request to a NEEDS_RELOAD stage must be refused at once"
    assert isinstance(late.exception(), RequestRejectedError) and "NEEDS_RELOAD" in str(late.exception())
    assert engine.reload_weights("s").state == "RUNNING"
    assert engine.execute("s", PROBE) == reference


def test_a_rank_silent_at_start_fails_the_start_at_the_start_deadline() -> None:
    start_deadline_s = 1.0
    # The rank holds ten deadlines long, then exits: only the start deadline can name it first.
    spec = small_spec(
        "mute",
        runner="tests.engine.hold_runner:HoldRunner",
        start_deadline_s=start_deadline_s,
        runner_args={"hold_s": start_deadline_s * DEADLINE_MARGIN},
    )
    started = time.monotonic()
    with pytest.raises(StageFailedError) as caught:
        Engine([spec])
    assert time.monotonic() - started >= start_deadline_s
    assert caught.value.failures == {0: "sent no Hello before the start-up deadline"}, caught.value.failures


def test_each_rank_reports_the_backend_auto_chose_and_why(engine_factory) -> None:
    """The Hello carries the backend a rank runs and, under `auto`, why it was chosen; the
    stage's status shows both (here: no CUDA, so `portable`, naming what `cumem` lacked)."""
    engine = engine_factory(small_spec("s", backend="auto"))
    rank = engine.status()["s"]["ranks"][0]
    assert rank["backend"] == "portable"
    assert rank["backend_reason"].startswith("auto chose 'portable'") and "CUDA" in rank["backend_reason"]
    engine.restart("s")
    assert engine.status()["s"]["ranks"][0]["backend"] == "portable"
