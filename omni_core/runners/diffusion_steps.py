"""One denoising step of each pipeline, as the pipeline's own loop body, and the state a
step-wise request carries between two ops.

Each `*_call` repeats the body of its pipeline's `__call__` loop with the same operations in
the same order (the diffusers runner's tests compare the output with `pipeline(...)` bit for
bit), cut at the denoiser's call so a request can stop between any two steps and several
requests' steps can share one call (`run_together`). What a request keeps between ops is in
`DiffusionRequest`; `state_tensors` names its latent-shaped tensors, which the runner parks in
its `requests` slab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# Called after each scheduler step with (timestep, the sample the step got, the step's output):
# how a trajectory (omni_core/runners/diffusion_trajectory.py) sees every step.
StepObserver = Callable[[Any, torch.Tensor, Any], None]


@dataclass
class Parked:
    """Where one state tensor waits in its slot between two ops."""

    attribute: str  # "sample", or the scheduler attribute holding it
    index: int | None  # position in a list attribute (DPM-Solver's model_outputs), else None
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class DiffusionRequest:
    request_id: str
    class_label: int | None
    seed: int
    steps_total: int
    guidance_scale: float
    scheduler: Any  # one instance per request: multistep schedulers keep history
    generator: torch.Generator  # on CPU, as diffusers' examples: host state, survives sleeps
    steps_done: int = 0
    slot: int | None = None
    canary: int = 0
    generation: int = 0
    parked: list[Parked] = field(default_factory=list)
    prompt: str | None = None
    embeddings: torch.Tensor | None = None  # text conditioning (unconditional half first), on the host
    step_cache: Any = None  # a DiT's StepCacheState (omni_core.runners.step_cache) when the stage has one
    trajectory: Any = None  # a Trajectory (omni_core.runners.diffusion_trajectory) when the request asked


@dataclass
class DenoiserCall:
    """One request's rows of a denoiser call, and how the call's output for those rows becomes
    the request's next sample (guidance, then the scheduler's step). Several requests' calls
    run as one forward pass (`run_together`): the rows are concatenated, the outputs split."""

    inputs: torch.Tensor
    timesteps: torch.Tensor  # 0-dim (every row's) or one per row
    condition: torch.Tensor | None  # DiT: class labels; Stable Diffusion: text embeddings; DDPM: none
    finish: Callable[[torch.Tensor], torch.Tensor]
    guided: bool = False  # its rows are two halves, conditional and unconditional (CFG)

    def row_timesteps(self) -> torch.Tensor:
        return self.timesteps.expand(len(self.inputs)) if self.timesteps.dim() == 0 else self.timesteps


def dit_call(
    transformer: Any,
    request: DiffusionRequest,
    sample: torch.Tensor,
    t: torch.Tensor,
    labels: torch.Tensor,
    observe: StepObserver | None = None,
) -> DenoiserCall:
    """DiTPipeline.__call__'s loop body, cut at the transformer's call."""
    scheduler = request.scheduler
    channels = transformer.config.in_channels
    guided = request.guidance_scale > 1
    if guided:
        half = sample[: len(sample) // 2]
        sample = torch.cat([half, half], dim=0)
    sample = scheduler.scale_model_input(sample, t)
    timesteps = t[None].to(sample.device) if t.dim() == 0 else t
    timesteps = timesteps.expand(sample.shape[0])

    def finish(noise_pred: torch.Tensor) -> torch.Tensor:
        if guided:
            eps, rest = noise_pred[:, :channels], noise_pred[:, channels:]
            cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
            half_eps = uncond_eps + request.guidance_scale * (cond_eps - uncond_eps)
            eps = torch.cat([half_eps, half_eps], dim=0)
            noise_pred = torch.cat([eps, rest], dim=1)
        if transformer.config.out_channels // 2 == channels:
            model_output, _ = torch.split(noise_pred, channels, dim=1)
        else:
            model_output = noise_pred
        return _observed(scheduler.step(model_output, t, sample), t, sample, observe)

    return DenoiserCall(sample, timesteps, labels, finish, guided)


def ddpm_call(
    unet: Any, request: DiffusionRequest, sample: torch.Tensor, t: torch.Tensor, observe: StepObserver | None = None
) -> DenoiserCall:
    """DDPMPipeline.__call__'s loop body, cut at the UNet's call."""

    def finish(model_output: torch.Tensor) -> torch.Tensor:
        step = request.scheduler.step(model_output, t, sample, generator=request.generator)
        return _observed(step, t, sample, observe)

    return DenoiserCall(sample, t, None, finish)


def sd_call(
    unet: Any,
    request: DiffusionRequest,
    latents: torch.Tensor,
    t: torch.Tensor,
    embeddings: torch.Tensor,
    step_kwargs: dict[str, Any],
    observe: StepObserver | None = None,
) -> DenoiserCall:
    """StableDiffusionPipeline.__call__'s loop body (no IP-adapter, no guidance rescale), cut
    at the UNet's call."""
    scheduler, guided = request.scheduler, request.guidance_scale > 1
    model_input = torch.cat([latents] * 2) if guided else latents
    model_input = scheduler.scale_model_input(model_input, t)

    def finish(noise_pred: torch.Tensor) -> torch.Tensor:
        if guided:
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            noise_pred = noise_pred_uncond + request.guidance_scale * (noise_pred_text - noise_pred_uncond)
        return _observed(scheduler.step(noise_pred, t, latents, **step_kwargs), t, latents, observe)

    return DenoiserCall(model_input, t, embeddings, finish, guided)


