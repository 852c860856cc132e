"""A step cache for DiT denoising (TeaCache's method): a step whose transformer input changed
little since the last computed step skips the transformer blocks and adds that step's residual
(the blocks' output less their input) instead.

The change is measured where TeaCache measures it: the first block's modulated input (its
AdaLayerNormZero output, which folds in the timestep and class embedding), as the relative
mean absolute difference from the last step that ran the blocks. Differences accumulate over
skipped steps; once they reach `threshold` the blocks run again and the residual is renewed.
The first and the last step always run the blocks. TeaCache rescales the difference by a
polynomial fitted per model; this cache uses it as measured (no fitted model coefficients),
so a threshold means the same thing for every DiT.

The cache's tensors are a request's state, like its latents: they are kept in the request's
slot of the `requests` pool between step-wise ops (`DiffusersRunner` parks them), so a level-1
sleep offloads them with the request and it finishes bit for bit as it would have; anything
that voids the request (a level-2 sleep, a weight update or reload) voids its cache with it,
so a residual computed under other weights is never added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

MAX_THRESHOLD = 10.0  # a relative L1 change summed over steps: beyond this every step but two is skipped


def check_threshold(threshold: Any) -> float | None:
    """The runner argument `step_cache_threshold`: None (off) or a number in [0, 10]."""
    if threshold is None:
        return None
    if not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not 0 <= threshold <= MAX_THRESHOLD:
        raise ValueError(
            f"step_cache_threshold must be a number in [0, {MAX_THRESHOLD}] (TeaCache's accumulated relative change; "
            f"0.05-0.3 skips a quarter to two thirds of the steps) or None for no step cache, got {threshold!r}"
        )
    return float(threshold)


@dataclass
class StepCacheState:
    """One request's cache: the last computed step's modulated input and residual (device
    tensors, parked in the request's slot between ops) and the change accumulated since."""

    previous: torch.Tensor | None = None
    residual: torch.Tensor | None = None
    accumulated: float = 0.0


@dataclass
class StepCacheStats:
    hits: int = 0  # steps whose blocks were skipped
    misses: int = 0  # steps that ran the blocks

    def counters(self) -> dict[str, int]:
        return {"step_cache_hits": self.hits, "step_cache_misses": self.misses}


def cached_dit_forward(
    transformer: Any,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    class_labels: torch.Tensor | None,
    state: StepCacheState,
    threshold: float,
    stats: StepCacheStats,
    *,
    must_compute: bool,
) -> torch.Tensor:
    """DiTTransformer2DModel.forward (diffusers 0.3x-0.4x), its blocks skipped where the cache
    allows. `must_compute`: the first and last steps of a request run the blocks."""
    hidden_states = transformer.pos_embed(hidden_states)
    block0 = transformer.transformer_blocks[0]
    modulated = block0.norm1(hidden_states, timestep, class_labels, hidden_dtype=hidden_states.dtype)[0]
    compute = must_compute or state.previous is None or state.residual is None
    if not compute:
        assert state.previous is not None
        change = (modulated - state.previous).abs().mean() / state.previous.abs().mean().clamp_min(1e-12)
        state.accumulated += float(change)
        compute = state.accumulated >= threshold
    state.previous = modulated
    if compute:
        before = hidden_states
        for block in transformer.transformer_blocks:
            hidden_states = block(hidden_states, timestep=timestep, class_labels=class_labels)
        state.residual, state.accumulated = hidden_states - before, 0.0
        stats.misses += 1
    else:
        assert state.residual is not None
        hidden_states = hidden_states + state.residual
        stats.hits += 1
    return dit_output(transformer, hidden_states, timestep, class_labels)


def dit_output(transformer: Any, hidden_states: torch.Tensor, timestep: torch.Tensor, labels: Any) -> torch.Tensor:
    """The forward's output head and unpatchify, as diffusers writes them."""
    conditioning = transformer.transformer_blocks[0].norm1.emb(timestep, labels, hidden_dtype=hidden_states.dtype)
    shift, scale = transformer.proj_out_1(F.silu(conditioning)).chunk(2, dim=1)
    hidden_states = transformer.norm_out(hidden_states) * (1 + scale[:, None]) + shift[:, None]
    hidden_states = transformer.proj_out_2(hidden_states)
    patch, channels = transformer.patch_size, transformer.out_channels
    height = width = int(hidden_states.shape[1] ** 0.5)
    hidden_states = hidden_states.reshape(shape=(-1, height, width, patch, patch, channels))
    hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
    return hidden_states.reshape(shape=(-1, channels, height * patch, width * patch))
