"""vLLM's and vLLM-Omni's request shapes, unchanged, against the same engine."""

from __future__ import annotations

import os
import signal

import pytest

from tests.serve.conftest import Served, wait_for

pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def test_vllm_sleep_wake_on_the_default_stage(served: Served) -> None:
    assert served.client.get("/is_sleeping").json() == {"is_sleeping": False}
    slept = served.client.post("/sleep?level=1")
    assert slept.status_code == 200, slept.text
    body = slept.json()
    assert body["status"] == "sleeping" and body["level"] == 1 and list(body["stages"]) == ["talker"]
    assert served.client.get("/is_sleeping").json() == {"is_sleeping": True}
    assert served.stage("decoder")["state"] == "RUNNING"  # only the default stage
    part = served.client.post("/wake_up?tags=weights").json()
    assert part["status"] == "sleeping" and part["tags_woken"] == ["weights"]  # kv_cache still asleep
    assert served.stage("talker")["state"] == "PARTIAL"
    rest = served.client.post("/wake_up", params={"tags": "kv_cache"}).json()
    assert rest["status"] == "awake" and served.client.get("/is_sleeping").json() == {"is_sleeping": False}


def test_vllm_level2_then_collective_rpc_reload(served: Served) -> None:
    assert served.client.post("/sleep", params={"level": 2, "mode": "abort"}).json()["level"] == 2
    assert served.client.post("/wake_up").json()["status"] == "sleeping"  # the weights are not back yet
    assert served.stage("talker")["state"] == "NEEDS_RELOAD"
    reloaded = served.client.post("/collective_rpc", json={"method": "reload_weights"})
    assert reloaded.status_code == 200, reloaded.text
    assert [r["state"] for r in reloaded.json()["results"]] == ["RUNNING"]


@pytest.mark.parametrize(
    ("query", "status", "needle"),
    [
        ("level=3", 400, "sleep level must be 1 or 2, got 3"),
        ("level=one", 422, "level"),
        ("mode=freeze", 400, "mode 'freeze' is not one of 'abort'"),
        ("level=1&levle=2", 422, "unknown query parameter(s) ['levle']"),  # a misspelt or dropped parameter is loud
    ],
)
def test_vllm_bad_sleep_parameters_are_refused(served: Served, query: str, status: int, needle: str) -> None:
    answer = served.client.post(f"/sleep?{query}")
    assert answer.status_code == status and needle in answer.json()["error"]["message"], answer.text
    assert served.stage("talker")["state"] == "RUNNING"


def test_vllm_omni_stage_ids(served: Served) -> None:
    slept = served.client.post("/v1/omni/sleep", json={"stage_ids": [0, 1], "level": 2})
    assert slept.status_code == 200 and set(slept.json()["stages"]) == {"talker", "decoder"}
    assert {s["state"] for s in served.client.get("/v1/stages").json()["stages"]} == {"SLEEPING"}
    woken = served.client.post("/v1/omni/wakeup", json={"stage_ids": ["decoder"]})
    assert woken.status_code == 200 and list(woken.json()["stages"]) == ["decoder"]
    assert served.stage("decoder")["state"] == "NEEDS_RELOAD" and served.stage("talker")["state"] == "SLEEPING"
    out_of_range = served.client.post("/v1/omni/wakeup", json={"stage_ids": [7]})
    assert out_of_range.status_code == 404 and "stage ids are 0..1" in out_of_range.text
    dropped_level = served.client.post("/v1/omni/sleep", json={"stage_ids": [0], "lvl": 2})
    assert dropped_level.status_code == 422 and "lvl" in dropped_level.text


def test_vllm_omni_partial_failure_names_every_stage(served: Served) -> None:
    """One stage has failed (its rank was killed), the other sleeps: the answer is the
    failure's code, and carries both stages' outcomes."""
    os.kill(served.stage("decoder")["ranks"]["0"]["pid"], signal.SIGKILL)
    wait_for(lambda: served.stage("decoder")["state"] == "FAILED", what="decoder FAILED after its rank died")
    answer = served.client.post("/v1/omni/sleep", json={"stage_ids": [0, 1], "level": 1})
    assert answer.status_code == 503, answer.text
    stages = answer.json()["stages"]
    assert stages["talker"]["state"] == "SLEEPING" and stages["decoder"]["error"]["code"] == 503
    assert answer.json()["error"]["stage"] == "decoder" and "FAILED" in answer.json()["error"]["message"]
