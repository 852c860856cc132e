"""A tensor-parallel DiT (`parallel="tensor"`): two rank processes over gloo on CPU, each holding
its shard of every block's attention and MLP; the image equals one process's within a stated
tolerance, and each rank's shard survives sleeps, a reload and a weight update."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from omni_core.runners.diffusers_runner import DiffusersRunner
from omni_core.runners.diffusion_trajectory import from_wire

from ._ranks import run_ranks
from .conftest import CPU, Pools
from .test_diffusers_runner import DIT, DPM_SOLVER

TAGS = ("weights", "kv_cache", "requests")
REQUEST = {**DIT, "trajectory": True}
# The all-reduces sum the shards' partial products in another order than one matmul does:
# measured 3.5e-7 of the last latents' largest magnitude (8 steps, the tiny DiT).
RELATIVE_TOLERANCE = 1e-5
SHARDED = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "ff.net.0.proj", "ff.net.2")


def last_latents(out: dict[str, Any]) -> torch.Tensor:
    return from_wire(out["trajectory"]["latents"][-1])


def wire_latents(out: dict[str, Any]) -> dict[str, Any]:
    return out["trajectory"]["latents"][-1]  # bytes: a tensor in a queue would outlive its process


def sharded_elements(runner: DiffusersRunner) -> int:
    """The elements of the sharded linear weights this process holds."""
    blocks = runner.modules["transformer"].transformer_blocks
    return sum(
        getattr(block.get_submodule(name).weight, "_local_tensor", block.get_submodule(name).weight).numel()
        for block in blocks
        for name in SHARDED
    )


def _rank(rank: int, models: dict[str, str]) -> dict[str, Any]:
    """One rank of the stage: what it computes and holds through the lifecycle."""
    pools = Pools(
        DiffusersRunner(CPU, model=models["dit"], parallel="tensor", scheduler=DPM_SOLVER, init_timeout_s=60),
        TAGS,
    )
    runner = pools.runner
    seen: dict[str, Any] = {"sharded": sharded_elements(runner), "image": wire_latents(runner.execute(REQUEST))}
    started = runner.execute({"op": "start", **DIT})["request_id"]
    runner.execute({"op": "step", "request_id": started, "steps": 3})
    pools.sleep(1)
    seen["asleep_bytes"] = pools.backend.usage()["weights"]
    pools.wake()
    seen["finished"] = runner.execute({"op": "finish", "request_id": started})["sha256"]
    seen["whole"] = runner.execute(dict(DIT))["sha256"]
    pools.sleep(2)
    pools.wake()
    pools.reload(models["dit-seed1"])  # each rank cuts its shard from the other checkpoint
    seen["other"] = wire_latents(runner.execute(REQUEST))
    from safetensors.torch import load_file

    full = load_file(os.path.join(models["dit"], "transformer", "diffusion_pytorch_model.safetensors"))
    runner.update_weights((f"transformer/{name}", tensor) for name, tensor in full.items())  # full tensors
    seen["updated"] = wire_latents(runner.execute(REQUEST))
    runner.close()
    return seen


@pytest.fixture(scope="module")
def ranks(checkpoints) -> dict[int, dict[str, Any]]:
    results = run_ranks(_rank, {name: str(checkpoints[name]) for name in ("dit", "dit-seed1")})
    for seen in results.values():
        for key in ("image", "other", "updated"):
            seen[key] = from_wire(seen[key])
    return results


def one_process(directory) -> DiffusersRunner:
    return Pools(DiffusersRunner(CPU, model=str(directory), scheduler=DPM_SOLVER), TAGS).runner


def within(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return float((got - expected).abs().max() / expected.abs().max()) <= RELATIVE_TOLERANCE


def test_each_rank_holds_half_the_blocks_and_the_image_equals_one_process(ranks, checkpoints):
    alone = one_process(checkpoints["dit"])
    for seen in ranks.values():
        assert 2 * seen["sharded"] == sharded_elements(alone)
        assert within(seen["image"], last_latents(alone.execute(REQUEST)))
    assert torch.equal(ranks[0]["image"], ranks[1]["image"])  # the ranks agree bit for bit


def test_each_shard_survives_sleeps_a_reload_and_an_update(ranks, checkpoints):
    other = last_latents(one_process(checkpoints["dit-seed1"]).execute(REQUEST))
    own = last_latents(one_process(checkpoints["dit"]).execute(REQUEST))
    for seen in ranks.values():
        assert seen["asleep_bytes"] == 0
        assert seen["finished"] == seen["whole"]  # a step-wise request across a level-1 sleep
        assert within(seen["other"], other) and within(seen["updated"], own)


def test_a_pipeline_without_a_dit_is_refused_tensor_parallel(checkpoints, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="parallel='tensor' splits a DiT's blocks"):
        DiffusersRunner(CPU, model=str(checkpoints["sd"]), parallel="tensor")
    with pytest.raises(ValueError, match="parallel must be one of"):
        DiffusersRunner(CPU, model=str(checkpoints["dit"]), parallel="sequence")
    with pytest.raises(ValueError, match="offload='layerwise' runs on a stage of one rank"):
        DiffusersRunner(CPU, model=str(checkpoints["dit"]), offload="layerwise")
