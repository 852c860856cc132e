"""What diffusion RL needs back from a sampling run (FlowGRPO, DanceGRPO, verl-omni): the
latents at every step, the timesteps, each step's log-probability under the sampler, and the
prompt embeddings, beside the image.

A request asks with `"trajectory": true`. The latents are recorded on the host before the
first step and after each one (`steps + 1` tensors, the conditional half only under DiT's
classifier-free guidance), so a trainer can rebuild any step's input and the image from the
last one. A step's log-probability is that of the latents it produced under the Gaussian the
scheduler drew them from, `N(mean, std^2)` summed over the latent:

- `DDPMScheduler` (the DDPM pipeline's own, and any pipeline configured with it): the
  posterior mean from the step's predicted original sample and its fixed variance, exactly
  the step's own arithmetic; the last step adds no noise, so it has none (`null`);
- a deterministic sampler (DPM-Solver, DDIM at eta 0, PNDM) has no density: every entry is
  `null` and `log_prob_method` says why, so a trainer never mistakes a missing figure for 0.

The trajectory lives with the request on the host, so a level-1 sleep between step-wise ops
keeps it; it is bounded (`MAX_TRAJECTORY_BYTES`) and refused at the start when it cannot fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

MAX_TRAJECTORY_BYTES = 64 << 20  # latents of every step and the embeddings, on the host
LOG_STD_VARIANCES = ("fixed_small_log", "fixed_large_log")  # _get_variance returns log(variance)
STD_VARIANCES = ("fixed_small", "fixed_large")


def wire_tensor(tensor: torch.Tensor) -> dict[str, Any]:
    """A tensor as a result carries it: dtype, shape and its bytes (C order, little endian)."""
    host = tensor.detach().to("cpu").contiguous()
    return {
        "dtype": str(host.dtype).removeprefix("torch."),
        "shape": list(host.shape),
        "data": host.view(torch.uint8).numpy().tobytes() if host.numel() else b"",
    }


def from_wire(described: dict[str, Any]) -> torch.Tensor:
    """`wire_tensor`'s inverse (for callers and tests)."""
    dtype = getattr(torch, described["dtype"])
    flat = torch.frombuffer(bytearray(described["data"]), dtype=torch.uint8) if described["data"] else None
    if flat is None:
        return torch.empty(described["shape"], dtype=dtype)
    return flat.view(dtype).reshape(described["shape"]).clone()


def log_prob_method(scheduler: Any) -> str:
    """ "ddpm" where this module can give the step's density, else why not."""
    from diffusers import DDPMScheduler

    name = type(scheduler).__name__
    if not isinstance(scheduler, DDPMScheduler):
        return f"none: {name} steps deterministically (no noise is drawn), so a step has no density"
    variance = scheduler.config.variance_type  # type: ignore[attr-defined]  # ConfigMixin's, set at runtime
    if variance not in STD_VARIANCES + LOG_STD_VARIANCES:
        return f"none: DDPMScheduler with variance_type {variance!r} (a predicted variance) is not supported"
    return "ddpm"


def ddpm_log_prob(
    scheduler: Any, t: Any, sample: torch.Tensor, pred_original: torch.Tensor, produced: torch.Tensor
) -> float | None:
    """log N(produced; mean, std^2) summed, as DDPMScheduler.step drew `produced` from
    `sample` at timestep `t`; None at the last step (no noise is added there)."""
    step = int(t)
    if step <= 0:
        return None
    prev_t = scheduler.previous_timestep(step)
    alpha_prod_t = scheduler.alphas_cumprod[step]
    alpha_prod_t_prev = scheduler.alphas_cumprod[prev_t] if prev_t >= 0 else scheduler.one
    beta_prod_t, beta_prod_t_prev = 1 - alpha_prod_t, 1 - alpha_prod_t_prev
    current_alpha_t = alpha_prod_t / alpha_prod_t_prev
    mean = (alpha_prod_t_prev**0.5 * (1 - current_alpha_t) / beta_prod_t) * pred_original + (
        current_alpha_t**0.5 * beta_prod_t_prev / beta_prod_t
    ) * sample
    variance = scheduler._get_variance(step)  # the step's own figure (private in diffusers 0.3x-0.4x)
    std = torch.exp(0.5 * variance) if scheduler.config.variance_type in LOG_STD_VARIANCES else variance**0.5
    z = (produced.double() - mean.double()) / std.double()
    return float(-0.5 * (z**2).sum() - z.numel() * (torch.log(std.double()) + 0.5 * math.log(2 * math.pi)))


@dataclass
class Trajectory:
    """One request's record, on the host; `guided`: keep the conditional half of each sample."""

    guided: bool
    method: str
    timesteps: list[int] = field(default_factory=list)
    latents: list[torch.Tensor] = field(default_factory=list)
    log_probs: list[float | None] = field(default_factory=list)
    prompt_embeds: torch.Tensor | None = None

    @staticmethod
    def bytes_needed(steps: int, latent: torch.Size | tuple[int, ...], dtype: torch.dtype, embeds_bytes: int) -> int:
        return (steps + 1) * math.prod(latent) * torch.empty((), dtype=dtype).element_size() + embeds_bytes

    def _half(self, sample: torch.Tensor) -> torch.Tensor:
        return sample.chunk(2, dim=0)[0] if self.guided else sample

    def start(self, sample: torch.Tensor) -> None:
        self.latents.append(self._half(sample).detach().to("cpu", copy=True))

    def step(self, scheduler: Any, t: Any, sample_in: torch.Tensor, output: Any) -> None:
        """After one scheduler step: `sample_in` is what the step got, `output` its result."""
        produced = output.prev_sample
        self.timesteps.append(int(t))
        self.latents.append(self._half(produced).detach().to("cpu", copy=True))
        pred_original = getattr(output, "pred_original_sample", None)
        if self.method != "ddpm" or pred_original is None:
            self.log_probs.append(None)
            return
        self.log_probs.append(
            ddpm_log_prob(scheduler, t, self._half(sample_in), self._half(pred_original), self._half(produced))
        )

    def to_wire(self) -> dict[str, Any]:
        return {
            "timesteps": list(self.timesteps),
            "latents": [wire_tensor(latent) for latent in self.latents],
            "log_probs": list(self.log_probs),
            "log_prob_method": self.method,
            "prompt_embeds": wire_tensor(self.prompt_embeds) if self.prompt_embeds is not None else None,
        }
