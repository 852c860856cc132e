"""In-flight refit through the vllm runner, on the GPU (pause mode keep): requests frozen in
vLLM's engine mid-generation, the weights updated from checkpoint A to B, resumed. Needs
CUDA and vLLM (../shared/device/VLLM.md); written for the device, not run on CPU.

What is compared token for token: a held request's tokens before its recorded span boundary
are A's greedy generation's; with clear_cache the whole answer is a fresh B stage's (its KV
was dropped, it restarted on B). Without clear_cache the tokens after the boundary attend to
KV that A computed, which no single-checkpoint reference reproduces: they are B's weights on
A's cache, and the test holds them to differ from A's continuation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runners.test_vllm_prefix_gpu import _spec

pytestmark = pytest.mark.gpu

PROMPTS = [[(31 * i + 7 * j) % 5000 + 100 for i in range(24)] for j in range(4)]
MAX_NEW_TOKENS = 192


def _request(prompt: list[int]) -> dict[str, Any]:
    return {"prompt_ids": prompt, "max_new_tokens": MAX_NEW_TOKENS, "stop_at_eos": False}


def _checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    from omni_core.models.make import make_checkpoint

    a, b = tmp_path / "a", tmp_path / "b"
    make_checkpoint("qwen2", "0.5b", a, seed=0, dtype="bfloat16")
    make_checkpoint("qwen2", "0.5b", b, seed=1, dtype="bfloat16")
    return a, b


def _alone(model: Path) -> list[list[int]]:
    from omni_core.engine import Engine

    with Engine([_spec(model)]) as engine:
        return [engine.execute("llm", _request(p))["token_ids"] for p in PROMPTS]


def _held_through_an_update(a: Path, b: Path, clear_cache: bool) -> list[Any]:
    from omni_core.engine import Engine

    spec = _spec(a)
    with Engine([spec]) as engine:
        futures = [engine.submit("llm", _request(p), timeout_s=300.0, with_version=True) for p in PROMPTS]
        engine.pause("llm", "keep", clear_cache=clear_cache)
        assert engine.status()["llm"]["in_flight"] == len(PROMPTS)  # held, not finished
        engine.update_weights("llm", str(b), version=1)
        engine.resume("llm")
        return [f.result(timeout=300.0) for f in futures]


def test_held_requests_keep_as_tokens_before_their_boundary_and_go_on_under_b(tmp_path: Path) -> None:
    a, b = _checkpoints(tmp_path)
    on_a = _alone(a)
    for result, alone in zip(_held_through_an_update(a, b, clear_cache=False), on_a, strict=True):
        spans = [(s.weights_version, s.start_token) for s in result.version_spans]
        assert result.weights_version == 1 and [v for v, _ in spans] == [0, 1], spans
        boundary = spans[1][1]
        assert boundary < MAX_NEW_TOKENS
        assert result.output["token_ids"][:boundary] == alone[:boundary]
        assert result.output["token_ids"][boundary:] != alone[boundary:]


def test_clear_cache_restarts_held_requests_on_b_as_a_fresh_stage_on_b(tmp_path: Path) -> None:
    a, b = _checkpoints(tmp_path)
    on_b = _alone(b)
    for result, alone in zip(_held_through_an_update(a, b, clear_cache=True), on_b, strict=True):
        assert [(s.weights_version, s.start_token) for s in result.version_spans] == [(1, 0)]
        assert result.output["token_ids"] == alone
