"""Each anchor's lifecycle routes, sent the request shapes its clients send (query strings,
JSON bodies, defaults, empty lists, unknown fields), answered in the anchor's shape and codes.
docs/http_routes.md lists every route with the test here that covers it.

The anchors, as read from their sources: vLLM's dev-mode routes (`/sleep?level=&mode=` with
mode abort by default, `/wake_up?tags=`, `/is_sleeping`, `/pause`, `/resume`, `/is_paused`),
vLLM-Omni's `OmniSleepRequest` (`stage_ids` required, at least one; `level` 2 unless given)
and its answers (`{"status": "SUCCESS", "acks": [...]}`, "SKIPPED" for a wake-up of stages
none of which sleeps), SGLang's `/release_memory_occupation` and `/resume_memory_occupation`
(`tags`), and a /health that answers 503 when the engine is dead. The cache resets (vLLM's
`/reset_prefix_cache`, SGLang's `/flush_cache`) are in test_cache_reset.py."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from omni_core.engine.errors import RequestFailedError
from omni_core.serve.openapi import openapi_schema
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, resume
from tests.serve.conftest import PROBE, Served, make_config, metric_value, serving, stage_table, wait_for

pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def _is_sleeping(served: Served) -> bool:
    answer = served.client.get("/is_sleeping")
    assert answer.status_code == 200, answer.text
    return answer.json()["is_sleeping"]


def _refused(answer: httpx.Response, status: int, needle: str) -> dict[str, Any]:
    assert answer.status_code == status and needle in answer.json()["error"]["message"], answer.text
    return answer.json()


# ------------------------------------------------------------------ vLLM


def test_vllm_is_sleeping_until_every_tag_is_back(served: Served) -> None:
    """Level 2, wake weights, reload: kv_cache is still released, so vLLM's client is told
    the engine sleeps, and every wake_up answer says so until the last tag is back."""
    assert served.client.post("/sleep?level=2").status_code == 200
    assert _is_sleeping(served)
    woken = served.client.post("/wake_up?tags=weights").json()
    assert woken["status"] == "sleeping" and woken["tags_woken"] == ["weights"], woken
    assert _is_sleeping(served)
    reloaded = served.client.post("/collective_rpc", json={"method": "reload_weights"})
    assert reloaded.status_code == 200, reloaded.text
    talker = served.stage("talker")
    assert talker["asleep_tags"] == ["kv_cache"] and talker["weights_valid"], talker
    assert _is_sleeping(served), "kv_cache is still released"
    last = served.client.post("/wake_up?tags=kv_cache").json()
    assert last["status"] == "awake" and not _is_sleeping(served)


def test_vllm_wake_after_level2_is_not_awake(served: Served) -> None:
    """NEEDS_RELOAD has every tag mapped and the weights discarded: not awake."""
    served.client.post("/sleep", params={"level": 2})
    woken = served.client.post("/wake_up")
    assert woken.status_code == 200 and woken.json()["status"] == "sleeping", woken.text
    assert served.stage("talker")["state"] == "NEEDS_RELOAD" and _is_sleeping(served)
    served.client.post("/collective_rpc", json={"method": "reload_weights"})
    assert not _is_sleeping(served)


def test_vllm_json_bodies_are_honoured(served: Served) -> None:
    slept = served.client.post("/sleep", json={"level": 2})
    assert slept.status_code == 200 and slept.json()["level"] == 2, slept.text
    talker = served.stage("talker")
    assert talker["state"] == "SLEEPING" and talker["weights_valid"] is False, talker
    served.engine.wake("talker")
    served.engine.reload_weights("talker")
    served.client.post("/sleep", json={"level": 1, "mode": "wait"})
    woken = served.client.post("/wake_up", json={"tags": ["weights"]})
    assert woken.status_code == 200 and woken.json()["tags_woken"] == ["weights"], woken.text
    talker = served.stage("talker")
    assert talker["state"] == "PARTIAL" and talker["asleep_tags"] == ["kv_cache"], talker


@pytest.mark.parametrize(
    ("route", "params", "body", "field"),
    [
        ("/sleep", {}, {"levle": 2}, "levle"),
        ("/sleep", {}, {"level": "2"}, "level"),  # nothing converted
        ("/sleep", {"level": 1}, {"level": 2}, "level"),  # given twice: which one?
        ("/wake_up", {}, {"tag": ["weights"]}, "tag"),
        ("/wake_up", {"tags": "weights"}, {"tags": ["weights"]}, "tags"),
    ],
)
def test_vllm_bodies_are_strict(
    served: Served, route: str, params: dict[str, Any], body: dict[str, Any], field: str
) -> None:
    served.engine.sleep("talker", 1)  # so that a wake_up that went through would show
    answer = served.client.post(route, params=params, json=body)
    assert answer.status_code == 422, answer.text
    assert any(field in f for f in answer.json()["error"]["fields"]), answer.text
    assert served.stage("talker")["state"] == "SLEEPING"


@pytest.mark.parametrize("mode", [None, "abort", "wait", "keep"])
def test_vllm_sleep_mode_abort_is_the_default(served: Served, mode: str | None) -> None:
    """vLLM's /sleep aborts in-flight requests unless told mode=wait or keep: with rank 1
    stopped mid-request, an abort answers the request at once (409 aborted) while the sleep
    waits for the rank; wait and keep leave the request running and it completes (keep cannot
    freeze it halfway, as vLLM would, and recompute it after the wake)."""
    reference = served.engine.execute("talker", PROBE)
    busy = served.stage("talker")["ranks"]["1"]["pid"]
    os.kill(busy, signal.SIGSTOP)
    try:
        request = served.engine.submit("talker", PROBE, timeout_s=LONG_TIMEOUT_S)
        wait_for(lambda: served.stage("talker")["in_flight"] == 1, what="request in flight")
        params = {} if mode is None else {"mode": mode}
        sleeping = in_thread(lambda: served.client.post("/sleep", params=params))
        wait_for(lambda: served.stage("talker")["state"] == "DRAINING", what="the sleep to close admission")
        if mode in ("wait", "keep"):
            assert not request.done()
        else:
            wait_for(request.done, what="the abort to answer the request")
            with pytest.raises(RequestFailedError, match="aborted"):
                request.result()
    finally:
        resume(busy)
    answer = sleeping.result(timeout=60)
    assert answer.status_code == 200 and answer.json()["mode"] == (mode or "abort"), answer.text
    if mode in ("wait", "keep"):
        assert request.result(timeout=10) == reference


@pytest.mark.parametrize(
    ("query", "status", "needle"),
    [
        ("mode=pause", 400, "is not one of 'abort'"),
        ("level=3", 400, "sleep level must be 1 or 2, got 3"),
    ],
)
def test_vllm_bad_sleep_modes_are_refused(served: Served, query: str, status: int, needle: str) -> None:
    _refused(served.client.post(f"/sleep?{query}"), status, needle)
    assert served.stage("talker")["state"] == "RUNNING"


# ------------------------------------------------------------------ vLLM-Omni


def test_omni_sleep_defaults_to_level_2_and_answers_acks(served: Served) -> None:
    slept = served.client.post("/v1/omni/sleep", json={"stage_ids": [1]})
    assert slept.status_code == 200, slept.text
    body = slept.json()
    assert body["status"] == "SUCCESS" and list(body["stages"]) == ["decoder"]
    assert [(a["stage_id"], a["rank"], a["status"]) for a in body["acks"]] == [(1, 0, "OK")]
    assert body["acks"][0]["freed_bytes"] > 0 and body["acks"][0]["metadata"]["state"] == "SLEEPING"
    assert body["acks"][0]["restored_bytes"] == 0
    decoder = served.stage("decoder")
    assert decoder["state"] == "SLEEPING" and decoder["weights_valid"] is False, decoder  # level 2
    woken = served.client.post("/v1/omni/wakeup", json={"stage_ids": [1]}).json()
    # freed_bytes never negative: the wake's mapped bytes are restored_bytes
    assert woken["acks"][0]["freed_bytes"] == 0 < woken["acks"][0]["restored_bytes"], woken


def test_omni_acks_one_per_rank_of_each_stage_once(served: Served) -> None:
    slept = served.client.post("/v1/omni/sleep", json={"stage_ids": [0, "decoder", 0], "level": 1})
    assert slept.status_code == 200, slept.text
    acks = sorted((a["stage_id"], a["rank"]) for a in slept.json()["acks"])
    assert acks == [(0, 0), (0, 1), (1, 0)]
    woken = served.client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]}).json()
    assert woken["status"] == "SUCCESS" and len(woken["acks"]) == 3
    assert {s["state"] for s in served.client.get("/v1/stages").json()["stages"]} == {"RUNNING"}


@pytest.mark.parametrize("route", ["/v1/omni/sleep", "/v1/omni/wakeup"])
@pytest.mark.parametrize("body", [{}, {"stage_ids": []}, {"level": 1}], ids=["empty", "no-stage", "no-ids"])
def test_omni_refuses_empty_targets(served: Served, route: str, body: dict[str, Any]) -> None:
    if route.endswith("wakeup") and "level" in body:
        body = {"tags": ["weights"]}
    served.engine.sleep("decoder", 1)  # a wake-up that went through would show
    answer = served.client.post(route, json=body)
    assert answer.status_code == 422 and "stage_ids" in answer.text, answer.text
    assert served.stage("talker")["state"] == "RUNNING" and served.stage("decoder")["state"] == "SLEEPING"


def test_omni_wakeup_of_awake_stages_is_skipped(served: Served) -> None:
    before = served.client.get("/metrics").text
    answer = served.client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "SKIPPED" and answer.json()["acks"] == []
    after = served.client.get("/metrics").text
    count = "omni_core_lifecycle_duration_seconds_count"
    for stage in ("talker", "decoder"):  # no wake was sent
        assert metric_value(after, count, stage=stage, command="wake") == metric_value(
            before, count, stage=stage, command="wake"
        )
    served.engine.sleep("decoder", 1)  # one of them asleep: both are woken, as vLLM-Omni does
    answer = served.client.post("/v1/omni/wakeup", json={"stage_ids": [0, 1]})
    assert answer.json()["status"] == "SUCCESS", answer.text
    assert {a["metadata"]["stage"]: a["status"] for a in answer.json()["acks"]} == {
        "talker": "ALREADY",
        "decoder": "OK",
    }


# ------------------------------------------------------------------ SGLang


def test_sglang_release_and_resume_with_tags(served: Served) -> None:
    released = served.client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
    assert released.status_code == 200 and released.json()["success"] is True, released.text
    assert served.stage("talker")["asleep_tags"] == ["kv_cache"] and _is_sleeping(served)
    resumed = served.client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert resumed.status_code == 200 and resumed.json()["success"] is True, resumed.text
    assert served.stage("talker")["state"] == "RUNNING"
    assert served.client.post("/release_memory_occupation").json()["success"] is True  # no body: every tag
    assert served.stage("talker")["asleep_tags"] == ["kv_cache", "weights"]
    served.client.post("/resume_memory_occupation")
    assert served.stage("talker")["state"] == "RUNNING"  # level 1 kept the weights
    assert served.engine.execute("talker", PROBE) is not None


def test_sglang_release_level_2_needs_a_reload(served: Served) -> None:
    served.client.post("/release_memory_occupation", json={"level": 2})
    served.client.post("/resume_memory_occupation", json={})
    assert served.stage("talker")["state"] == "NEEDS_RELOAD" and _is_sleeping(served)


def test_sglang_errors_say_success_false(served: Served) -> None:
    answer = served.client.post("/release_memory_occupation", json={"tags": ["cuda_graph"]})
    body = _refused(answer, 400, "unknown tag")
    assert body["success"] is False and "unknown tag" in body["message"]
    assert served.client.post("/release_memory_occupation", json={"tag": ["weights"]}).status_code == 422
    assert served.stage("talker")["state"] == "RUNNING"


def test_sglang_get_changes_nothing(served: Served) -> None:
    # SGLang takes GET too; here a GET never releases or restores memory (GET /flush_cache,
    # which moves none, is served: test_sglang_get_flush_cache_is_the_flush_and_a_cross_site_get_is_refused).
    for route in ("/release_memory_occupation", "/resume_memory_occupation"):
        got = served.client.get(route)
        assert got.status_code == 405 and got.headers["allow"] == "POST", got.text
        assert "GET is not allowed on " + route + "; use POST" in got.json()["error"]["message"]
    assert served.stage("talker")["state"] == "RUNNING"


# ------------------------------------------------------------------ health, metrics, guards


def test_health_is_503_naming_the_failed_stage(served: Served) -> None:
    assert served.client.get("/health").json() == {
        "status": "ok",
        "stages": {"talker": "RUNNING", "decoder": "RUNNING"},
        "failed": [],
    }
    served.engine.sleep("talker", 1)
    assert served.client.get("/health").status_code == 200  # asleep is healthy
    os.kill(served.stage("decoder")["ranks"]["0"]["pid"], signal.SIGKILL)
    wait_for(lambda: served.stage("decoder")["state"] == "FAILED", what="decoder FAILED after its rank died")
    answer = served.client.get("/health")
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert body["status"] == "failed" and body["failed"] == ["decoder"] and body["error"]["stage"] == "decoder"
    assert "POST /v1/stages/decoder/restart" in body["error"]["message"]
    served.settle()
    assert served.client.get("/health").status_code == 200


def _vllm_state(served: Served, engine: str) -> str:
    text = served.client.get("/metrics").text
    values = [
        s
        for s in ("awake", "weights_offloaded", "discard_all")
        if metric_value(text, "vllm:engine_sleep_state", engine=engine, sleep_state=s) == 1
    ]
    return values[0] if len(values) == 1 else f"none of them ({values})"


def test_vllm_sleep_state_metric_under_vllms_name(served: Served) -> None:
    wait_for(
        lambda: (
            metric_value(
                served.client.get("/metrics").text,
                "vllm:engine_sleep_state",
                model_name="decoder",
                engine="1",
                sleep_state="awake",
            )
            == 1
        ),
        what="decoder awake under vLLM's labels",
    )
    served.engine.sleep("decoder", 1)
    wait_for(lambda: _vllm_state(served, "1") == "weights_offloaded", what="weights_offloaded")
    served.engine.wake("decoder", ["weights"])  # PARTIAL: still asleep
    wait_for(lambda: _vllm_state(served, "1") == "weights_offloaded", what="weights_offloaded while PARTIAL")
    served.engine.wake("decoder")
    served.engine.sleep("decoder", 2)
    wait_for(lambda: _vllm_state(served, "1") == "discard_all", what="discard_all")
    assert _vllm_state(served, "0") == "awake"


@pytest.mark.parametrize(
    "route",
    ["/release_memory_occupation", "/resume_memory_occupation", "/sleep", "/wake_up", "/v1/omni/sleep", "/pause"],
)
def test_anchor_routes_keep_the_browser_guards(served: Served, route: str) -> None:
    served.engine.sleep("decoder", 1)
    form = served.client.post(
        route, content=b"tags=weights", headers={"Content-Type": "application/x-www-form-urlencoded"}
    )
    assert form.status_code == 415, form.text
    foreign = served.client.post(route, headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403, foreign.text
    rebound = served.client.post(route, headers={"Host": "evil.example"})
    assert rebound.status_code == 403, rebound.text
    assert served.stage("talker")["state"] == "RUNNING" and served.stage("decoder")["state"] == "SLEEPING"


# ------------------------------------------------------------------ the table in the docs

ROUTES_DOC = Path(__file__).resolve().parents[2] / "docs" / "http_routes.md"
ANCHOR_TAGS = {"vLLM", "vLLM-Omni", "SGLang"}


def test_routes_table_names_every_anchor_route_and_real_tests() -> None:
    """docs/http_routes.md lists every route tagged with an anchor, and each test it names
    exists, so the table cannot drift from the code."""
    text = ROUTES_DOC.read_text(encoding="utf-8")
    schema = openapi_schema()["paths"]
    anchored = {
        path for path, ops in schema.items() if any(ANCHOR_TAGS & set(op.get("tags", [])) for op in ops.values())
    }
    first_cells = [line.split("|")[1] for line in text.splitlines() if line.startswith("| ")]
    table_paths = {path for cell in first_cells for path in re.findall(r"`(?:GET|POST) (/[\w/]+)", cell)}
    assert anchored <= table_paths, f"routes missing from docs/http_routes.md: {sorted(anchored - table_paths)}"
    named = set(re.findall(r"`(test_[a-z0-9_]+)`", text))
    here = Path(__file__).parent
    defined = {
        name
        for f in (
            "test_anchor_routes.py",
            "test_compat.py",
            "test_weight_routes.py",
            "test_cache_reset.py",
            "test_pause_routes.py",
            "test_rl_routes.py",
            "test_trl.py",
            "test_api.py",
            "test_wake_no_memory.py",
            "test_sglang_group.py",
            "test_ipc_route.py",
            "test_metrics.py",
            "../test_integrations.py",
            "test_lora_routes.py",
            "test_adapter_surfaces.py",
            "test_save_route.py",
        )
        for name in re.findall(r"^def (test_[a-z0-9_]+)", (here / f).read_text(encoding="utf-8"), re.M)
    }
    assert named and named <= defined, f"tests named in docs/http_routes.md but not defined: {named - defined}"


# ------------------------------------------------------------------ OpenAI (vLLM's OpenAI server)


def _sse(answer: httpx.Response) -> list[Any]:
    """The events of a server-sent stream: each `data:` line's JSON, "[DONE]" as itself."""
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream"), answer.text
    events = []
    for block in answer.text.split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> Any:
    """A stage of a tiny seeded Qwen2 (transformers runner, with its tokenizer) beside a synthetic one."""
    pytest.importorskip("transformers", reason="needs the models extra: pip install -e '.[models]'")
    from omni_core.models import make_checkpoint

    root = tmp_path_factory.mktemp("openai")
    model = str(make_checkpoint("qwen2", "tiny", root / "qwen2", seed=0).path)
    other = str(make_checkpoint("qwen2", "tiny", root / "qwen2-seed1", seed=1).path)
    args = {"model": model, "max_batch": 4, "max_seq_len": 96, "cpu_threads": 1}
    config = make_config(stage_table("llm", runner="transformers", runner_args=args), stage_table("plain"))
    with serving(config) as s:
        s.other_checkpoint = other  # type: ignore[attr-defined]
        yield s


