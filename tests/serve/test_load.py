"""The load and fault test, reduced for CI (10 clients, 10 sleep/wake cycles); the full run
(50 clients, 100 cycles) is the benchmark in benchmarks/results/serve.md."""

from __future__ import annotations

import asyncio

import pytest

from benchmarks.serve_load import DOCUMENTED, run_load
from tests.serve.conftest import Served

CI_CLIENTS = 10
CI_CYCLES = 10


pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def test_every_request_answered_exactly_once_under_sleep_wake_cycles(served: Served) -> None:
    result = asyncio.run(run_load(served.url, stage="decoder", hold="talker", clients=CI_CLIENTS, cycles=CI_CYCLES))
    assert result.problems() == []
    assert result.requests >= 2 * CI_CLIENTS and result.retries >= 1
    assert set(map(int, result.statuses)) <= DOCUMENTED
    assert result.sleep_ms["n"] == result.wake_ms["n"] == CI_CYCLES


def test_the_checks_can_fail() -> None:
    """A result that lost a request, ran one twice or dropped a disconnect is reported."""
    from benchmarks.serve_load import LoadResult

    clean = LoadResult(
        1,
        1,
        requests=5,
        retries=1,
        answered_attempts=6,
        statuses={"200": 5},
        server_runs=5,
        server_replays=1,
        server_execute_answers=7,
        disconnect_counted=True,
        disconnected_call_ran_once=True,
        stage_idle_after=True,
    )
    assert clean.problems() == []
    for change, needle in (
        ({"server_runs": 6}, "ran 6 requests for 5"),
        ({"server_runs": 4}, "ran 4 requests"),
        ({"statuses": {"200": 4, "500": 1}}, "undocumented statuses"),
        ({"wrong_outputs": 1}, "another request's output"),
        ({"server_replays": 0}, "replayed 0 answers for 1 retries"),
        ({"server_replays": 2}, "replayed 2 answers for 1 retries"),
        ({"server_execute_answers": 6}, "6 HTTP answers on execute for 7 answered calls"),
        ({"transport_errors": ["k: ReadError"]}, "1 requests got no HTTP answer"),
        ({"disconnected_call_ran_once": False}, "did not run exactly once"),
        ({"stage_idle_after": False}, "still queued or in flight"),
    ):
        broken = LoadResult(**{**clean.__dict__, **change})
        assert any(needle in p for p in broken.problems()), (change, broken.problems())
