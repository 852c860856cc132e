"""The diffusers runner's connector (P-22): a Stable Diffusion stage takes its conditioning
from another stage (a text stage's prompt embeddings) instead of its own text encoder, and can
serve as that text stage itself (its CLIP encoder's embeddings, exported).

Names: `prompt_embeds` and `negative_prompt_embeds`, each one row of the text encoder's width
(`hidden_size`, the UNet's cross-attention width) and any length, in the runner's dtype. A
request names what landed for it with `{"transfer": request_id}` in place of `prompt`; a guided
one (guidance_scale > 1) needs both, as StableDiffusionPipeline.encode_prompt gives them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from omni_core.runners.base import ModelRunner, RunnerArgumentError
from omni_core.runners.connector import ConnectorSpec, check_tensors

NAMES = ("prompt_embeds", "negative_prompt_embeds")


def conditioning_specs(runner: Any) -> dict[str, ConnectorSpec]:
    """What an SD stage exports and imports; nothing for the other pipelines."""
    if runner.kind != "sd":
        return {}
    config = json.loads((runner.model_dir / "text_encoder" / "config.json").read_text())
    spec = ConnectorSpec(runner.dtype, (1, None, int(config["hidden_size"])))
    return dict.fromkeys(NAMES, spec)


def export_conditioning(runner: Any, payload: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The text encoder's embeddings of `payload` ({"prompt": str, "negative_prompt": str?})."""
    if runner.kind != "sd" or runner.pipeline is None:
        raise RunnerArgumentError("only a loaded Stable Diffusion stage exports prompt embeddings")
    if not isinstance(payload, dict) or set(payload) - {"prompt", "negative_prompt"}:
        raise RunnerArgumentError(f"an export takes {{'prompt': str, 'negative_prompt': str?}}, got {payload!r:.200}")
    prompt, negative = payload.get("prompt"), payload.get("negative_prompt")
    if not isinstance(prompt, str) or not prompt or not isinstance(negative, (str, type(None))):
        raise RunnerArgumentError("an export's 'prompt' is a non-empty string, its 'negative_prompt' a string or none")
    with torch.no_grad():
        positive, negative_embeds = runner.pipeline.encode_prompt(
            prompt, runner.device, 1, "negative_prompt_embeds" in names, negative
        )
    made = {"prompt_embeds": positive, "negative_prompt_embeds": negative_embeds}
    return {name: made[name].detach().clone() for name in names}


def imported_conditioning(runner: ModelRunner, payload: dict[str, Any], guided: bool) -> torch.Tensor:
    """The embeddings that landed for the payload's "transfer", as `_prompt_embeddings` gives
    them (negative first when guided), on the host."""
    if "prompt" in payload or "negative_prompt" in payload:
        raise ValueError("a request names its conditioning once: 'transfer' or 'prompt', not both")
    landed = runner.take_imported(payload["transfer"])
    check_tensors("the landed conditioning", runner.transfer_imports(), landed)
    if "prompt_embeds" not in landed or (guided and "negative_prompt_embeds" not in landed):
        raise ValueError(
            f"the transfer carries {sorted(landed)}; a request needs 'prompt_embeds', and "
            "'negative_prompt_embeds' too when guidance_scale > 1: export both"
        )
    positive = landed["prompt_embeds"]
    embeddings = torch.cat([landed["negative_prompt_embeds"], positive]) if guided else positive
    return embeddings.to("cpu")
