"""The diffusers runner's connector (P-22): a Stable Diffusion stage takes its conditioning
from another stage (a text stage's prompt embeddings) instead of its own text encoder, and can
serve as that text stage itself (its CLIP encoder's embeddings, exported).

Names: `prompt_embeds` and `negative_prompt_embeds`, each one row of the text encoder's width
(`hidden_size`, the UNet's cross-attention width) and any length, in the runner's dtype. A
request names what landed for it with `{"transfer": request_id}` in place of `prompt` (or
carries the tensors itself, `{"conditioning": {name: tensor}}`, as a caller chaining the stages
by hand sends what the producer's `{"export": [...]}` answered); a guided one (guidance_scale >
1) needs both, as StableDiffusionPipeline.encode_prompt gives them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from omni_core.runners.base import ModelRunner, RunnerArgumentError
from omni_core.runners.connector import MAX_INBOX_BYTES, ConnectorSpec, check_tensors, tensors_from_wire

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
    _named_once(payload, "transfer")
    landed = runner.take_imported(payload["transfer"])
    check_tensors("the landed conditioning", runner.transfer_imports(), landed)
    return _embeddings("the transfer", landed, guided)


def passed_conditioning(runner: ModelRunner, payload: dict[str, Any], guided: bool) -> torch.Tensor:
    """The embeddings the caller sent in the payload's "conditioning" (name -> a tensor as
    `wire_tensor` writes it, what another stage's {"export": [...]} answered), checked as a
    landed transfer is."""
    _named_once(payload, "conditioning")
    sent = tensors_from_wire("the conditioning", runner.transfer_imports(), payload["conditioning"], MAX_INBOX_BYTES)
    return _embeddings("the conditioning", sent, guided)


def _named_once(payload: dict[str, Any], key: str) -> None:
    also = sorted({"prompt", "negative_prompt", "transfer", "conditioning"} - {key} & set(payload))
    if also:
        raise ValueError(f"a request names its conditioning once: {key!r}, not also {also}")


def _embeddings(what: str, tensors: dict[str, torch.Tensor], guided: bool) -> torch.Tensor:
    if "prompt_embeds" not in tensors or (guided and "negative_prompt_embeds" not in tensors):
        raise ValueError(
            f"{what} carries {sorted(tensors)}; a request needs 'prompt_embeds', and "
            "'negative_prompt_embeds' too when guidance_scale > 1: export both"
        )
    positive = tensors["prompt_embeds"]
    embeddings = torch.cat([tensors["negative_prompt_embeds"], positive]) if guided else positive
    return embeddings.to("cpu")