def _greedy(prompt: Any, **more: Any) -> dict[str, Any]:
    return {"model": "llm", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **more}


def test_openai_completions_answer_as_vllm_with_the_weights_version(llm: Served) -> None:
    direct = llm.engine.execute("llm", {"prompt": "hello world", "max_new_tokens": 8, "stop_at_eos": False})
    answer = llm.client.post("/v1/completions", json=_greedy("hello world"))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == "llm"
    (choice,) = body["choices"]
    assert (choice["index"], choice["text"], choice["finish_reason"]) == (0, direct["text"], "length")
    assert choice["token_ids"] == direct["token_ids"] and choice["logprobs"] is None
    assert body["usage"] == {
        "prompt_tokens": direct["prompt_tokens"],
        "completion_tokens": 8,
        "total_tokens": direct["prompt_tokens"] + 8,
    }
    assert body["weights_version"] == llm.engine.status()["llm"]["weights_version"] == choice["weights_version"]
    # By the model id GET /v1/models lists, several prompts (text and token ids), each its own request.
    model_id = llm.client.get("/v1/models").json()["data"][0]["id"]
    several = llm.client.post("/v1/completions", json=_greedy(["hello world", "good night"], model=model_id))
    texts = [c["text"] for c in several.json()["choices"]]
    alone = llm.client.post("/v1/completions", json=_greedy("good night")).json()["choices"][0]["text"]
    assert texts == [direct["text"], alone] and several.json()["model"] == model_id
    ids = llm.client.post("/v1/completions", json=_greedy([5, 6, 7])).json()["choices"][0]["token_ids"]
    assert (
        ids
        == llm.engine.execute("llm", {"prompt_ids": [5, 6, 7], "max_new_tokens": 8, "stop_at_eos": False})["token_ids"]
    )


