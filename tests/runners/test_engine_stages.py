"""Real models as stages of an Engine: rank processes, sockets, the state machines and the
portable backend, end to end. One engine for the module (two stages: a tiny Qwen2 and a tiny
DiT); each test leaves both stages RUNNING.

Admission is `reject`, so a request to a stage that is not RUNNING fails at once instead of
waiting in the queue.
"""

from __future__ import annotations

import pytest

from omni_core import Engine, StageSpec
from omni_core.engine.errors import InvalidArgumentError, RequestFailedError, RequestRejectedError
from omni_core.runners.transformers_runner import TransformersRunner

from .conftest import CPU, Pools

LLM_ARGS = {"max_seq_len": 64, "max_batch": 2, "cpu_threads": 1}
SAMPLED = {
    "prompt_ids": [5, 6, 7, 8, 9],
    "max_new_tokens": 12,
    "stop_at_eos": False,
    "sampling": {"temperature": 1.0, "seed": 3},
}
DIT = {"class_label": 7, "seed": 4, "steps": 6}


@pytest.fixture(scope="module")
def engine(checkpoints):
    common = {
        "backend": "portable",
        "admission": "reject",
        "deadline_s": 60.0,
        "start_deadline_s": 240.0,
        "request_timeout_s": 60.0,
    }
    specs = [
        StageSpec("llm", runner="transformers", runner_args={"model": str(checkpoints["qwen2"]), **LLM_ARGS}, **common),
        StageSpec(
            "dit",
            runner="diffusers",
            tags=("weights", "kv_cache", "requests"),
            runner_args={
                "model": str(checkpoints["dit"]),
                "scheduler": "DPMSolverMultistepScheduler",
                "max_requests": 4,
                "cpu_threads": 1,
            },
            **common,
        ),
    ]
    engine = Engine(specs)
    yield engine
    engine.shutdown()


def reload_after_level2(engine: Engine, stage: str, source: str | None = None) -> None:
    engine.sleep(stage, level=2)
    assert engine.wake(stage).state == "NEEDS_RELOAD"
    assert engine.reload_weights(stage, source=source).state == "RUNNING"


def test_llm_sleeps_and_reloads_bit_identical(engine, checkpoints):
    tokens = engine.execute("llm", SAMPLED)["token_ids"]
    report = engine.sleep("llm", level=1)
    rank = report.ranks[0]
    assert report.state == "SLEEPING" and rank.pool_bytes_after == {"weights": 0, "kv_cache": 0}
    assert rank.pool_bytes_before["weights"] > 0
    engine.wake("llm")
    assert engine.execute("llm", SAMPLED)["token_ids"] == tokens
    reload_after_level2(engine, "llm")
    assert engine.execute("llm", SAMPLED)["token_ids"] == tokens
    # A weight update: another checkpoint of the same architecture, then back.
    reload_after_level2(engine, "llm", str(checkpoints["qwen2-seed1"]))
    other = Pools(TransformersRunner(CPU, model=str(checkpoints["qwen2-seed1"]), **LLM_ARGS)).runner
    updated = engine.execute("llm", SAMPLED)["token_ids"]
    assert updated == other.execute(SAMPLED)["token_ids"] != tokens
    reload_after_level2(engine, "llm", None)
    assert engine.execute("llm", SAMPLED)["token_ids"] == tokens


def test_partial_wake_refuses_requests(engine):
    tokens = engine.execute("llm", SAMPLED)["token_ids"]
    engine.sleep("llm", level=1)
    assert engine.wake("llm", tags=["weights"]).state == "PARTIAL"
    with pytest.raises(RequestRejectedError):
        engine.execute("llm", SAMPLED)
    assert engine.wake("llm", tags=["kv_cache"]).state == "RUNNING"
    assert engine.execute("llm", SAMPLED)["token_ids"] == tokens


def test_bad_request_is_an_execute_error(engine):
    with pytest.raises(RequestFailedError, match=r"EXECUTE_ERROR .*ValueError: unknown payload key\(s\) \['seed'\]"):
        engine.execute("llm", {"prompt_ids": [1], "seed": 3})
    assert engine.execute("llm", {"prompt_ids": [1], "max_new_tokens": 2})["finish_reason"] in ("length", "stop")


def test_stepwise_image_survives_a_level1_sleep(engine):
    whole = engine.execute("dit", DIT)["sha256"]
    started = engine.execute("dit", {"op": "start", **DIT})
    engine.execute("dit", {"op": "step", "request_id": started["request_id"], "steps": 3})
    report = engine.sleep("dit", level=1)
    assert report.ranks[0].pool_bytes_before["requests"] > 0 == report.ranks[0].pool_bytes_after["requests"]
    engine.wake("dit")
    assert engine.execute("dit", {"op": "finish", "request_id": started["request_id"]})["sha256"] == whole
    reload_after_level2(engine, "dit")
    assert engine.execute("dit", DIT)["sha256"] == whole


def test_level2_sleep_aborts_stepwise_requests(engine):
    started = engine.execute("dit", {"op": "start", **DIT})
    engine.execute("dit", {"op": "step", "request_id": started["request_id"], "steps": 2})
    reload_after_level2(engine, "dit")
    with pytest.raises(
        RequestFailedError,
        match=f"RequestLostError: request {started['request_id']} was aborted: "
        "the weights were reloaded while it was in flight",
    ):
        engine.execute("dit", {"op": "finish", "request_id": started["request_id"]})


def test_reload_of_another_architecture_is_refused_and_changes_nothing(engine, checkpoints):
    tokens = engine.execute("llm", SAMPLED)["token_ids"]
    engine.sleep("llm", level=2)
    engine.wake("llm")
    # The rank answers NACK INVALID_ARGUMENT before writing a tensor; the stage stays where it was.
    refusal = r"refused.*the source is a 'llama'.*tensor 'model.layers.0.self_attn.q_proj.bias' is missing"
    with pytest.raises(InvalidArgumentError, match=refusal):
        engine.reload_weights("llm", source=str(checkpoints["llama"]))
    assert engine.status()["llm"]["state"] == "NEEDS_RELOAD"
    assert engine.reload_weights("llm").state == "RUNNING"
    assert engine.execute("llm", SAMPLED)["token_ids"] == tokens
