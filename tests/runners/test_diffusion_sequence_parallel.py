"""A sequence-parallel DiT (`parallel="ulysses"` and `"ring"`): two rank processes over gloo on
CPU, each running every transformer block over half of each image's tokens; the image equals
one process's within a stated tolerance, and each rank sleeps, wakes, reloads and batches."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from omni_core.runners.diffusers_runner import DiffusersRunner
from omni_core.runners.diffusion_parallel import check_sequence_split
from omni_core.runners.diffusion_trajectory import from_wire

from ._ranks import WORLD, run_ranks
from .conftest import CPU, Pools
from .test_diffusers_runner import DIT, DPM_SOLVER

TAGS = ("weights", "kv_cache", "requests")
REQUEST = {**DIT, "trajectory": True}
# Ulysses computes each head's attention whole, from projections of fewer rows: the same bits
# (measured: 0 difference). Ring merges the attention over each part of the keys by its
# log-sum-exp, another summation order: the last latents within 1e-5 of their largest
# magnitude (measured 3.6e-7, 8 steps, the tiny DiT).
RELATIVE_TOLERANCE = {"ulysses": 0.0, "ring": 1e-5}
TOKENS = 16  # the tiny DiT: 8x8 latents in 2x2 patches


def wire_latents(out: dict[str, Any]) -> dict[str, Any]:
    return out["trajectory"]["latents"][-1]


def _rank(rank: int, args: tuple[str, dict[str, str]]) -> dict[str, Any]:
    mode, models = args
    runner = DiffusersRunner(CPU, model=models["dit"], parallel=mode, scheduler=DPM_SOLVER, init_timeout_s=60)
    pools = Pools(runner, TAGS)
    tokens: list[int] = []
    runner.modules["transformer"].transformer_blocks[0].register_forward_pre_hook(
        lambda _m, args: tokens.append(int(args[0].shape[1]))
    )
    seen: dict[str, Any] = {"image": wire_latents(runner.execute(REQUEST)), "tokens": sorted(set(tokens))}
    ids = [runner.execute({"op": "start", **DIT, "seed": s})["request_id"] for s in (1, 2)]
    steps = [{"op": "step", "request_id": i, "steps": 3} for i in ids]
    # The ranks hold different batches of the same requests: rank 0 both, rank 1 one at a time.
    progress = runner.execute_batch(steps) if rank == 0 else [runner.execute_batch([s])[0] for s in steps]
    seen["progress"] = [p["steps_done"] for p in progress]
    pools.sleep(1)
    seen["asleep_bytes"] = pools.backend.usage()["weights"]
    pools.wake()
    finished = runner.execute_batch([{"op": "finish", "request_id": i} for i in ids])
    seen["finished"] = [out["sha256"] for out in finished]
    seen["whole"] = [runner.execute({**DIT, "seed": s})["sha256"] for s in (1, 2)]
    pools.sleep(2)
    pools.wake()
    pools.reload(models["dit-seed1"])
    seen["other"] = wire_latents(runner.execute(REQUEST))
    runner.close()
    return seen


@pytest.fixture(scope="module", params=["ulysses", "ring"])
def ranks(request, checkpoints) -> tuple[str, dict[int, dict[str, Any]]]:
    models = {name: str(checkpoints[name]) for name in ("dit", "dit-seed1")}
    results = run_ranks(_rank, (request.param, models))
    for seen in results.values():
        for key in ("image", "other"):
            seen[key] = from_wire(seen[key])
    return request.param, results


def one_process(directory) -> DiffusersRunner:
    return Pools(DiffusersRunner(CPU, model=str(directory), scheduler=DPM_SOLVER), TAGS).runner


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def test_each_rank_runs_the_blocks_over_half_the_tokens_and_the_image_equals_one_process(ranks, checkpoints):
    mode, results = ranks
    alone = from_wire(wire_latents(one_process(checkpoints["dit"]).execute(REQUEST)))
    for seen in results.values():
        assert seen["tokens"] == [TOKENS // WORLD]  # not a replica: half the sequence per rank
        difference = relative(seen["image"], alone)
        print(f"{mode}: last latents within {difference:.2e} of one process's")
        assert difference <= RELATIVE_TOLERANCE[mode]
    assert torch.equal(results[0]["image"], results[1]["image"])  # the ranks agree bit for bit


def test_each_rank_batches_sleeps_wakes_and_reloads(ranks, checkpoints):
    mode, results = ranks
    other = from_wire(wire_latents(one_process(checkpoints["dit-seed1"]).execute(REQUEST)))
    for seen in results.values():
        assert seen["progress"] == [3, 3]
        assert seen["asleep_bytes"] == 0
        assert seen["finished"] == seen["whole"]  # batched, across a level-1 sleep, bit for bit
        assert relative(seen["other"], other) <= RELATIVE_TOLERANCE[mode]


def test_a_split_that_cuts_a_head_or_a_token_is_refused(checkpoints, monkeypatch):
    transformer = one_process(checkpoints["dit"]).modules["transformer"]
    with pytest.raises(ValueError, match="gives each rank heads / ranks of the DiT's 2 attention heads"):
        check_sequence_split(transformer, 4, "ulysses")
    with pytest.raises(ValueError, match="splits the DiT's 16 tokens"):
        check_sequence_split(transformer, 3, "ring")
    check_sequence_split(transformer, 4, "ring")  # a head need not split in a ring
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="parallel='ring' splits a DiT's blocks"):
        DiffusersRunner(CPU, model=str(checkpoints["ddpm"]), parallel="ring")
    with pytest.raises(ValueError, match="step_cache_threshold and parallel='ulysses' do not combine"):
        DiffusersRunner(CPU, model=str(checkpoints["dit"]), parallel="ulysses", step_cache_threshold=0.1)
