"""CFG-parallel diffusion: a stage of two ranks (gloo on CPU, the portable backend) splits each
guided step's conditional and unconditional passes, end to end through an Engine.

What makes it parallel and not two replicas: each rank's denoiser ran half the rows one rank
alone runs (its counters), and the image equals one process's. Then the lifecycle: a
step-wise request across a level-1 sleep of both ranks, a level-2 sleep and reload."""

from __future__ import annotations

import pytest

from omni_core import Engine, StageSpec
from omni_core.runners.diffusion_trajectory import from_wire

from .conftest import CPU, Pools
from .test_diffusers_runner import DIT, DPM_SOLVER, SD, DiffusersRunner

TAGS = ("weights", "kv_cache", "requests")
# A denoiser over one row rounds differently from over two (DiT's linear layers: by 1 ulp of
# its output; SD's convolutions), so the halves computed apart are not the same bits as
# together: the last latents stay within 1e-5 of their largest magnitude (measured: 4.2e-7
# for the DiT, 1.2e-6 for SD, 8 steps each).
RELATIVE_TOLERANCE = 1e-5


def _spec(name: str, model, **args) -> StageSpec:
    return StageSpec(
        name,
        runner="diffusers",
        ranks=2,
        backend="portable",
        tags=TAGS,
        runner_args={"model": str(model), "max_requests": 4, "cpu_threads": 1, **args},
        deadline_s=60.0,
        start_deadline_s=240.0,
        request_timeout_s=120.0,
    )


@pytest.fixture(scope="module")
def engine(checkpoints):
    engine = Engine([_spec("dit", checkpoints["dit"], scheduler=DPM_SOLVER), _spec("sd", checkpoints["sd"])])
    yield engine
    engine.shutdown()


def one_process(directory, **args) -> DiffusersRunner:
    return Pools(DiffusersRunner(CPU, model=str(directory), max_requests=4, **args), TAGS).runner


def relative_difference(alone: dict, split: dict) -> float:
    expected, got = (from_wire(out["trajectory"]["latents"][-1]) for out in (alone, split))
    return float((got - expected).abs().max() / expected.abs().max())


def rows(engine: Engine, stage: str) -> list[int]:
    return [engine.status()[stage]["ranks"][r]["runner_counters"]["denoiser_rows"] for r in (0, 1)]


def test_each_rank_runs_one_guidance_half_and_the_image_equals_one_process(engine, checkpoints):
    alone = one_process(checkpoints["dit"], scheduler=DPM_SOLVER)
    before = rows(engine, "dit")
    traced = {**DIT, "trajectory": True}
    assert relative_difference(alone.execute(traced), engine.execute("dit", traced)) <= RELATIVE_TOLERANCE
    after = rows(engine, "dit")
    # One process runs both halves of each of the 8 steps; each rank ran one.
    assert [a - b for a, b in zip(after, before, strict=True)] == [DIT["steps"]] * 2
    assert alone.counters()["denoiser_rows"] == 2 * DIT["steps"]
    unguided = {**DIT, "guidance_scale": 1.0}  # one half: both ranks compute it whole
    assert engine.execute("dit", unguided)["sha256"] == alone.execute(unguided)["sha256"]


def test_stable_diffusion_splits_its_text_halves_within_tolerance(engine, checkpoints):
    alone = one_process(checkpoints["sd"]).execute({**SD, "trajectory": True})
    split = engine.execute("sd", {**SD, "trajectory": True})
    assert relative_difference(alone, split) <= RELATIVE_TOLERANCE
    assert rows(engine, "sd") == [SD["steps"]] * 2


def test_a_stepwise_request_survives_each_ranks_sleep_and_a_reload(engine):
    whole = engine.execute("dit", dict(DIT))["sha256"]  # the stage's own image, uninterrupted
    started = engine.execute("dit", {"op": "start", **DIT})["request_id"]
    engine.execute("dit", {"op": "step", "request_id": started, "steps": 3})
    report = engine.sleep("dit", level=1)
    assert len(report.ranks) == 2 and all(r.pool_bytes_after["weights"] == 0 for r in report.ranks.values())
    engine.wake("dit")
    assert engine.execute("dit", {"op": "finish", "request_id": started})["sha256"] == whole
    engine.sleep("dit", level=2)
    assert engine.wake("dit").state == "NEEDS_RELOAD"
    assert engine.reload_weights("dit").state == "RUNNING"
    assert engine.execute("dit", dict(DIT))["sha256"] == whole


@pytest.mark.parametrize(("world", "family", "why"), [("3", "dit", "a stage of 3 ranks"), ("2", "ddpm", "DDPM has")])
def test_a_stage_the_runner_cannot_split_is_refused_not_replicated(world, family, why, checkpoints, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=f"splits a stage's work CFG-parallel.*{why}"):
        DiffusersRunner(CPU, model=str(checkpoints[family]))
