"""Continuous batching with real rank processes: a runner that steps its running requests
(`SteppingRunner`, as the vllm runner drives vLLM's add_request/step) takes a request that
arrives while another runs at its next step, and answers each as it finishes; a lifecycle
command waits for every running request; a failed step fails each running request once and
the rank serves on; a rank killed mid-step fails each request once."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from omni_core.engine import RequestFailedError
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, rank_pid, small_spec, wait_for

RUNNER = "tests.engine.stepping_runner:SteppingRunner"


def _spec(**overrides):
    return small_spec("c", runner=RUNNER, max_in_flight=16, batch_max_requests=16, **overrides)


def _counters(engine) -> dict[str, int]:
    return engine.status()["c"]["ranks"][0]["runner_counters"]


def _held(engine, release: Path):
    """A request that runs until `release` exists: it is running once the stage sees it in flight."""
    held = engine.submit("c", {"seed": 99, "until": str(release)}, timeout_s=LONG_TIMEOUT_S)
    wait_for(lambda: engine.status()["c"]["in_flight"] == 1, what="the held request in flight")
    return held


def test_requests_join_a_running_one_and_answer_before_it(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(_spec())
    alone = [engine.execute("c", {"seed": i, "steps": 1 + i}) for i in range(4)]
    held = _held(engine, tmp_path / "release")
    # Without continuous batching these would wait behind the held request's batch forever.
    joined = [engine.submit("c", {"seed": i, "steps": 1 + i}, timeout_s=LONG_TIMEOUT_S) for i in range(4)]
    assert [f.result(timeout=LONG_TIMEOUT_S) for f in joined] == alone
    assert not held.done()
    (tmp_path / "release").touch()
    assert held.result(timeout=LONG_TIMEOUT_S) == engine.execute("c", {"seed": 99})
    counters = _counters(engine)
    assert counters["joined_running"] >= 4 and counters["largest_running"] >= 2


def test_a_sleep_waits_for_the_running_requests(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(_spec())
    held = _held(engine, tmp_path / "release")
    sleeping = in_thread(lambda: engine.sleep("c", level=1, timeout_s=LONG_TIMEOUT_S))
    wait_for(lambda: engine.status()["c"]["state"] == "DRAINING", what="the sleep to drain")
    assert not sleeping.done() and not held.done()
    (tmp_path / "release").touch()
    assert isinstance(held.result(timeout=LONG_TIMEOUT_S), dict)
    report = sleeping.result(timeout=LONG_TIMEOUT_S)
    assert (report.status, report.state) == ("OK", "SLEEPING")


def test_a_failed_step_fails_each_running_request_and_the_rank_serves_on(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(_spec())
    held = _held(engine, tmp_path / "release")
    failing = engine.submit("c", {"seed": 1, "fail_step": True}, timeout_s=LONG_TIMEOUT_S)
    for future in (held, failing):
        with pytest.raises(RequestFailedError, match="a step failed"):
            future.result(timeout=LONG_TIMEOUT_S)
    assert engine.execute("c", {"seed": 2, "steps": 3}) == engine.execute("c", {"seed": 2})
    assert engine.status()["c"]["state"] == "RUNNING"


def test_a_bad_payload_is_its_own_error_beside_running_requests(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(_spec())
    held = _held(engine, tmp_path / "release")
    with pytest.raises(RequestFailedError, match="int 'steps'"):
        engine.execute("c", {"seed": 1, "steps": "many"}, timeout_s=LONG_TIMEOUT_S)
    assert not held.done()
    (tmp_path / "release").touch()
    assert isinstance(held.result(timeout=LONG_TIMEOUT_S), dict)


def test_a_rank_killed_mid_step_fails_each_request_once(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(_spec())
    held = _held(engine, tmp_path / "release")
    other = engine.submit("c", {"seed": 3, "until": str(tmp_path / "release")}, timeout_s=LONG_TIMEOUT_S)
    wait_for(lambda: engine.status()["c"]["in_flight"] == 2, what="both in flight")
    os.kill(rank_pid(engine, "c", 0), signal.SIGKILL)
    for future in (held, other):
        with pytest.raises(RequestFailedError, match="rank 0: process died"):
            future.result(timeout=LONG_TIMEOUT_S)
    assert engine.status()["c"]["state"] == "FAILED"
