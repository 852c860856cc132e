"""Step-wise requests batched on a CFG-parallel stage: two rank processes over gloo holding
different batches of the same requests step, in one denoiser call per step, the groups both
hold; a batch survives a level-1 sleep of both ranks bit for bit, and a request one rank
cannot step fails on both while the rest of the batch goes on."""

from __future__ import annotations

from typing import Any

import pytest

from omni_core.runners.diffusers_runner import DiffusersRunner
from omni_core.runners.diffusion_trajectory import from_wire

from ._ranks import run_ranks
from .conftest import CPU, Pools
from .test_diffusers_runner import DIT, DPM_SOLVER
from .test_diffusion_batch import count_calls
from .test_diffusion_cfg_parallel import RELATIVE_TOLERANCE

TAGS = ("weights", "kv_cache", "requests")
SEEDS = (0, 1, 2)


def _steps(ids: list[str], counts: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"op": "step", "request_id": i, "steps": n} for i, n in zip(ids, counts, strict=True)]


def _stepped(runner: DiffusersRunner, pools: Pools, rank: int, requests: list[dict], sleep: bool) -> dict[str, Any]:
    """The three requests started, stepped in the ranks' own batches, finished in one."""
    ids = [runner.execute({"op": "start", **r, "trajectory": True})["request_id"] for r in requests]
    rows = count_calls(runner.modules["transformer"])
    steps = _steps(ids, (2, 3, 1))
    # Rank 0 holds all three at once; rank 1 the first, then the other two.
    batches = [steps] if rank == 0 else [steps[:1], steps[1:]]
    seen: dict[str, Any] = {"progress": [p["steps_done"] for batch in batches for p in runner.execute_batch(batch)]}
    seen["rows"] = list(rows)
    if sleep:
        pools.sleep(1)
        pools.wake()
    del rows[:]
    finished = runner.execute_batch([{"op": "finish", "request_id": i} for i in ids])
    seen["finished"] = [out["sha256"] for out in finished]
    seen["latents"] = [out["trajectory"]["latents"][-1] for out in finished]
    seen["finish_rows"] = list(rows)
    runner.modules["transformer"]._forward_pre_hooks.clear()
    return seen


def _rank(rank: int, model: str) -> dict[str, Any]:
    runner = DiffusersRunner(CPU, model=model, scheduler=DPM_SOLVER, max_requests=4, init_timeout_s=60)
    pools = Pools(runner, TAGS)
    requests = [{**DIT, "seed": s, "steps": 6 + s} for s in SEEDS]
    alone = [runner.execute({**r, "trajectory": True}) for r in requests]
    seen: dict[str, Any] = {"alone": [out["sha256"] for out in alone]}
    seen["alone_latents"] = [out["trajectory"]["latents"][-1] for out in alone]
    seen["awake"] = _stepped(runner, pools, rank, requests, sleep=False)
    seen["slept"] = _stepped(runner, pools, rank, requests, sleep=True)
    seen["diverged"] = repr(runner.execute_batch([{"op": "cancel", "request_id": f"only-on-{rank}"}])[0])
    ids = [runner.execute({"op": "start", **r})["request_id"] for r in requests[:2]]
    if rank == 1:
        runner._lose(ids[0], "lost on this rank alone, as a failed restore would")
    outs = runner.execute_batch([{"op": "finish", "request_id": i} for i in ids])
    seen["one_lost"] = [out["sha256"] if isinstance(out, dict) else repr(out) for out in outs]
    seen["lost_here"] = sorted(runner.lost)
    runner.close()
    return seen


@pytest.fixture(scope="module")
def ranks(checkpoints) -> dict[int, dict[str, Any]]:
    return run_ranks(_rank, str(checkpoints["dit"]))


def test_the_ranks_step_together_what_both_hold(ranks):
    for seen in ranks.values():
        assert seen["awake"]["progress"] == [2, 3, 1]
        # Each rank runs one guidance half of each request: one row a request. The group both
        # hold first is the first request alone (2 steps), then the other two together.
        assert seen["awake"]["rows"] == [1, 1, 2, 1, 1]
        assert seen["awake"]["finish_rows"] == [3, 3, 3, 3, 1, 1, 1]  # remaining 4, 4 and 7 steps


def test_a_batch_on_a_cfg_parallel_stage_survives_a_level1_sleep_bit_for_bit(ranks):
    for seen in ranks.values():
        assert seen["slept"]["finished"] == seen["awake"]["finished"]
        # A linear layer over one row rounds apart from over several (1 ulp), so a request's
        # half computed in a batch is its half alone within the CFG-parallel tolerance.
        for batched, alone in zip(seen["awake"]["latents"], seen["alone_latents"], strict=True):
            got, expected = from_wire(batched), from_wire(alone)
            assert float((got - expected).abs().max() / expected.abs().max()) <= RELATIVE_TOLERANCE
    assert ranks[0]["slept"]["finished"] == ranks[1]["slept"]["finished"]


def test_ranks_that_disagree_fail_the_request_on_each_and_serve_on(ranks):
    for rank, seen in ranks.items():
        assert "received different requests" in seen["diverged"]
        # The request rank 1 lost is lost on rank 0 too; the other one finishes on both.
        assert "another rank of the stage could not step it" in seen["one_lost"][0] or rank == 1
        assert seen["one_lost"][1] == seen["alone"][1]  # finished in a batch of one: its own bits
    assert ranks[0]["one_lost"][1] == ranks[1]["one_lost"][1]
