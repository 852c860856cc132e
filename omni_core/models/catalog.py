"""What `omni-core models make` can write: families, their sizes, and the configs behind them.

Plain data, no torch: listing the catalog or rejecting a bad name must not import
transformers or diffusers. "tiny" sizes run in seconds on a CPU and weigh a few MB (CI);
the others have the shapes of real models (Qwen2-0.5B and -1.5B, a Llama-3.2-1B widened to 20
layers, DiT-XL/2 cut to 19 blocks with the SD VAE, the DDPM CIFAR-10 UNet, Stable Diffusion
1.5) so the memory paths see realistic tensor counts and sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

LLM = "llm"
DIFFUSION = "diffusion"

# Byte-level BPE trained on a fixed corpus (omni_core.models.tokenizer); the tiny models'
# vocabularies are padded with reserved tokens to exactly this size.
TINY_VOCAB = 512
# The CLIP tokenizer: its two special tokens and every byte, alone and word-final ("</w>").
CLIP_TINY_VOCAB = 2 + 2 * 256


@dataclass(frozen=True)
class Size:
    """One size of a family: the configs of its components and what it amounts to."""

    name: str
    nominal_params: int  # parameters of all components together, checked by a test
    dtype: str  # dtype written when --dtype is not given
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # LLM or DIFFUSION
    description: str
    sizes: dict[str, Size]


def _qwen2(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, max_pos: int, rope_theta: float
) -> dict[str, Any]:
    return {
        "model_type": "qwen2",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos,
        "rope_theta": rope_theta,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "use_sliding_window": False,
    }


def _llama(
    vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int, max_pos: int, tied: bool
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "max_position_embeddings": max_pos,
        "rope_theta": 500000.0,
        "tie_word_embeddings": tied,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
    }


def _dit_transformer(layers: int, heads: int, head_dim: int, sample_size: int) -> dict[str, Any]:
    # num_embeds_ada_norm stays 1000 at every size: DiTPipeline hard-codes class 1000 as
    # the unconditional label of classifier-free guidance.
    return {
        "num_layers": layers,
        "num_attention_heads": heads,
        "attention_head_dim": head_dim,
        "in_channels": 4,
        "out_channels": 8,
        "sample_size": sample_size,
        "patch_size": 2,
        "num_embeds_ada_norm": 1000,
        "norm_type": "ada_norm_zero",
    }


def _vae(channels: list[int], groups: int, image_size: int) -> dict[str, Any]:
    return {
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 4,
        "block_out_channels": channels,
        "down_block_types": ["DownEncoderBlock2D"] * len(channels),
        "up_block_types": ["UpDecoderBlock2D"] * len(channels),
        "layers_per_block": 2 if groups > 8 else 1,
        "norm_num_groups": groups,
        "sample_size": image_size,
        "scaling_factor": 0.18215,
    }


def _clip_text(hidden: int, inter: int, layers: int, heads: int, vocab: int) -> dict[str, Any]:
    # Ids as the tokenizer writes them (omni_core.models.tokenizer.write_clip_tokenizer).
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": 77,
        "projection_dim": hidden,
        "hidden_act": "quick_gelu",
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 1,
    }


def _sd_unet(
    channels: list[int], layers: int, groups: int, cross_dim: int, head_dim: int, sample_size: int
) -> dict[str, Any]:
    cross = len(channels) - 1  # every level but the lowest attends to the text, as in SD 1.x
    return {
        "sample_size": sample_size,
        "in_channels": 4,
        "out_channels": 4,
        "block_out_channels": channels,
        "layers_per_block": layers,
        "norm_num_groups": groups,
        "cross_attention_dim": cross_dim,
        "attention_head_dim": head_dim,
        "down_block_types": ["CrossAttnDownBlock2D"] * cross + ["DownBlock2D"],
        "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * cross,
    }


# runwayml/stable-diffusion-v1-5's schedule, with DDIM (its default PNDM keeps every past
# output, which a fixed-size request slot cannot hold for long runs).
_SD_DDIM = {
    "_class_name": "DDIMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "clip_sample": False,
    "set_alpha_to_one": False,
    "steps_offset": 1,
    "prediction_type": "epsilon",
}
# facebook/DiT-XL-2-256's scheduler.
_DDIM = {
    "_class_name": "DDIMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "clip_sample": False,
    "set_alpha_to_one": True,
    "steps_offset": 0,
    "prediction_type": "epsilon",
}
# google/ddpm-cifar10-32's scheduler.
_DDPM = {
    "_class_name": "DDPMScheduler",
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "clip_sample": True,
    "variance_type": "fixed_small",
    "prediction_type": "epsilon",
}

FAMILIES: dict[str, Family] = {
    "qwen2": Family(
        "qwen2",
        LLM,
        "Qwen2ForCausalLM (tied embeddings, q/k/v biases) + byte-level BPE tokenizer",
        {
            "tiny": Size("tiny", 107_072, "float32", {"model": _qwen2(TINY_VOCAB, 64, 128, 2, 4, 2, 256, 10000.0)}),
            "0.5b": Size(
                "0.5b", 494_032_768, "bfloat16", {"model": _qwen2(151936, 896, 4864, 24, 14, 2, 32768, 1000000.0)}
            ),
            "1.5b": Size(
                "1.5b", 1_543_714_304, "bfloat16", {"model": _qwen2(151936, 1536, 8960, 28, 12, 2, 32768, 1000000.0)}
            ),
        },
    ),
    "llama": Family(
        "llama",
        LLM,
        "LlamaForCausalLM + byte-level BPE tokenizer",
        {
            "tiny": Size("tiny", 139_584, "float32", {"model": _llama(TINY_VOCAB, 64, 128, 2, 4, 2, 256, False)}),
            "1.5b": Size(
                "1.5b", 1_479_100_416, "bfloat16", {"model": _llama(128256, 2048, 8192, 20, 32, 8, 131072, True)}
            ),
        },
    ),
    "dit": Family(
        "dit",
        DIFFUSION,
        "DiTPipeline: class-conditional DiTTransformer2DModel + AutoencoderKL + DDIM",
        {
            "tiny": Size(
                "tiny",
                95_567,
                "float32",
                {"transformer": _dit_transformer(2, 2, 8, 8), "vae": _vae([8, 16], 4, 16), "scheduler": _DDIM},
            ),
            "600m": Size(
                "600m",
                593_336_711,
                "float32",
                {
                    "transformer": _dit_transformer(19, 16, 72, 32),
                    "vae": _vae([128, 256, 512, 512], 32, 256),
                    "scheduler": _DDIM,
                },
            ),
        },
    ),
    "ddpm": Family(
        "ddpm",
        DIFFUSION,
        "DDPMPipeline: unconditional UNet2DModel + DDPMScheduler",
        {
            "tiny": Size(
                "tiny",
                177_427,
                "float32",
                {
                    "unet": {
                        "sample_size": 16,
                        "in_channels": 3,
                        "out_channels": 3,
                        "block_out_channels": [16, 32],
                        "layers_per_block": 1,
                        "norm_num_groups": 8,
                        "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
                        "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
                    },
                    "scheduler": _DDPM,
                },
            ),
            "36m": Size(
                "36m",
                35_746_307,
                "float32",
                {
                    "unet": {
                        "sample_size": 32,
                        "in_channels": 3,
                        "out_channels": 3,
                        "block_out_channels": [128, 256, 256, 256],
                        "layers_per_block": 2,
                        "down_block_types": ["DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"],
                        "up_block_types": ["UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"],
                    },
                    "scheduler": _DDPM,
                },
            ),
        },
    ),
    "sd": Family(
        "sd",
        DIFFUSION,
        "StableDiffusionPipeline: CLIP text encoder + tokenizer, UNet2DConditionModel, AutoencoderKL, DDIM",
        {
            "tiny": Size(
                "tiny",
                282_979,
                "float32",
                {
                    "unet": _sd_unet([16, 32], 1, 8, 32, 8, 8),
                    "vae": _vae([8, 16], 4, 16),
                    "text_encoder": _clip_text(32, 64, 2, 4, CLIP_TINY_VOCAB),
                    "scheduler": _SD_DDIM,
                },
            ),
            # The tiny UNet attending to a 64-wide text: the tiny Qwen2's hidden size, so that
            # LLM's prompt embeddings condition it through a transfer (P-22; the demo's
            # pipeline scene, benchmarks/pipeline.py).
            "tiny-64": Size(
                "tiny-64",
                356_931,
                "float32",
                {
                    "unet": _sd_unet([16, 32], 1, 8, 64, 8, 8),
                    "vae": _vae([8, 16], 4, 16),
                    "text_encoder": _clip_text(64, 128, 2, 4, CLIP_TINY_VOCAB),
                    "scheduler": _SD_DDIM,
                },
            ),
            "1b": Size(
                "1b",
                1_066_235_307,
                "float16",
                {
                    "unet": _sd_unet([320, 640, 1280, 1280], 2, 32, 768, 8, 64),
                    "vae": _vae([128, 256, 512, 512], 32, 512),
                    "text_encoder": _clip_text(768, 3072, 12, 12, 49408),
                    "scheduler": _SD_DDIM,
                },
            ),
        },
    ),
}


class ModelSpecError(ValueError):
    """An unknown family or size, or a target directory that cannot be written; the message
    lists what is valid."""


def lookup(family: str, size: str) -> tuple[Family, Size]:
    if family not in FAMILIES:
        raise ModelSpecError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    fam = FAMILIES[family]
    if size not in fam.sizes:
        raise ModelSpecError(f"family {family!r} has no size {size!r}; its sizes are {list(fam.sizes)}")
    return fam, fam.sizes[size]
