"""Write a small seeded LoRA adapter (PEFT's format) for a local transformers checkpoint, so
CI and the demo have one to add (P-20): `omni-core models make qwen2 tiny DIR --lora` writes
the checkpoint and DIR/lora beside it, `make_lora(DIR, OUT)` one for an existing checkpoint.

Both LoRA matrices are drawn from a generator seeded by (seed, tensor name), as the
checkpoint's weights are, and scaled so that the adapter changes the model's greedy tokens:
an adapter that did not come back after a sleep shows in the output.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from omni_core.models.catalog import ModelSpecError

DEFAULT_LORA_RANK = 4
DEFAULT_TARGET_MODULES = ("q_proj", "v_proj")
LORA_STD = 0.5  # large for a LoRA, so that a tiny random model's greedy tokens change


@dataclass(frozen=True)
class LoraInfo:
    path: str
    base: str
    rank: int
    target_modules: tuple[str, ...]
    seed: int
    tensors: int

    def summary(self) -> str:
        modules = ",".join(self.target_modules)
        return f"LoRA rank {self.rank} on {modules}, seed {self.seed}: {self.tensors} tensors -> {self.path}"


def make_lora(
    model_dir: str | Path,
    directory: str | Path,
    *,
    rank: int = DEFAULT_LORA_RANK,
    target_modules: tuple[str, ...] = DEFAULT_TARGET_MODULES,
    seed: int = 0,
) -> LoraInfo:
    """A PEFT adapter of `rank` on `target_modules` of the transformers checkpoint `model_dir`,
    written to `directory` (adapter_config.json + adapter_model.safetensors)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from omni_core.models.make import seeded_tensor

    base = Path(model_dir).expanduser().resolve()
    if not (base / "config.json").is_file():
        raise ModelSpecError(f"{base} is not a transformers checkpoint (no config.json): a LoRA needs its base model")
    if not 1 <= rank <= 1024:
        raise ModelSpecError(f"a LoRA rank is 1..1024, got {rank}")
    config = AutoConfig.from_pretrained(str(base), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(target_modules), init_lora_weights=False)
    try:
        peft_model = get_peft_model(model, lora)
    except ValueError as exc:
        raise ModelSpecError(f"target modules {list(target_modules)} do not fit {config.model_type}: {exc}") from None
    state = {}
    for name, tensor in peft_model.named_parameters():
        if "lora_" in name:
            values = seeded_tensor(seed, name, tuple(tensor.shape), torch.float32) * LORA_STD
            state[name] = values.to(config.dtype if isinstance(config.dtype, torch.dtype) else torch.float32)
    peft_model.to_empty(device="cpu")
    peft_model.load_state_dict(state, strict=False)
    out = Path(directory).expanduser().resolve()
    peft_model.save_pretrained(str(out))
    _name_the_base(out / "adapter_config.json", base)
    return LoraInfo(str(out), str(base), rank, tuple(sorted(target_modules)), seed, len(state))


def _name_the_base(config_path: Path, base: Path) -> None:
    """The adapter names its base checkpoint by path, not by a hub id nobody can fetch."""
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(base)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


DIFFUSERS_DENOISERS = {"DiTPipeline": "transformer", "StableDiffusionPipeline": "unet"}
DIFFUSERS_TARGET_MODULES = ("to_q", "to_v")


def make_diffusers_lora(
    pipeline_dir: str | Path,
    directory: str | Path,
    *,
    rank: int = DEFAULT_LORA_RANK,
    target_modules: tuple[str, ...] = DIFFUSERS_TARGET_MODULES,
    seed: int = 0,
) -> LoraInfo:
    """A LoRA of `rank` on `target_modules` of a diffusers pipeline's denoiser (a DiT's
    transformer, Stable Diffusion's UNet), in diffusers' format: `directory`/
    pytorch_lora_weights.safetensors with `<component>.<module>.lora_A.weight` and `lora_B`
    (what `save_lora_weights` writes, what `load_lora_weights` reads), alpha = rank."""
    from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model
    from safetensors.torch import save_file

    from omni_core.models.make import seeded_tensor

    base = Path(pipeline_dir).expanduser().resolve()
    index = base / "model_index.json"
    pipeline_class = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    component = DIFFUSERS_DENOISERS.get(str(pipeline_class))
    if component is None:
        raise ModelSpecError(
            f"{base} is not a DiT or Stable Diffusion pipeline directory (model_index.json says {pipeline_class!r}): "
            "a diffusers LoRA adapts its transformer or UNet"
        )
    import diffusers

    config_class = json.loads((base / component / "config.json").read_text())["_class_name"]
    denoiser = getattr(diffusers, config_class).from_pretrained(str(base / component), local_files_only=True)
    lora = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(target_modules), init_lora_weights=False)
    inject_adapter_in_model(lora, denoiser)
    state = {}
    for name, tensor in get_peft_model_state_dict(denoiser).items():
        state[f"{component}.{name}"] = (seeded_tensor(seed, name, tuple(tensor.shape), torch.float32) * LORA_STD).to(
            tensor.dtype
        )
    out = Path(directory).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "pytorch_lora_weights.safetensors"))
    return LoraInfo(str(out), str(base), rank, tuple(sorted(target_modules)), seed, len(state))
