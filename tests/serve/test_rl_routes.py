"""The routes the RL frameworks poll and call, sent as their clients send them: SGLang's
(`entrypoints/http_server.py`: /health_generate, GET /flush_cache, /get_model_info,
/get_server_info, /get_weight_version, /abort_request, /pause_generation,
/continue_generation, /destroy_weights_update_group, /start_profile, /stop_profile) and vLLM's
(`entrypoints/serve/dev/rlhf/api_router.py`: /get_world_size, /abort_requests, /weight_info,
/sleep?level=0, collective_rpc reload_weights on a serving stage)."""

from __future__ import annotations

import pytest

from omni_core.engine.errors import RequestFailedError
from omni_core.integrations import EXTENSION_METHODS
from omni_core.serve.vllm_routes import RPC_ROUTES
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, request_held_by_a_stopped_rank
from tests.serve.conftest import PROBE, Served, wait_for

pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def _refused(answer, status: int, needle: str) -> dict:
    assert answer.status_code == status, answer.text
    assert needle in answer.json()["error"]["message"], answer.text
    return answer.json()


def test_health_generate_is_200_only_when_a_request_can_run_now(served: Served) -> None:
    ok = served.client.get("/health_generate")
    assert ok.status_code == 200 and ok.json() == {"status": "ok", "stages": {"talker": "RUNNING"}}, ok.text
    served.engine.pause("talker")
    paused = _refused(served.client.get("/health_generate"), 503, "stage 'talker' is PAUSED, not RUNNING")
    assert "POST /resume" in paused["error"]["message"] and paused["stages"] == {"talker": "PAUSED"}
    served.engine.resume("talker")
    served.engine.sleep("talker", 1)
    _refused(served.client.get("/health_generate"), 503, "is SLEEPING, not RUNNING: no request can run on it now; wake")
    served.engine.wake("talker")
    assert served.client.get("/health_generate").status_code == 200


def test_sglang_get_flush_cache_is_the_flush_and_a_cross_site_get_is_refused(served: Served) -> None:
    flushed = served.client.get("/flush_cache")  # slime and verl poll it until 200
    assert flushed.status_code == 200 and flushed.json()["message"].startswith("Cache flushed."), flushed.text
    assert flushed.json()["stages"]["talker"]["command"] == "ResetPrefixCache"
    forged = served.client.get("/flush_cache", headers={"Sec-Fetch-Site": "cross-site"})
    _refused(forged, 403, "from a page of another site")
    served.engine.sleep("talker", 1)
    _refused(served.client.get("/flush_cache"), 400, "is SLEEPING, not RUNNING")


@pytest.mark.parametrize("path", ["/get_world_size", "/get_world_size/", "/get_world_size?include_dp=false"])
def test_world_size_counts_the_ranks_that_join_a_weight_group(served: Served, path: str) -> None:
    answer = served.client.get(path)  # TRL's VLLMClient asks with the slash, in its constructor
    assert answer.status_code == 200 and answer.json() == {"world_size": 2}, answer.text  # talker's 2 ranks


def test_model_and_server_info_have_sglangs_fields(served: Served) -> None:
    info = served.client.get("/get_model_info").json()
    assert info == {
        "model_path": "synthetic",
        "tokenizer_path": None,
        "is_generation": None,
        "preferred_sampling_params": None,
        "weight_version": "0",
    }
    server = served.client.get("/get_server_info").json()
    assert (server["tp_size"], server["dp_size"], server["weight_version"], server["default_stage"]) == (
        2,
        1,
        "0",
        "talker",
    )
    assert server["stages"]["talker"]["state"] == "RUNNING" and server["internal_states"][0]["stage"] == "talker"
    assert served.client.get("/get_weight_version").json()["weight_version"] == "0"
    assert served.client.get("/weight_info").json() == {
        "weight_version": "0",
        "weights_version": 0,
        "stages": {"talker": "0"},
    }


