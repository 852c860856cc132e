"""vLLM's /pause, /resume and /is_paused, and omni-core's /v1/stages/{name}/pause and /resume,
sent the shapes vLLM's clients send (vllm/entrypoints/serve/dev/rlhf/api_router.py: `mode`
abort|wait|keep, abort by default; the deprecated `wait_for_inflight_requests`; `clear_cache`;
all in the query string) and answered in vLLM's shapes: {"status": "paused"}, {"status":
"resumed"}, {"is_paused": bool}. A paused stage keeps its memory and starts no request."""

from __future__ import annotations

import msgspec
import pytest
import torch

from omni_core.engine.errors import RequestFailedError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.serve.metrics import vllm_sleep_state
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, request_held_by_a_stopped_rank
from tests.serve.conftest import PROBE, SMALL_RUNNER, Served, make_config, serving, stage_table, wait_for

pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def _is(served: Served, route: str) -> bool:
    answer = served.client.get(route)
    assert answer.status_code == 200, answer.text
    return answer.json()[route.removeprefix("/")]


def test_vllm_pause_holds_requests_keeps_memory_and_resume_serves_them(served: Served) -> None:
    before = served.stage("talker")
    paused = served.client.post("/pause")  # vLLM's client: no parameters, mode abort
    assert paused.status_code == 200, paused.text
    body = paused.json()
    assert body["status"] == "paused" and list(body["stages"]) == ["talker"]  # the default stage
    report = body["stages"]["talker"]
    assert (report["command"], report["status"], report["state"], report["ranks"]) == ("Pause", "OK", "PAUSED", {})
    assert _is(served, "/is_paused") and not _is(served, "/is_sleeping")  # nothing was released
    assert vllm_sleep_state("PAUSED", True) == "awake"  # vllm:engine_sleep_state, as vLLM's pause leaves it
    talker = served.stage("talker")
    assert talker["asleep_tags"] == [] and talker["weights_valid"] and talker["epoch"] == before["epoch"]
    held = served.engine.submit("talker", PROBE, timeout_s=LONG_TIMEOUT_S)
    wait_for(lambda: served.stage("talker")["queued"] == 1, what="the request to be held")
    assert not held.done() and served.stage("talker")["in_flight"] == 0  # no request starts
    assert served.client.post("/pause?mode=keep").json()["stages"]["talker"]["status"] == "ALREADY"
    woken = served.client.post("/wake_up").json()  # every tag is resident: awake, and still paused
    assert woken["status"] == "awake" and woken["stages"]["talker"]["state"] == "PAUSED", woken
    resumed = served.client.post("/resume")
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["status"] == "resumed" and resumed.json()["stages"]["talker"]["state"] == "RUNNING"
    assert held.result(timeout=LONG_TIMEOUT_S) == served.engine.execute("talker", PROBE)
    assert not _is(served, "/is_paused")
    again = served.client.post("/resume")
    assert again.status_code == 200 and again.json()["stages"]["talker"]["status"] == "ALREADY", again.text


@pytest.mark.parametrize(
    ("params", "body", "abort"),
    [
        ({}, None, True),  # vLLM's default
        ({"mode": "wait"}, None, False),
        ({"mode": "keep"}, None, False),
        ({"wait_for_inflight_requests": "true"}, None, False),  # deprecated, wins over mode
        ({"mode": "abort", "wait_for_inflight_requests": "true", "clear_cache": "false"}, None, False),
        ({}, {"mode": "keep", "clear_cache": True}, False),  # omni-core also takes a JSON body
    ],
)
def test_vllm_pause_modes_with_a_request_in_flight(
    served: Served, params: dict[str, str], body: dict | None, abort: bool
) -> None:
    """abort answers the running request at once (409 aborted) and pauses once the rank
    answered it; wait and keep let it finish (omni-core cannot freeze an Execute halfway)."""
    reference = served.engine.execute("talker", PROBE)
    with request_held_by_a_stopped_rank(served.engine, "talker") as running:
        pausing = in_thread(lambda: served.client.post("/pause", params=params, json=body))
        wait_for(lambda: served.stage("talker")["state"] == "DRAINING", what="the pause to close admission")
        assert not pausing.done()  # rank 1 still runs the request: not paused yet
        if abort:
            wait_for(running.done, what="the abort to answer the request")
        else:
            assert not running.done()
    answer = pausing.result(timeout=60)
    assert answer.status_code == 200 and answer.json()["stages"]["talker"]["state"] == "PAUSED", answer.text
    if abort:
        with pytest.raises(RequestFailedError, match="aborted: stage 'talker' is pausing"):
            running.result()
    else:
        assert running.result(timeout=10) == reference


