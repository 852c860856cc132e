"""Many requests in flight per rank, with real rank processes: the requests waiting on a
rank's socket reach its runner as one batch, each answered with its own result; a sleep
waits for the whole batch, and a rank killed with a batch fails each request once."""

from __future__ import annotations

import os
import signal

import pytest

from omni_core.engine import RequestFailedError
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, rank_pid, resume, small_spec, wait_for

RUNNER = "tests.engine.batch_runner:BatchCountingRunner"
N = 8


def _spec(**overrides):
    return small_spec("b", ranks=2, runner=RUNNER, max_in_flight=16, batch_max_requests=16, **overrides)


def _counters(engine, rank: int) -> dict[str, int]:
    return engine.status()["b"]["ranks"][rank]["runner_counters"]


def _held(engine, n: int = N):
    """`n` requests sent while rank 1 is stopped: they wait on its socket, together."""
    pid = rank_pid(engine, "b", 1)
    os.kill(pid, signal.SIGSTOP)
    try:
        futures = [engine.submit("b", {"seed": i, "batch": 1}, timeout_s=LONG_TIMEOUT_S) for i in range(n)]
        wait_for(lambda: engine.status()["b"]["in_flight"] == n, what="requests in flight")
    except BaseException:
        resume(pid)
        raise
    return pid, futures


def test_requests_waiting_on_a_rank_reach_its_runner_together(engine_factory) -> None:
    engine = engine_factory(_spec())
    alone = [engine.execute("b", {"seed": i, "batch": 1}) for i in range(N)]
    before = _counters(engine, 1)
    pid, futures = _held(engine)
    resume(pid)
    assert [f.result(timeout=LONG_TIMEOUT_S) for f in futures] == alone
    after = _counters(engine, 1)
    assert after["batched_requests"] - before["batched_requests"] == N
    assert after["largest_batch"] > 1 and after["batches"] - before["batches"] < N


def test_a_sleep_waits_for_every_request_of_a_rank_batch(engine_factory) -> None:
    engine = engine_factory(_spec())
    pid, futures = _held(engine)
    try:
        sleeping = in_thread(lambda: engine.sleep("b", level=1, timeout_s=LONG_TIMEOUT_S))
        wait_for(lambda: engine.status()["b"]["state"] == "DRAINING", what="the sleep to drain")
        assert not sleeping.done() and not any(f.done() for f in futures)
    finally:
        resume(pid)
    assert all(isinstance(f.result(timeout=LONG_TIMEOUT_S), dict) for f in futures)
    report = sleeping.result(timeout=LONG_TIMEOUT_S)
    assert (report.status, report.state) == ("OK", "SLEEPING")


def test_a_rank_killed_with_a_batch_fails_each_request_once(engine_factory) -> None:
    engine = engine_factory(_spec())
    pid, futures = _held(engine)
    os.kill(pid, signal.SIGKILL)
    for future in futures:
        with pytest.raises(RequestFailedError, match="rank 1: process died"):
            future.result(timeout=LONG_TIMEOUT_S)
    assert engine.status()["b"]["state"] == "FAILED"
