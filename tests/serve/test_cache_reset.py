"""vLLM's POST /reset_prefix_cache and SGLang's POST /flush_cache as the protocol's
ResetPrefixCache: every rank's runner drops its cache, no memory is released or remapped and
requests keep running; a state whose row refuses it is refused before anything is sent.

The anchors' request shapes, as read from their sources: vLLM's
`dev/cache/api_router.py` takes `reset_running_requests` and `reset_external` as query
booleans and reads no body (one of its RL clients posts `{"model": ...}`), answering
`{"success": bool}`; SGLang's `http_server.py` takes `timeout` (seconds, >= 0) in the query
and answers 200 with text starting "Cache flushed." or 400 when the flush is not done."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest

from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, resume
from tests.serve.conftest import PROBE, Served, wait_for

RESETS = ("/reset_prefix_cache", "/flush_cache")


pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def _last_event_id(served: Served) -> int:
    return max((e["id"] for e in served.client.get("/v1/status").json()["events"]), default=0)


def _events_since(served: Served, last_id: int) -> list[dict[str, Any]]:
    return [e for e in served.client.get("/v1/status").json()["events"] if e["id"] > last_id]


def _check_reset(served: Served, body: dict[str, Any], last_id: int) -> None:
    """Every rank of the default stage answered the reset with its pool bytes unchanged; the
    stage stayed RUNNING; the status feed shows one reset and nothing else."""
    assert body["success"] is True, body
    assert body["released"] == {}, body  # nothing is
    reset = body["stages"]["talker"]
    assert (reset["command"], reset["status"], reset["state"]) == ("ResetPrefixCache", "OK", "RUNNING"), body
    assert set(reset["ranks"]) == {"0", "1"}
    for rank in ("0", "1"):
        before, after = reset["ranks"][rank]["pool_bytes_before"], reset["ranks"][rank]["pool_bytes_after"]
        assert before == after and before["kv_cache"] > 0 and before["weights"] > 0, reset["ranks"][rank]
    assert served.stage("talker")["state"] == "RUNNING"
    assert served.stage("decoder")["state"] == "RUNNING"  # only the default stage is reset
    events = [(e["stage"], e["command"], e.get("level"), e["outcome"]) for e in _events_since(served, last_id)]
    assert events == [("talker", "reset_prefix_cache", None, "ok")], events


@pytest.mark.parametrize(
    ("query", "body"),
    [
        ("", None),
        ("?reset_running_requests=true&reset_external=true", None),
        ("?reset_running_requests=false", {"model": "talker"}),  # vLLM reads no body
    ],
)
def test_vllm_reset_prefix_cache_drops_the_cache_and_moves_no_memory(
    served: Served, query: str, body: dict[str, Any] | None
) -> None:
    reference = served.engine.execute("talker", PROBE)
    last_id = _last_event_id(served)
    answer = served.client.post("/reset_prefix_cache" + query, json=body)
    assert answer.status_code == 200, answer.text
    _check_reset(served, answer.json(), last_id)
    assert served.engine.execute("talker", PROBE) == reference  # serves as before, weights intact


@pytest.mark.parametrize("query", ["", "?timeout=30", "?timeout=0.5e2"])
def test_sglang_flush_cache_drops_the_cache_and_moves_no_memory(served: Served, query: str) -> None:
    last_id = _last_event_id(served)
    answer = served.client.post("/flush_cache" + query)
    assert answer.status_code == 200, answer.text
    assert answer.json()["message"].startswith("Cache flushed.\n"), answer.text
    _check_reset(served, answer.json(), last_id)


@pytest.mark.parametrize("route", RESETS)
def test_a_reset_keeps_admission_open_and_lets_requests_run(served: Served, route: str) -> None:
    """With rank 1 stopped mid-request, the reset neither drains nor aborts: the stage stays
    RUNNING, the rank takes the reset after its request, which completes with the right
    output; then the reset answers."""
    reference = served.engine.execute("talker", PROBE)
    busy = served.stage("talker")["ranks"]["1"]["pid"]
    os.kill(busy, signal.SIGSTOP)
    try:
        request = served.engine.submit("talker", PROBE, timeout_s=LONG_TIMEOUT_S)
        wait_for(lambda: served.stage("talker")["in_flight"] == 1, what="request in flight")
        resetting = in_thread(lambda: served.client.post(route))
        wait_for(lambda: served.stage("talker")["task_id"] is not None, what="the reset to go out")
        assert served.stage("talker")["state"] == "RUNNING"
        assert not request.done() and not resetting.done()
    finally:
        resume(busy)
    assert request.result(timeout=LONG_TIMEOUT_S) == reference
    answer = resetting.result(timeout=LONG_TIMEOUT_S)
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    assert served.stage("talker")["state"] == "RUNNING"


@pytest.mark.parametrize(("route", "status"), [("/reset_prefix_cache", 409), ("/flush_cache", 400)])
def test_a_reset_outside_running_is_refused_naming_the_state(served: Served, route: str, status: int) -> None:
    """A sleeping stage: nothing is sent (no event, still SLEEPING); the answer names the
    state and the call that makes the stage RUNNING again (SGLang's: success false)."""
    served.engine.sleep("talker", 1)
    last_id = _last_event_id(served)
    answer = served.client.post(route)
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert body["error"]["state"] == "SLEEPING" and body["error"]["stage"] == "talker", body
    message = body["error"]["message"]
    assert "'talker' is SLEEPING, not RUNNING" in message and "POST /wake_up" in message, message
    assert "RUNNING, PAUSED or PARTIAL" in message, message
    if route == "/flush_cache":
        assert body["success"] is False and body["message"] == message
    assert served.stage("talker")["state"] == "SLEEPING"
    assert _events_since(served, last_id) == []


@pytest.mark.parametrize(
    ("route", "field"),
    [
        ("/reset_prefix_cache?reset_runing_requests=true", "reset_runing_requests"),
        ("/reset_prefix_cache?reset_external=maybe", "reset_external"),
        ("/flush_cache?timeout=-1", "timeout"),
        ("/flush_cache?timeout=soon", "timeout"),
    ],
)
def test_reset_parameters_are_strict(served: Served, route: str, field: str) -> None:
    answer = served.client.post(route)
    assert answer.status_code == 422, answer.text
    assert any(field in f for f in answer.json()["error"]["fields"]), answer.text
    assert served.stage("talker")["state"] == "RUNNING"


@pytest.mark.parametrize("route", RESETS)
def test_a_retried_reset_with_its_key_is_replayed_not_run_again(served: Served, route: str) -> None:
    headers = {"Idempotency-Key": f"reset-{route.strip('/')}-1"}
    first = served.client.post(route, headers=headers)
    assert first.status_code == 200, first.text
    assert first.json()["stages"]["talker"]["task_id"].endswith("/reset_prefix_cache"), first.text
    last_id = _last_event_id(served)
    again = served.client.post(route, headers=headers)
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true", again.text
    assert again.json() == first.json()
    assert _events_since(served, last_id) == []  # nothing ran twice
