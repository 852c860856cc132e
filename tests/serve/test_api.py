"""omni-core's own routes on a real engine: each error code provoked by its real cause, the
engine's message passed through unchanged, and Idempotency-Key proven to have no second effect."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from omni_core.serve import create_app, serve_in_thread
from tests.serve.conftest import PROBE, SMALL_RUNNER, Served, make_config, metric_value, stage_table, wait_for

pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def test_stages_list_and_one_stage(served: Served) -> None:
    stages = served.client.get("/v1/stages").json()["stages"]
    assert [(s["stage_id"], s["name"], s["state"]) for s in stages] == [
        (0, "talker", "RUNNING"),
        (1, "decoder", "RUNNING"),
    ]
    talker = served.stage("talker")
    assert set(talker["ranks"]) == {"0", "1"} and all(r["alive"] for r in talker["ranks"].values())
    assert talker["tags"] == ["weights", "kv_cache"]
    missing = served.client.get("/v1/stages/nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "unknown stage 'nope'; stages are ['decoder', 'talker']"


def test_sleep_wake_execute_round_trip(served: Served) -> None:
    before = served.client.post("/v1/stages/talker/execute", json={"payload": PROBE})
    assert before.status_code == 200, before.text
    slept = served.client.post("/v1/stages/talker/sleep", json={"level": 1})
    assert slept.status_code == 200, slept.text
    report = slept.json()
    assert report["state"] == "SLEEPING" and report["command"] == "Sleep" and report["status"] == "OK"
    assert all(r["freed_bytes"] > 0 for r in report["ranks"].values())
    assert served.stage("talker")["state"] == "SLEEPING"
    again = served.client.post("/v1/stages/talker/sleep", json={"level": 1}).json()
    assert again["status"] == "ALREADY"  # P-4: a second sleep is a no-op ACK, not an error
    woken = served.client.post("/v1/stages/talker/wake").json()
    assert woken["state"] == "RUNNING" and all(
        r["freed_bytes"] == 0 < r["restored_bytes"] for r in woken["ranks"].values()
    )
    after = served.client.post("/v1/stages/talker/execute", json={"payload": PROBE})
    assert after.json() == before.json()  # bit-identical output (base64 of the raw bytes) after the wake


def test_level2_needs_reload_then_serves(served: Served) -> None:
    reference = served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE}).json()
    assert served.client.post("/v1/stages/decoder/sleep", json={"level": 2}).status_code == 200
    assert served.client.post("/v1/stages/decoder/wake").json()["state"] == "NEEDS_RELOAD"
    refused = served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE})
    assert refused.status_code == 409
    assert refused.json()["error"]["type"] == "RequestRejectedError" and "NEEDS_RELOAD" in refused.text
    reloaded = served.client.post("/v1/stages/decoder/reload")
    assert reloaded.status_code == 200 and reloaded.json()["state"] == "RUNNING"
    assert served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE}).json() == reference


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"level": 3}, 400, "sleep level must be 1 or 2, got 3"),
        ({"tags": ["nope"]}, 400, "unknown tag(s) ['nope']"),
        ({"timeout_s": -1}, 400, "timeout_s must be a positive number"),
        ({"level": 1, "surprise": True}, 422, "surprise"),  # unknown fields are refused, never dropped
        ({"level": "one"}, 422, "level"),
        ({"level": "1"}, 422, "level"),  # strict: never converted
        ({"level": True}, 422, "level"),
    ],
)
def test_bad_arguments_are_refused_with_the_engine_text(served: Served, body: dict, status: int, needle: str) -> None:
    answer = served.client.post("/v1/stages/talker/sleep", json=body)
    assert answer.status_code == status, answer.text
    assert needle in answer.json()["error"]["message"]
    assert served.stage("talker")["state"] == "RUNNING"


def test_state_conflict_is_409(served: Served) -> None:
    answer = served.client.post("/v1/stages/talker/reload")
    assert answer.status_code == 409
    error = answer.json()["error"]
    assert error["type"] == "InvalidArgumentError" and error["stage"] == "talker"
    assert error["message"].startswith("stage 'talker' cannot reload weights in RUNNING")


def test_admission_reject_is_409_and_runner_error_is_400(served: Served) -> None:
    assert served.client.post("/v1/stages/decoder/admission", json={"policy": "reject"}).status_code == 200
    served.client.post("/v1/stages/decoder/sleep", json={"level": 1})
    rejected = served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE})
    assert rejected.status_code == 409 and "admission policy is 'reject'" in rejected.text
    bad_policy = served.client.post("/v1/stages/decoder/admission", json={"policy": "maybe"})
    assert bad_policy.status_code == 400 and "is not one of" in bad_policy.text
    served.client.post("/v1/stages/decoder/wake")
    runner_error = served.client.post("/v1/stages/decoder/execute", json={"payload": {"seed": 1, "batch": 0}})
    assert runner_error.status_code == 400, runner_error.text
    assert "EXECUTE_ERROR" in runner_error.json()["error"]["message"]


def test_queue_full_is_429_and_queued_requests_are_served(served: Served) -> None:
    """talker has queue_limit 2: two requests wait for the wake, a third is refused at once."""
    served.client.post("/v1/stages/talker/sleep", json={"level": 1})
    with ThreadPoolExecutor(2) as pool:
        queued = [
            pool.submit(served.client.post, "/v1/stages/talker/execute", json={"payload": PROBE}) for _ in range(2)
        ]
        wait_for(lambda: served.stage("talker")["queued"] == 2, what="two queued requests")
        refused = served.client.post("/v1/stages/talker/execute", json={"payload": PROBE})
        assert refused.status_code == 429, refused.text
        assert refused.headers["Retry-After"] == "1" and "queue is full" in refused.text
        assert not any(f.done() for f in queued)  # still waiting: the sleep holds them
        served.client.post("/v1/stages/talker/wake")
        assert [f.result(timeout=60).status_code for f in queued] == [200, 200]


def test_request_deadline_in_queue_is_504(served: Served) -> None:
    served.client.post("/v1/stages/talker/sleep", json={"level": 1})
    answer = served.client.post("/v1/stages/talker/execute", json={"payload": PROBE, "timeout_s": 0.3})
    assert answer.status_code == 504, answer.text
    assert "until its deadline" in answer.json()["error"]["message"]
    metrics = served.client.get("/metrics").text
    assert metric_value(metrics, "omni_core_deadlines_fired_total", stage="talker", kind="request") >= 1


def test_failed_stage_is_503_until_restarted(served: Served) -> None:
    before = served.stage("decoder")
    os.kill(before["ranks"]["0"]["pid"], signal.SIGKILL)
    wait_for(lambda: served.stage("decoder")["state"] == "FAILED", what="decoder FAILED after its rank died")
    answer = served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE})
    assert answer.status_code == 503 and "restart" in answer.json()["error"]["message"]
    sleep = served.client.post("/v1/stages/decoder/sleep")
    assert sleep.status_code == 503 and "FAILED" in sleep.text
    restarted = served.client.post("/v1/stages/decoder/restart")
    assert restarted.status_code == 200, restarted.text
    answer = restarted.json()
    assert (answer["stage"], answer["state"], answer["epoch"]) == ("decoder", "RUNNING", before["epoch"] + 1)
    assert (answer["weights_version"], answer["version_floor"], answer["version_reset_from"]) == (
        before["weights_version"],
        0,
        None,
    )
    assert served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE}).status_code == 200
    assert metric_value(served.client.get("/metrics").text, "omni_core_stage_restarts_total", stage="decoder") >= 1


def test_a_restart_answers_the_version_it_came_back_at_or_its_floor(served: Served) -> None:
    from omni_core.runners.synthetic import SyntheticRunner
    from omni_core.weights_sender import WeightSender

    version = served.stage("talker")["weights_version"] + 1
    specs = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=6)).weight_specs()
    with WeightSender(bucket_bytes=1 << 20) as sender:
        weights = {name: torch.full(shape, 0.01, dtype=dtype) for name, (shape, dtype) in specs.items()}
        served.engine.update_weights("talker", sender.share(weights), version=version)
    lost = served.client.post("/v1/stages/talker/restart").json()
    assert (lost["state"], lost["weights_version"], lost["version_floor"]) == ("NEEDS_RELOAD", 0, version)
    assert lost["weights_source"] == "memory" and "lived in memory only" in lost["detail"]
    refused = served.client.post("/v1/stages/talker/execute", json={"payload": PROBE})
    assert refused.status_code == 409 and f"update its weights to version {version}" in refused.text, refused.text
    reset = served.client.post("/v1/stages/talker/restart", json={"from_checkpoint": True}).json()
    assert (reset["state"], reset["weights_version"], reset["version_reset_from"]) == ("RUNNING", 0, version)
    status = served.stage("talker")
    assert (status["weights_version"], status["version_reset_from"], status["version_floor"]) == (0, version, 0)
    assert served.client.post("/v1/stages/talker/restart", json={"from_checkpoint": "yes"}).status_code == 422


def test_idempotent_sleep_has_no_second_effect(served: Served) -> None:
    key = {"Idempotency-Key": "sleep-once-1"}
    first = served.client.post("/v1/stages/talker/sleep", json={"level": 1}, headers=key)
    assert first.status_code == 200 and first.json()["task_id"] == "idem-sleep-once-1"
    served.client.post("/v1/stages/talker/wake")
    retry = served.client.post("/v1/stages/talker/sleep", json={"level": 1}, headers=key)
    assert retry.content == first.content and retry.headers["Idempotent-Replayed"] == "true"
    assert served.stage("talker")["state"] == "RUNNING"  # the retry did not sleep it again
    other = served.client.post("/v1/stages/talker/sleep", json={"level": 2}, headers=key)
    assert other.status_code == 409 and other.json()["error"]["type"] == "IdempotencyKeyReused"


def test_concurrent_duplicates_share_one_call(served: Served) -> None:
    key = {"Idempotency-Key": "sleep-twice-at-once"}
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda _: served.client.post("/v1/stages/decoder/sleep", headers=key), range(2)))
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].content == answers[1].content
    assert sorted(a.headers.get("Idempotent-Replayed", "false") for a in answers) == ["false", "true"]


def test_idempotent_execute_runs_once(served: Served) -> None:
    def served_count() -> float:
        return metric_value(served.client.get("/metrics").text, "omni_core_requests_total", stage="decoder")

    before = served_count()
    key = {"Idempotency-Key": "exec-once"}
    first = served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE}, headers=key)
    retry = served.client.post("/v1/stages/decoder/execute", json={"payload": PROBE}, headers=key)
    assert first.status_code == retry.status_code == 200 and first.content == retry.content
    assert served_count() == before + 1


def test_engine_task_id_answers_a_retry_after_the_server_forgot_the_key(served: Served) -> None:
    """With a one-entry cache the server forgets the first key; the engine's own record
    (task id idem-<key>) still answers the retry without sleeping the stage again."""
    config = make_config(*[stage_table(s.name) for s in served.config.stages], idempotency_entries=1)
    app = create_app(served.engine, config)
    with serve_in_thread(app) as running, httpx.Client(base_url=running.url, timeout=60) as client:
        first = client.post("/v1/stages/decoder/sleep", headers={"Idempotency-Key": "forgotten"})
        client.post("/v1/stages/decoder/wake", headers={"Idempotency-Key": "evicts-it"})
        assert len(app.state.serve.idempotency) == 1
        retry = client.post("/v1/stages/decoder/sleep", headers={"Idempotency-Key": "forgotten"})
        assert retry.status_code == 200 and "Idempotent-Replayed" not in retry.headers
        assert retry.json()["task_id"] == first.json()["task_id"] == "idem-forgotten"
        assert client.get("/v1/stages/decoder").json()["state"] == "RUNNING"


def test_bad_idempotency_key_is_400(served: Served) -> None:
    answer = served.client.post("/v1/stages/talker/sleep", headers={"Idempotency-Key": "has space"})
    assert answer.status_code == 400 and "Idempotency-Key" in answer.text
    assert served.stage("talker")["state"] == "RUNNING"


def test_unknown_route_and_method(served: Served) -> None:
    assert served.client.get("/v2/nothing").status_code == 404
    assert served.client.get("/v1/stages/talker/sleep").status_code == 405