def _forward(kind: str, denoiser: Any, inputs: torch.Tensor, timesteps: torch.Tensor, condition: Any) -> torch.Tensor:
    """The denoiser's call as each pipeline makes it."""
    if kind == "dit":
        return denoiser(inputs, timestep=timesteps, class_labels=condition).sample
    if kind == "sd":
        return denoiser(
            inputs,
            timesteps,
            encoder_hidden_states=condition,
            timestep_cond=None,
            cross_attention_kwargs=None,
            added_cond_kwargs=None,
            return_dict=False,
        )[0]
    return denoiser(inputs, timesteps).sample


def run_together(kind: str, denoiser: Any, calls: list[DenoiserCall]) -> list[torch.Tensor]:
    """One forward pass of the denoiser over every call's rows; each call's part of the output,
    in order. A single call runs exactly as its pipeline runs it (its own timestep tensor)."""
    if len(calls) == 1:
        call = calls[0]
        return [_forward(kind, denoiser, call.inputs, call.timesteps, call.condition)]
    inputs = torch.cat([call.inputs for call in calls])
    timesteps = torch.cat([call.row_timesteps().to(inputs.device) for call in calls])
    condition = None if calls[0].condition is None else torch.cat([call.condition for call in calls])  # type: ignore[misc]
    output = _forward(kind, denoiser, inputs, timesteps, condition)
    return list(output.split([len(call.inputs) for call in calls]))


def _observed(output: Any, t: Any, sample: torch.Tensor, observe: StepObserver | None) -> torch.Tensor:
    """The step's next sample (the pipelines' `.prev_sample`), shown to `observe` first."""
    if observe is not None:
        observe(t, sample, output)
    return output.prev_sample


def state_tensors(request: DiffusionRequest, sample: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]]:
    """The latent-shaped tensors a request needs at its next op: its sample and what the
    scheduler keeps between steps. Other scheduler tensors (timesteps, sigmas, alphas)
    are per-schedule constants that set_timesteps left on the host."""
    out: list[tuple[str, int | None, torch.Tensor]] = [("sample", None, sample)]
    latent = tuple(sample.shape[1:])
    for name, value in vars(request.scheduler).items():
        if isinstance(value, torch.Tensor) and tuple(value.shape[1:]) == latent and value.dim() == sample.dim():
            out.append((name, None, value))
        elif isinstance(value, list):
            out.extend(
                (name, i, v)
                for i, v in enumerate(value)
                if isinstance(v, torch.Tensor) and tuple(v.shape[1:]) == latent and v.dim() == sample.dim()
            )
    return out