def test_openai_completions_after_an_update_name_the_new_version(llm: Served) -> None:
    before = llm.client.post("/v1/completions", json=_greedy("hello world")).json()
    llm.engine.update_weights("llm", llm.other_checkpoint, version=1)  # type: ignore[attr-defined]
    try:
        after = llm.client.post("/v1/completions", json=_greedy("hello world")).json()
        assert after["weights_version"] == 1 and after["choices"][0]["weights_version"] == 1
        assert after["choices"][0]["token_ids"] != before["choices"][0]["token_ids"]
        llm.engine.update_weights("llm", llm.config.stages[0].runner_args["model"], version=2)
        again = llm.client.post("/v1/completions", json=_greedy("hello world")).json()
        assert again["weights_version"] == 2 and again["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    finally:
        llm.settle("llm")


def test_openai_completions_stream_over_sse(llm: Served) -> None:
    whole = llm.client.post("/v1/completions", json=_greedy("hello world")).json()
    streamed = llm.client.post(
        "/v1/completions", json=_greedy("hello world", stream=True, stream_options={"include_usage": True})
    )
    events = _sse(streamed)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == whole["usage"] and events[-2]["choices"] == []
    chunks = events[:-2]
    assert {e["object"] for e in chunks} == {"text_completion"} and len({e["id"] for e in chunks}) == 1
    assert "".join(e["choices"][0]["text"] for e in chunks) == whole["choices"][0]["text"]
    assert [e["choices"][0]["finish_reason"] for e in chunks][-1] == "length"
    assert chunks[0]["weights_version"] == whole["weights_version"]


def test_openai_chat_completions_and_its_stream(llm: Served) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    body = {"model": "llm", "messages": messages, "max_completion_tokens": 6, "temperature": 0, "ignore_eos": True}
    answer = llm.client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    chat = answer.json()
    assert chat["object"] == "chat.completion" and chat["id"].startswith("chatcmpl-")
    (choice,) = chat["choices"]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    # The tiny tokenizer has no chat template: omni-core's plain one, as a completion of it gives.
    plain = "system: be brief\nuser: hi\nassistant:"
    same = llm.client.post("/v1/completions", json=_greedy(plain, max_tokens=6)).json()["choices"][0]
    assert choice["message"]["content"] == same["text"] and choice["token_ids"] == same["token_ids"]
    events = _sse(llm.client.post("/v1/chat/completions", json={**body, "stream": True}))
    assert events[-1] == "[DONE]" and {e["object"] for e in events[:-1]} == {"chat.completion.chunk"}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == choice["message"]["content"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_openai_stop_strings_end_the_text_before_them(llm: Served) -> None:
    text = llm.client.post("/v1/completions", json=_greedy("hello world")).json()["choices"][0]["text"]
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), f"pick another prompt: {text!r}"
    cut = llm.client.post("/v1/completions", json=_greedy("hello world", stop=[stop])).json()["choices"][0]
    assert cut["text"] == text[: text.find(stop)] and cut["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("fields", "status", "needle"),
    [
        ({"n": 2}, 400, "['n'] ask for what"),
        ({"top_p": 0.5, "presence_penalty": 1.0}, 400, "['presence_penalty', 'top_p']"),
        ({"echo": True}, 400, "['echo']"),
        ({"model": "gpt-4"}, 404, "model 'gpt-4' is not served here"),
        ({"model": "plain"}, 400, "does not generate text"),
        ({"stop": ["a", "b", "c", "d", "e"]}, 400, "up to 4"),
        ({"max_tokens": 0}, 422, "max_tokens"),
        ({"temprature": 0.5}, 422, "temprature"),
    ],
)
def test_openai_refuses_what_it_cannot_honour(llm: Served, fields: dict[str, Any], status: int, needle: str) -> None:
    answer = llm.client.post("/v1/completions", json=_greedy("hello", **fields))
    assert answer.status_code == status and needle in answer.text, answer.text


def test_openai_requests_under_sleep_follow_the_admission_policy(llm: Served) -> None:
    llm.engine.sleep("llm", 1)
    try:
        llm.engine.set_admission("llm", "reject")
        refused = llm.client.post("/v1/completions", json=_greedy("hello world"))
        assert refused.status_code == 409 and "admission policy is 'reject'" in refused.text, refused.text
        llm.engine.set_admission("llm", "wake")
        woken = llm.client.post("/v1/completions", json=_greedy("hello world"))
        assert woken.status_code == 200 and woken.json()["choices"][0]["finish_reason"] == "length", woken.text
        assert llm.stage("llm")["state"] == "RUNNING"
    finally:
        llm.settle("llm")
