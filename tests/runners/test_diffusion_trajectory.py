"""The diffusers runner's RL outputs ("trajectory": true): every step's latents, the
timesteps, each step's log-probability under the sampler, the prompt embeddings; the image
rebuilt from the last latents, the log-probabilities checked against the noise the request's
own generator drew, and the record kept across a level-1 sleep between step-wise ops."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from omni_core.runners.diffusion_trajectory import MAX_TRAJECTORY_BYTES, from_wire
from omni_core.runners.synthetic import tensor_bytes

from .test_diffusers_runner import DDPM, DIT, DPM_SOLVER, SD, runner_in_pools


def _image_sha(runner, latents: torch.Tensor) -> str:
    """The runner's image of these final latents, by the pipelines' own decode."""
    with torch.no_grad():
        vae = runner.modules.get("vae")
        if runner.kind == "ddpm":
            sample = latents
        elif runner.kind == "dit":  # each pipeline scales as it does (1/s * x is not x / s in floats)
            sample = vae.decode(1 / vae.config.scaling_factor * latents).sample
        else:
            sample = vae.decode(latents / vae.config.scaling_factor).sample
    return hashlib.sha256(tensor_bytes((sample / 2 + 0.5).clamp(0, 1))).hexdigest()


@pytest.mark.parametrize(("family", "scheduler", "request_"), [("dit", DPM_SOLVER, DIT), ("ddpm", None, DDPM)])
def test_the_image_is_rebuilt_from_the_last_latents(family, scheduler, request_, checkpoints) -> None:
    runner = runner_in_pools(checkpoints[family], scheduler=scheduler).runner
    plain = runner.execute(dict(request_))
    out = runner.execute({**request_, "trajectory": True})
    assert out["sha256"] == plain["sha256"]  # recording changes nothing of the image
    trajectory = out["trajectory"]
    steps = request_["steps"]
    assert len(trajectory["latents"]) == steps + 1 and len(trajectory["log_probs"]) == steps
    reference = type(runner.pipeline.scheduler).from_config(runner.pipeline.scheduler.config)
    reference.set_timesteps(steps)
    assert trajectory["timesteps"] == [int(t) for t in reference.timesteps]
    latents = [from_wire(latent) for latent in trajectory["latents"]]
    assert latents[0].shape == (1, *runner.sample_shape)  # the conditional half under guidance
    assert _image_sha(runner, latents[-1]) == out["sha256"]


def test_a_deterministic_sampler_has_no_log_probabilities_and_says_why(checkpoints) -> None:
    runner = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER).runner
    trajectory = runner.execute({**DIT, "trajectory": True})["trajectory"]
    assert trajectory["log_probs"] == [None] * DIT["steps"]
    assert trajectory["log_prob_method"].startswith("none: DPMSolverMultistepScheduler steps deterministically")


def test_ddpm_log_probabilities_are_those_of_the_noise_the_request_drew(checkpoints) -> None:
    """Replay the request's generator: the initial latents, then one draw per step but the
    last. A step's log-probability is log N(z; 0, 1) less log std per element, where z is that
    draw; a wrong posterior mean or std would give another figure."""
    from diffusers.utils.torch_utils import randn_tensor

    runner = runner_in_pools(checkpoints["ddpm"]).runner
    out = runner.execute({**DDPM, "trajectory": True})["trajectory"]
    assert out["log_prob_method"] == "ddpm"
    generator = torch.Generator("cpu").manual_seed(DDPM["seed"])
    shape = (1, *runner.sample_shape)
    assert torch.equal(randn_tensor(shape, generator=generator), from_wire(out["latents"][0]))
    scheduler = type(runner.pipeline.scheduler).from_config(runner.pipeline.scheduler.config)
    scheduler.set_timesteps(DDPM["steps"])
    for t, log_prob in zip(out["timesteps"], out["log_probs"], strict=True):
        if t == 0:
            assert log_prob is None  # the last step adds no noise
            continue
        z = randn_tensor(shape, generator=generator).double()
        std = scheduler._get_variance(t).double() ** 0.5
        expected = float(-0.5 * (z**2).sum() - z.numel() * (math.log(std) + 0.5 * math.log(2 * math.pi)))
        assert log_prob == pytest.approx(expected, rel=1e-4, abs=1e-3)


def test_stable_diffusion_returns_its_prompt_embeddings(checkpoints) -> None:
    runner = runner_in_pools(checkpoints["sd"], scheduler=DPM_SOLVER, tags=("weights", "requests")).runner
    out = runner.execute({**SD, "trajectory": True})
    embeds = from_wire(out["trajectory"]["prompt_embeds"])
    positive, negative = runner.pipeline.encode_prompt(SD["prompt"], runner.device, 1, True, SD["negative_prompt"])
    assert torch.equal(embeds, torch.cat([negative, positive]))
    assert _image_sha(runner, from_wire(out["trajectory"]["latents"][-1])) == out["sha256"]


def test_a_stepwise_trajectory_survives_a_level1_sleep_and_equals_the_one_call_one(checkpoints) -> None:
    pools = runner_in_pools(checkpoints["ddpm"])
    runner = pools.runner
    whole = runner.execute({**DDPM, "trajectory": True})["trajectory"]
    started = runner.execute({"op": "start", **DDPM, "trajectory": True})
    runner.execute({"op": "step", "request_id": started["request_id"], "steps": 3})
    pools.sleep(1)
    pools.wake()
    stepped = runner.execute({"op": "finish", "request_id": started["request_id"]})["trajectory"]
    assert stepped == whole


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({**DDPM, "trajectory": "yes"}, "trajectory must be true or false"),
        ({"seed": 1, "steps": 1000, "trajectory": True}, "over its bound"),
    ],
)
def test_bad_trajectory_requests_say_what_is_wrong(payload, message, checkpoints, monkeypatch) -> None:
    from omni_core.runners import diffusers_runner

    monkeypatch.setattr(diffusers_runner, "MAX_TRAJECTORY_BYTES", 64 << 10)  # a tiny model's 1000 steps exceed it
    assert MAX_TRAJECTORY_BYTES > 64 << 10
    runner = runner_in_pools(checkpoints["ddpm"]).runner
    with pytest.raises(ValueError, match=message):
        runner.execute(payload)
    assert runner.requests == {}


def test_a_trajectory_through_the_engine_names_the_weights_that_produced_it(checkpoints) -> None:
    """What a trainer gets back: the record and (with_version) the weights version the request
    ran on, and the adapter's (None and 0: none), so an RL step can drop off-policy samples."""
    from omni_core import Engine, StageSpec

    spec = StageSpec(
        "ddpm",
        runner="diffusers",
        backend="portable",
        tags=("weights", "kv_cache", "requests"),
        runner_args={"model": str(checkpoints["ddpm"]), "max_requests": 2, "cpu_threads": 1},
        deadline_s=60.0,
        start_deadline_s=240.0,
        request_timeout_s=120.0,
    )
    engine = Engine([spec])
    try:
        first = engine.execute("ddpm", {**DDPM, "trajectory": True}, with_version=True)
        engine.update_weights("ddpm", str(checkpoints["ddpm"]), version=3)
        after = engine.execute("ddpm", {**DDPM, "trajectory": True}, with_version=True)
    finally:
        engine.shutdown()
    assert (first.weights_version, first.adapter, first.adapter_version) == (0, None, 0)
    assert after.weights_version == 3
    runner = runner_in_pools(checkpoints["ddpm"]).runner
    for answer in (first, after):
        assert _image_sha(runner, from_wire(answer.output["trajectory"]["latents"][-1])) == answer.output["sha256"]
