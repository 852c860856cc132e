"""The DiT step cache (TeaCache's method) in the diffusers runner: off, nothing changes; at
threshold 0 the cached forward is the transformer's own, bit for bit; above it, steps are
skipped, counted and the image stays close (PSNR); a step-wise request with a cache survives
a level-1 sleep bit for bit; a weight update never lets an old residual through."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from PIL import Image

from omni_core.runners.diffusers_runner import DiffusersRunner, RequestLostError
from omni_core.runners.step_cache import check_threshold

from .test_diffusers_runner import DIT, DPM_SOLVER, runner_in_pools

STEPS = 20
REQUEST = {**DIT, "steps": STEPS}


def pixels(result: dict) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(result["png"])), dtype=np.float64) / 255.0


def psnr(result: dict, reference: dict) -> float:
    """Of the 8-bit images, as image-quality figures are given."""
    mse = float(((pixels(result) - pixels(reference)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


@pytest.fixture(scope="module")
def plain(checkpoints):
    return runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER)


def test_threshold_zero_runs_every_block_and_equals_the_transformers_own_forward(plain, checkpoints) -> None:
    cached = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, step_cache_threshold=0.0)
    assert cached.runner.execute(dict(REQUEST))["sha256"] == plain.runner.execute(dict(REQUEST))["sha256"]
    assert cached.runner.counters() == {
        "step_cache_hits": 0,
        "step_cache_misses": STEPS,
        "step_cache_dropped": 0,
        "denoiser_calls": STEPS,
        "denoiser_rows": 2 * STEPS,  # guided: both halves in each call
    }
    assert "step_cache_hits" not in plain.runner.counters()  # no cache, no counters


def test_a_threshold_skips_steps_and_keeps_the_image_close(plain, checkpoints) -> None:
    cached = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, step_cache_threshold=0.2)
    reference = plain.runner.execute(dict(REQUEST))
    out = cached.runner.execute(dict(REQUEST))
    hits, misses = cached.runner.counters()["step_cache_hits"], cached.runner.counters()["step_cache_misses"]
    assert hits + misses == STEPS and hits > 0 and misses >= 2  # first and last always computed
    assert out["sha256"] != reference["sha256"]  # steps were really skipped
    value = psnr(out, reference)
    print(f"threshold 0.2: {hits} of {STEPS} steps skipped, PSNR {value:.1f} dB")
    assert value > 20.0


def test_a_stepwise_request_with_its_cache_survives_a_level1_sleep_bit_for_bit(checkpoints) -> None:
    pools = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, step_cache_threshold=0.2)
    runner = pools.runner
    whole = runner.execute(dict(REQUEST))["sha256"]
    started = runner.execute({"op": "start", **REQUEST})
    runner.execute({"op": "step", "request_id": started["request_id"], "steps": 7})
    request = runner.requests[started["request_id"]]
    parked = {p.attribute for p in request.parked}
    assert {"step_cache.previous", "step_cache.residual"} <= parked
    assert request.step_cache.residual is None  # between ops it lives in the slot only
    pools.sleep(1)
    pools.wake()
    assert runner.execute({"op": "finish", "request_id": started["request_id"]})["sha256"] == whole


def test_a_weight_update_voids_the_requests_and_their_residuals(checkpoints) -> None:
    pools = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, step_cache_threshold=0.2)
    runner = pools.runner
    started = runner.execute({"op": "start", **REQUEST})
    runner.execute({"op": "step", "request_id": started["request_id"], "steps": 5})
    named = [(name, tensor * 1.01) for name, tensor in runner.weights_to_share().items()]
    runner.update_weights(named)
    with pytest.raises(RequestLostError, match="weights were reloaded while it was in flight"):
        runner.execute({"op": "finish", "request_id": started["request_id"]})


@pytest.mark.parametrize("bad", [-0.1, 11, "0.1", True])
def test_bad_thresholds_are_refused_naming_the_argument(bad) -> None:
    with pytest.raises(ValueError, match="step_cache_threshold must be a number"):
        check_threshold(bad)


def test_the_cache_is_for_dit_pipelines(checkpoints) -> None:
    with pytest.raises(ValueError, match="step_cache_threshold applies to DiT pipelines"):
        DiffusersRunner(torch.device("cpu"), model=str(checkpoints["ddpm"]), step_cache_threshold=0.1)


def test_the_cache_with_layerwise_offload_streams_only_the_steps_it_computes(checkpoints) -> None:
    """Block 0's first norm (what the cache reads before deciding) stays resident; a skipped
    step streams no block, and the image is the cache's own without offload, bit for bit."""
    from omni_core.runners.block_offload import OFFLOAD_TAG

    alone = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, step_cache_threshold=0.2).runner
    pools = runner_in_pools(
        checkpoints["dit"],
        tags=("weights", OFFLOAD_TAG, "kv_cache", "requests"),
        scheduler=DPM_SOLVER,
        step_cache_threshold=0.2,
        offload="layerwise",
    )
    runner = pools.runner
    norm1 = runner.modules["transformer"].transformer_blocks[0].norm1
    resident = {id(t) for t in runner.tensors("weights")}
    assert all(id(t) in resident for t in [*norm1.parameters(), *norm1.buffers()])
    assert runner.execute(dict(REQUEST))["sha256"] == alone.execute(dict(REQUEST))["sha256"]
    counters = runner.counters()
    assert counters["step_cache_hits"] > 0
    blocks = len(runner.offload.blocks)
    assert runner.offload.block_loads == counters["step_cache_misses"] * blocks
    pools.sleep(1)
    pools.wake()
    assert runner.execute(dict(REQUEST))["sha256"] == alone.execute(dict(REQUEST))["sha256"]


