"""The per-rank floor after a sleep, a vLLM stage of one rank with its CUDA graphs (issue 42
item 4): with the tags `cuda_graph` and `comm` the sleep releases vLLM's graph pool (offloaded,
`sleep_mode_offload_cudagraph`) and suspends its communicators, so the rank's own memory after
a level-1 sleep is at most FLOOR_BYTES; the captured graphs replay after the wake to the same
greedy tokens. Needs CUDA and a vLLM with those opt-ins (0.34; the device's 0.26 bundle lacks
them, and the stage then refuses to start, naming them: the test skips).

    source .device/setup.sh && python3 -m pytest -m gpu tests/runners/test_vllm_floor_gpu.py
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu
GiB = 1 << 30
FLOOR_BYTES = int(0.3 * GiB)  # the target for a vLLM stage, TP=1, graph pools released
REQUEST = {"prompt_ids": [5, 6, 7, 8, 9, 10, 11], "max_new_tokens": 16, "stop_at_eos": False}


def _vllm_with_opt_ins() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    from vllm.engine.arg_utils import EngineArgs

    names = {f.name for f in dataclasses.fields(EngineArgs)}
    missing = {"sleep_mode_offload_cudagraph", "enable_nccl_comm_suspend"} - names
    if missing:
        pytest.skip(f"this vLLM has no {sorted(missing)} (vLLM >= 0.34)")


def test_the_floor_after_sleep_with_graph_pools_released(tmp_path) -> None:
    _vllm_with_opt_ins()
    from benchmarks.vllm_stage import make_models
    from omni_core.engine import Engine, StageSpec

    model = make_models(tmp_path / "models", "tiny")["main"]
    spec = StageSpec(
        "llm",
        runner="vllm",
        backend="cumem",
        device="cuda",
        gpu_memory_fraction=0.3,
        tags=("weights", "kv_cache", "cuda_graph", "comm"),
        runner_args={"model": str(model), "max_model_len": 256, "max_num_seqs": 4, "enforce_eager": False},
        deadline_s=300.0,
        start_deadline_s=600.0,
    )
    with Engine([spec]) as engine:
        reference = engine.execute("llm", REQUEST)["token_ids"]
        slept = engine.sleep("llm", 1)
        rank = slept.ranks[0]
        assert rank.pool_bytes_after.get("cuda_graph", 0) == 0, rank.pool_bytes_after
        assert rank.process_bytes_after is not None and rank.process_bytes_after <= FLOOR_BYTES, (
            rank.process_bytes_after,
            rank.process_bytes_source,
        )
        engine.wake("llm")
        assert engine.execute("llm", REQUEST)["token_ids"] == reference  # the graphs replay after the wake
