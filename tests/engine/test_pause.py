"""Engine.pause / resume / is_paused with real rank processes: the pause waits for the request
in flight (a stopped rank still runs it), holds what arrives meanwhile, sends the ranks
nothing, and resume serves the held request."""

from __future__ import annotations

import asyncio

import pytest

from omni_core.engine import AsyncEngine, InvalidArgumentError, RequestFailedError
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import LONG_TIMEOUT_S, PROBE, in_thread, request_held_by_a_stopped_rank, small_spec, wait_for


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_pause_drains_holds_new_requests_and_resume_serves_them(engine_factory, tmp_path, mode: str) -> None:
    trace = tmp_path / "trace.jsonl"
    engine = engine_factory(small_spec("s", ranks=2), trace_path=str(trace))
    reference = engine.execute("s", PROBE)
    with request_held_by_a_stopped_rank(engine, "s") as running:  # rank 1 "still running" it
        pausing = in_thread(lambda: engine.pause("s", mode, timeout_s=LONG_TIMEOUT_S))
        wait_for(lambda: engine.status()["s"]["state"] == "DRAINING", what="the pause to close admission")
        held = engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S)
        assert not pausing.done() and not engine.is_paused("s")  # a rank still runs the request
        assert running.done() is (mode == "abort")
    report = pausing.result(timeout=60)
    assert (report.command, report.status, report.state, report.ranks) == ("Pause", "OK", "PAUSED", {})
    assert engine.is_paused("s") and engine.status()["s"]["queued"] == 1 and not held.done()
    if mode == "abort":
        with pytest.raises(RequestFailedError, match="aborted: stage 's' is pausing"):
            running.result()
    else:
        assert running.result(timeout=10) == reference
    assert engine.pause("s", "keep").status == "ALREADY"
    with pytest.raises(InvalidArgumentError, match="pause mode must be one of"):
        engine.pause("s", "freeze")
    resumed = engine.resume("s")
    assert (resumed.command, resumed.status, resumed.state) == ("Resume", "OK", "RUNNING")
    assert held.result(timeout=LONG_TIMEOUT_S) == reference and not engine.is_paused("s")
    sent = [r.record.command for r in read_trace(trace) if isinstance(r.record, T.StageSent)]
    assert set(sent) == {"Execute"}, "a pause or a resume sent the ranks something"


def test_async_engine_pauses_and_resumes(tmp_path) -> None:
    async def main() -> tuple[str, bool, str, bool]:
        async with AsyncEngine([small_spec("a")]) as engine:
            paused = await engine.pause("a", "wait")
            during = await engine.is_paused("a")
            resumed = await engine.resume("a")
            return paused.state, during, resumed.state, await engine.is_paused("a")

    assert asyncio.run(main()) == ("PAUSED", True, "RUNNING", False)


def test_a_pause_holds_through_a_sleep_and_the_admission_policys_wake(engine_factory) -> None:
    """pause -> sleep -> a request under admission 'wake': the stage wakes for the request and
    is PAUSED again, the request queued; it runs after resume(), on the weights it slept with."""
    engine = engine_factory(small_spec("s", admission="wake"))
    reference = engine.execute("s", PROBE)
    engine.pause("s")
    assert engine.sleep("s", 1).state == "SLEEPING" and engine.is_paused("s")
    held = engine.submit("s", PROBE, timeout_s=LONG_TIMEOUT_S)
    wait_for(lambda: engine.status()["s"]["state"] == "PAUSED", what="the policy's wake to end PAUSED")
    status = engine.status()["s"]
    assert (status["paused"], status["queued"], status["in_flight"], status["asleep_tags"]) == (True, 1, 0, [])
    assert not held.done()
    assert engine.resume("s").state == "RUNNING"
    assert held.result(timeout=60) == reference
