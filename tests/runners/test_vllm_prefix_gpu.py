"""vLLM's prefix cache follows the weights version, on the GPU.

vLLM v1 caches full 16-token KV blocks by their tokens alone. A stage on checkpoint A serves a
prompt of three full blocks and more; after an update to checkpoint B (and after a reload of B
from a sleep that kept the KV cache awake), the same prompt, and one sharing two blocks with it,
must give the tokens a fresh stage started on B gives: the worker drops the prefix blocks
before it ACKs (`caches_dropped`). Needs CUDA and vLLM (../shared/device/VLLM.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

BLOCK_TOKENS = 16  # vLLM's default KV block
PROMPT = [(37 * i + 11) % 5000 + 100 for i in range(3 * BLOCK_TOKENS + 5)]
SHARING_TWO_BLOCKS = PROMPT[: 2 * BLOCK_TOKENS] + [4242, 4243, 4244]
REQUEST = {"prompt_ids": [PROMPT, SHARING_TWO_BLOCKS], "max_new_tokens": 16, "stop_at_eos": False}


def _spec(model: Path) -> Any:
    from omni_core.engine import StageSpec

    return StageSpec(
        "llm",
        runner="vllm",
        backend="cumem",
        device="cuda",
        gpu_memory_fraction=0.35,
        runner_args={
            "model": str(model),
            "max_model_len": 512,
            "max_num_seqs": 4,
            "attention_backend": os.environ.get("VLLM_BUNDLE_ATTN_BACKEND"),
        },
        deadline_s=300.0,
        start_deadline_s=600.0,
        request_timeout_s=300.0,
    )


def _tokens(engine: Any) -> list[list[int]]:
    return engine.execute("llm", REQUEST)["token_ids"]


def _two_checkpoints_and_a_fresh_stage_on_b(tmp_path: Path) -> tuple[Path, Path, list[list[int]]]:
    """Checkpoints A and B (seeds 0 and 1) and the tokens a fresh stage on B gives; skips
    without CUDA or vLLM."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    from omni_core.engine import Engine
    from omni_core.models.make import make_checkpoint

    a, b = tmp_path / "a", tmp_path / "b"
    make_checkpoint("qwen2", "0.5b", a, seed=0, dtype="bfloat16")
    make_checkpoint("qwen2", "0.5b", b, seed=1, dtype="bfloat16")
    with Engine([_spec(b)]) as fresh:
        return a, b, _tokens(fresh)


def test_a_prompt_of_three_blocks_after_an_update_or_a_reload_equals_a_fresh_stage(tmp_path: Path) -> None:
    from omni_core.engine import Engine

    a, b, on_b = _two_checkpoints_and_a_fresh_stage_on_b(tmp_path)
    with Engine([_spec(a)]) as engine:
        on_a = _tokens(engine)
        assert _tokens(engine) == on_a  # the second pass reads the cached blocks
        assert on_a != on_b  # the checkpoints differ where the prompt reaches
        report = engine.update_weights("llm", str(b), version=1)
        assert report.ranks[0].caches_dropped == ("prefix_kv",)
        assert _tokens(engine) == on_b
        # A reload from a level-2 sleep of the weights alone: the KV cache, and the prefix
        # blocks B computed, stay mapped the whole time; the reload brings A back.
        engine.sleep("llm", 2, tags=["weights"])
        assert engine.wake("llm").state == "NEEDS_RELOAD"
        reload = engine.reload_weights("llm", str(a))
        assert reload.ranks[0].caches_dropped == ("prefix_kv",)
        assert _tokens(engine) == on_a


def test_a_prompt_of_three_blocks_after_a_stage_to_stage_transfer_equals_a_fresh_stage(tmp_path: Path) -> None:
    """A transformers stage on checkpoint B shares its weights (ShareWeights, CUDA IPC) with a
    vllm stage on A (Engine.transfer_weights): the vllm stage drops its prefix blocks before it
    ACKs the update, and serves the prompt as a fresh stage on B does."""
    from omni_core.engine import Engine, StageSpec

    a, b, on_b = _two_checkpoints_and_a_fresh_stage_on_b(tmp_path)
    trainer = StageSpec(
        "trainer",
        runner="transformers",
        backend="portable",
        device="cuda",
        runner_args={"model": str(b), "dtype": "bfloat16", "max_seq_len": 128, "max_batch": 1},
        deadline_s=300.0,
        start_deadline_s=600.0,
        request_timeout_s=300.0,
    )
    with Engine([_spec(a), trainer]) as engine:
        on_a = _tokens(engine)
        assert _tokens(engine) == on_a and on_a != on_b  # cached blocks served; checkpoints differ
        report = engine.transfer_weights("trainer", "llm", version=1)
        assert report.ranks[0].caches_dropped == ("prefix_kv",)
        assert _tokens(engine) == on_b