@pytest.mark.parametrize(("route", "body"), [("/abort_requests", {}), ("/abort_request", {"abort_all": True})])
def test_abort_answers_the_requests_in_flight_and_the_stage_serves_on(served: Served, route: str, body: dict) -> None:
    with request_held_by_a_stopped_rank(served.engine, "talker") as running:
        aborting = in_thread(lambda: served.client.post(route, json=body))
        wait_for(running.done, what="the abort to answer the request in flight")
        with pytest.raises(RequestFailedError, match="aborted"):
            running.result()
    answer = aborting.result(timeout=LONG_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "aborted" and answer.json()["aborted"] == 1 and answer.json()["success"]
    assert served.stage("talker")["state"] == "RUNNING"
    assert served.engine.execute("talker", PROBE)  # it serves on
    nothing = served.client.post(route, json=body)
    assert nothing.status_code == 200 and nothing.json()["aborted"] == 0, nothing.text


@pytest.mark.parametrize(
    ("route", "body", "needle"),
    [
        ("/abort_request", {"rid": "req-1"}, "rid req-1 not served: omni-core's requests carry no client request id"),
        ("/abort_request", {}, "nothing to abort: send abort_all true"),
        ("/abort_requests", {"request_ids": ["a"]}, "request_ids ['a'] not served"),
    ],
)
def test_aborts_by_request_id_are_refused_saying_why(served: Served, route: str, body: dict, needle: str) -> None:
    _refused(served.client.post(route, json=body), 400, needle)


def test_sglang_pause_and_continue_generation(served: Served) -> None:
    paused = served.client.post("/pause_generation", json={"mode": "retract"})
    assert paused.status_code == 200, paused.text
    assert paused.json()["message"] == "Generation paused successfully." and paused.json()["status"] == "ok"
    assert served.stage("talker")["state"] == "PAUSED"
    held = served.engine.submit("talker", PROBE, timeout_s=LONG_TIMEOUT_S)
    wait_for(lambda: served.stage("talker")["queued"] == 1, what="the request to be held")
    resumed = served.client.post("/continue_generation")
    assert resumed.status_code == 200 and resumed.json()["message"] == "Generation continued successfully."
    assert held.result(timeout=LONG_TIMEOUT_S) and served.stage("talker")["state"] == "RUNNING"
    bad = served.client.post("/pause_generation", json={"mode": "freeze"})
    assert bad.status_code == 422 and "mode" in bad.text
    served.engine.sleep("talker", 1)
    asleep = served.client.post("/pause_generation")
    assert asleep.status_code == 409 and asleep.json()["success"] is False, asleep.text


def test_vllm_sleep_level_0_pauses_scheduling_and_wake_up_resumes(served: Served) -> None:
    before = served.stage("talker")
    slept = served.client.post("/sleep?level=0&mode=wait")
    assert slept.status_code == 200, slept.text
    assert (slept.json()["status"], slept.json()["level"]) == ("paused", 0)
    after = served.stage("talker")
    assert after["state"] == "PAUSED" and after["asleep_tags"] == [] and after["epoch"] == before["epoch"]
    assert served.client.get("/is_paused").json() == {"is_paused": True}
    woken = served.client.post("/wake_up")
    assert woken.status_code == 200 and woken.json()["stages"]["talker"]["state"] == "RUNNING", woken.text
    # A pause from /pause is ended by /resume only, as before.
    served.client.post("/pause")
    assert served.client.post("/wake_up").json()["stages"]["talker"]["state"] == "PAUSED"
    _refused(served.client.post("/sleep?level=0&tags=weights"), 400, "a level-0 sleep pauses scheduling")


def test_sglang_profile_start_and_stop_and_the_fields_it_cannot_honour(served: Served) -> None:
    started = served.client.post("/start_profile")  # vLLM's: no body
    assert started.status_code == 200, started.text
    assert started.json()["message"] == "Start profiling." and started.json()["stages"]["talker"]["status"] == "OK"
    stopped = served.client.post("/stop_profile")
    assert stopped.status_code == 200, stopped.text
    traces = stopped.json()["stages"]["talker"]["traces"]
    assert sorted(traces) == ["0", "1"] and all(len(paths) == 1 for paths in traces.values()), traces
    refused = _refused(
        served.client.post("/start_profile", json={"output_dir": "/tmp/x", "num_steps": 5}),
        400,
        "['output_dir', 'num_steps'] not served: traces go to each stage's profile_dir",
    )
    assert refused["error"]["fields"] == ["output_dir", "num_steps"]


def test_destroy_weights_update_group_is_refused_saying_why(served: Served) -> None:
    answer = served.client.post("/destroy_weights_update_group", json={"group_name": "weight_update_group"})
    _refused(answer, 400, "omni-core's ranks leave a weight group only when their processes end")


def test_collective_rpc_reload_on_a_serving_stage_needs_a_source(served: Served) -> None:
    refused = served.client.post("/collective_rpc", json={"method": "reload_weights"})
    body = _refused(refused, 409, "reload_weights on a serving stage runs as a versioned update")
    assert body["error"]["fields"] == ["kwargs.source"] and served.stage("talker")["state"] == "RUNNING"


@pytest.mark.parametrize("method", sorted({*RPC_ROUTES, "execute_model", "_update", "__init__"}))
def test_collective_rpc_names_the_route_of_each_extension_method_and_refuses_the_rest(
    served: Served, method: str
) -> None:
    """Over HTTP collective_rpc runs reload_weights only; each of the other allowlisted extension
    methods (verl's, OpenRLHF's) is refused naming the route that does the same, any other name
    listing the allowlist. Nothing reaches a rank: the stage stays where it was."""
    version = served.stage("talker")["weights_version"]
    answer = served.client.post("/collective_rpc", json={"method": method, "args": [], "kwargs": {}})
    needle = RPC_ROUTES.get(method, "omni-core's extension methods are")
    body = _refused(answer, 400, needle)
    assert body["error"]["fields"] == ["method"]
    assert (served.stage("talker")["state"], served.stage("talker")["weights_version"]) == ("RUNNING", version)


def test_the_http_routes_of_the_extension_methods_are_the_allowlist_and_exist() -> None:
    from omni_core.serve.openapi import openapi_schema

    assert set(RPC_ROUTES) == set(EXTENSION_METHODS) - {"reload_weights"}
    paths = openapi_schema()["paths"]
    for route in RPC_ROUTES.values():
        verb, path = route.split()
        assert verb.lower() in paths[path], route


def test_a_weight_update_bracket_resumes_only_what_its_start_paused(served: Served) -> None:
    """vLLM's /start_weight_update pauses a RUNNING stage and its /finish_weight_update resumes
    it; a stage the client paused before the start stays paused after the finish."""
    assert served.client.post("/start_weight_update").status_code == 200
    assert served.stage("talker")["state"] == "PAUSED"
    finished = served.client.post("/finish_weight_update", json={"weight_version": "none-sent"})
    assert finished.status_code == 200 and served.stage("talker")["state"] == "RUNNING", finished.text
    assert served.client.get("/weight_info").json()["weight_version"] == "none-sent"  # a label for the version held
    served.client.post("/pause?mode=wait")
    assert served.client.post("/start_weight_update").status_code == 200
    assert served.client.post("/finish_weight_update").status_code == 200
    assert served.stage("talker")["state"] == "PAUSED"  # the client's pause is the client's to end
    served.client.post("/update_weight_version", json={"new_version": "0"})  # the label back to the integer