OWN_TAGS = ("weights", "kv_cache", "step_cache", "requests")


def test_in_its_own_pool_the_cache_is_given_back_at_sleep_and_dropped_not_served(checkpoints) -> None:
    """With the tag `step_cache` the cache's tensors leave the request's slot for a pool of
    their own; a level-1 sleep discards it (no host copy), and the step after the wake runs the
    blocks instead of adding a residual that is gone."""
    pools = runner_in_pools(checkpoints["dit"], tags=OWN_TAGS, scheduler=DPM_SOLVER, step_cache_threshold=0.2)
    runner = pools.runner
    parked_with_request = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER, step_cache_threshold=0.2)
    assert runner.slot_bytes < parked_with_request.runner.slot_bytes  # the request slots no longer hold it
    whole = runner.execute(dict(REQUEST))
    started = runner.execute({"op": "start", **REQUEST})["request_id"]
    runner.execute({"op": "step", "request_id": started, "steps": 7})
    request = runner.requests[started]
    assert not any(p.attribute.startswith("step_cache.") for p in request.parked)
    assert runner.step_cache_pool.layout[request.slot]  # parked in its own pool
    assert pools.backend.usage()["step_cache"] > 0
    pools.sleep(1)
    assert pools.backend.usage()["step_cache"] == 0  # given back while asleep, no host copy kept
    pools.wake()
    misses = runner.counters()["step_cache_misses"]
    runner.execute({"op": "step", "request_id": started, "steps": 1})
    assert runner.counters()["step_cache_dropped"] == 1
    assert runner.counters()["step_cache_misses"] == misses + 1  # the blocks ran: nothing to reuse
    out = runner.execute({"op": "finish", "request_id": started})
    assert psnr(out, whole) > 20.0


def test_a_residual_parked_under_other_weights_is_dropped(checkpoints) -> None:
    """The pool's key is the weights generation: whatever keeps a request across a change of
    weights, its residual is never added under the new ones."""
    runner = runner_in_pools(checkpoints["dit"], tags=OWN_TAGS, scheduler=DPM_SOLVER, step_cache_threshold=0.2).runner
    started = runner.execute({"op": "start", **REQUEST})["request_id"]
    runner.execute({"op": "step", "request_id": started, "steps": 5})
    request = runner.requests[started]
    state = request.step_cache
    runner.step_cache_pool.unpark(request.slot, request.canary, runner.generation + 1, state)
    assert state.residual is None and state.previous is None
    assert runner.step_cache_pool.dropped == 1


def test_the_step_cache_tag_needs_a_step_cache(checkpoints) -> None:
    with pytest.raises(ValueError, match="the tag 'step_cache' holds a step cache"):
        runner_in_pools(checkpoints["dit"], tags=OWN_TAGS)


def test_through_a_rank_the_cache_counts_in_status_and_its_pool_sleeps(checkpoints) -> None:
    """A rank process: the Hello declares the cache's counters, status shows them (metrics
    export the same runner_counters: tests/runners/test_runner_counters.py), and the stage's
    `step_cache` pool holds bytes awake and none asleep."""
    from omni_core import Engine, StageSpec

    spec = StageSpec(
        "dit",
        runner="diffusers",
        backend="portable",
        tags=("weights", "kv_cache", "requests", "step_cache"),
        runner_args={
            "model": str(checkpoints["dit"]),
            "scheduler": DPM_SOLVER,
            "step_cache_threshold": 0.2,
            "max_requests": 2,
            "cpu_threads": 1,
        },
        deadline_s=60.0,
        start_deadline_s=240.0,
        request_timeout_s=120.0,
    )
    engine = Engine([spec])
    try:
        fresh = engine.status()["dit"]["ranks"][0]["runner_counters"]
        started = engine.execute("dit", {"op": "start", **REQUEST})["request_id"]
        engine.execute("dit", {"op": "step", "request_id": started, "steps": 7})
        engine.sleep("dit", 1)
        engine.wake("dit")
        engine.execute("dit", {"op": "finish", "request_id": started})
        counters = engine.status()["dit"]["ranks"][0]["runner_counters"]
    finally:
        engine.shutdown()
    assert fresh["step_cache_hits"] == fresh["step_cache_misses"] == fresh["step_cache_dropped"] == 0
    assert counters["step_cache_hits"] > 0 and counters["step_cache_dropped"] == 1
    assert counters["step_cache_hits"] + counters["step_cache_misses"] == STEPS
