"""Every route, fuzzed from the OpenAPI document (Schemathesis), in process, on synthetic
stages: never a 500, every error a 4xx (or the engine's 503/504) with a JSON body naming what
went wrong. Fixed seed, bounded examples; the long campaign is scripts/fuzz_http.py."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from omni_core.engine import Engine
from omni_core.serve import create_app
from tests.serve.conftest import make_config, stage_table

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
http_fuzz = pytest.importorskip("tests.serve.http_fuzz")

SEED = 20261126
EXAMPLES_PER_ROUTE = 30  # of each kind: schema cases, hostile cases


@pytest.fixture(scope="module")
def fuzzed_app() -> Iterator[Any]:
    # ASGI in process: the transport names the host "testserver", which this config allows.
    config = make_config(
        stage_table("talker", deadline_s=10.0, request_timeout_s=10.0),
        stage_table("decoder", deadline_s=10.0, request_timeout_s=10.0),
        allowed_hosts=["testserver"],
    )
    engine = Engine(config.stages)
    try:
        yield create_app(engine, config), config
    finally:
        engine.shutdown()


def test_every_route_answers_fuzzed_requests_without_a_500(fuzzed_app: tuple[Any, Any]) -> None:
    app, config = fuzzed_app
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)

    def call(case: Any) -> tuple[int | None, bytes]:
        response = case.call()
        return response.status_code, response.content

    tally = http_fuzz.fuzz(
        schema,
        call,
        stage_names=config.stage_names,
        seed=SEED,
        examples_per_route=EXAMPLES_PER_ROUTE,
        tally=http_fuzz.Tally(),
    )
    assert tally.problems == []
    assert tally.requests >= 20 * EXAMPLES_PER_ROUTE  # every route was reached, not skipped
    assert {200, 404, 422} <= set(tally.by_status)  # valid, unknown-stage and refused cases all ran


def test_the_checks_catch_bad_answers() -> None:
    problem = http_fuzz.problem_with
    assert problem(200, b"anything") == ""
    assert problem(500, b'{"error": {"code": 500, "type": "X", "message": "m"}}') == "HTTP 500"
    assert "without a JSON error body" in problem(400, b"Internal Server Error")
    assert "malformed" in problem(409, b'{"error": {"code": 400, "type": "X", "message": "m"}}')
    assert "does not name" in problem(422, b'{"error": {"code": 422, "type": "X", "message": "bad"}}')
    assert (
        problem(422, b'{"error": {"code": 422, "type": "X", "message": "body.level: no", "fields": ["body.level"]}}')
        == ""
    )
    assert problem(503, b'{"error": {"code": 503, "type": "StageFailedError", "message": "restart it"}}') == ""