@pytest.mark.parametrize(
    ("params", "body", "field"),
    [
        ({"mode": "freeze"}, None, "mode"),  # vLLM's PauseMode is a Literal: 422
        ({"mode": "wait"}, {"mode": "wait"}, "mode"),  # both places: ambiguous
        ({"mdoe": "wait"}, None, "mdoe"),  # a misspelt parameter is loud
        ({"clear_cache": "maybe"}, None, "clear_cache"),
        ({}, {"mode": "wait", "level": 1}, "level"),
    ],
)
def test_vllm_pause_refuses_bad_parameters(served: Served, params: dict, body: dict | None, field: str) -> None:
    answer = served.client.post("/pause", params=params, json=body)
    assert answer.status_code == 422, answer.text
    assert any(field in f for f in answer.json()["error"]["fields"]), answer.text
    assert served.stage("talker")["state"] == "RUNNING"


def test_pause_and_resume_of_a_sleeping_stage_are_409_naming_the_wake(served: Served) -> None:
    served.engine.sleep("talker", 1)
    assert _is(served, "/is_paused")  # vLLM's scheduler is paused by a sleep too
    paused = served.client.post("/pause?mode=wait")
    assert paused.status_code == 409 and "only a RUNNING stage pauses" in paused.text, paused.text
    resumed = served.client.post("/resume")
    assert resumed.status_code == 409 and "a sleeping stage serves again after wake()" in resumed.text
    assert served.stage("talker")["state"] == "SLEEPING"


def test_a_paused_stage_sleeps_and_stays_paused_after_its_wake_until_resume(served: Served) -> None:
    assert served.client.post("/pause").status_code == 200
    slept = served.client.post("/sleep?mode=keep")
    assert slept.status_code == 200 and slept.json()["stages"]["talker"]["state"] == "SLEEPING", slept.text
    assert served.client.post("/wake_up").json()["status"] == "awake"
    assert served.stage("talker")["state"] == "PAUSED" and _is(served, "/is_paused")
    assert served.client.post("/resume").status_code == 200
    assert served.stage("talker")["state"] == "RUNNING" and not _is(served, "/is_paused")


def test_omni_core_pause_and_resume_routes_with_an_idempotency_key(served: Served) -> None:
    key = {"Idempotency-Key": "pause-decoder-1"}
    first = served.client.post("/v1/stages/decoder/pause", json={"mode": "wait"}, headers=key)
    assert first.status_code == 200 and first.json()["state"] == "PAUSED", first.text
    replay = served.client.post("/v1/stages/decoder/pause", json={"mode": "wait"}, headers=key)
    assert replay.json() == first.json() and replay.headers.get("Idempotent-Replayed") == "true"
    assert served.stage("talker")["state"] == "RUNNING"  # only the stage named
    assert served.client.post("/v1/stages/decoder/pause", json={"mode": "hold"}).status_code == 422
    refused = served.client.post("/v1/stages/decoder/resume", json={"timeout_s": -1})
    assert refused.status_code == 400 and "timeout_s must be a positive number" in refused.text, refused.text
    assert served.stage("decoder")["state"] == "PAUSED"
    resumed = served.client.post("/v1/stages/decoder/resume", json={"timeout_s": 5})
    assert resumed.status_code == 200 and resumed.json()["command"] == "Resume", resumed.text
    assert served.client.post("/v1/stages/decoder/resume").json()["status"] == "ALREADY"  # no body: deadline_s
    assert served.stage("decoder")["state"] == "RUNNING"


def test_vllms_rl_loop_pause_update_resume_serves_the_new_weights() -> None:
    """Pause, update the weights (here from a WeightSender's shared memory), resume: the update
    of a PAUSED stage leaves it PAUSED at the new version, the request held meanwhile runs
    after the resume on the new weights, never on the old ones."""
    config = make_config(stage_table("solo"), default_stage="solo")
    with serving(config) as served:
        before = served.engine.execute("solo", PROBE)["sha256"]
        assert served.client.post("/pause").status_code == 200
        held = served.engine.submit("solo", PROBE, timeout_s=LONG_TIMEOUT_S)
        runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len("solo")))
        gen = torch.Generator().manual_seed(7)
        weights = {n: torch.randn(shape, generator=gen, dtype=dt) for n, (shape, dt) in runner.weight_specs().items()}
        with WeightSender(bucket_bytes=1 << 20) as sender:
            body = {"version": 1, "source": msgspec.to_builtins(sender.share(weights))}
            answer = served.client.post("/v1/stages/solo/update_weights", json=body)
        assert answer.status_code == 200, answer.text
        assert (answer.json()["state"], answer.json()["weights_version"]) == ("PAUSED", 1)
        assert not held.done() and _is(served, "/is_paused")
        assert served.client.post("/resume").status_code == 200
        after = held.result(timeout=LONG_TIMEOUT_S)["sha256"]
        assert after != before and after == served.engine.execute("solo", PROBE)["sha256"]
