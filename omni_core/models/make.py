"""Write a complete local checkpoint with seeded random weights.

The model is built on the meta device (no memory, no initialisation pass), and every
tensor of its state dict is drawn from a generator seeded by (seed, tensor name): the same
seed gives the same bytes whatever the order or the version of the model's own init code,
and a 1.5B model costs only the memory of the file being written. The directory is then
what `from_pretrained(dir, local_files_only=True)` reads: config.json + model.safetensors
(+ tokenizer) for transformers, model_index.json + one folder per component for diffusers.

Initial values keep activations bounded without training: matrices and convolutions are
N(0, 1/fan_in), norm scales 1 + N(0, 0.1^2), biases N(0, 0.02^2). No value is zero, so a
weight that fails to come back after a sleep changes the output.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from omni_core.models.catalog import DIFFUSION, Family, ModelSpecError, Size, lookup
from omni_core.models.tokenizer import write_clip_tokenizer, write_tokenizer
from omni_core.progress import Progress

# Above this the vocabulary is a real model's (150k): padding the small tokenizer with that
# many reserved tokens would only bloat tokenizer.json; ids past its end decode to "".
PAD_TOKENIZER_UP_TO = 4096
SAFETENSORS_METADATA = {"format": "pt"}  # transformers warns on files without it
# diffusers class of each component folder, and of each pipeline family.
# (library, class) of each component folder, by family; and each family's pipeline.
COMPONENT_CLASSES = {
    "dit": {"transformer": ("diffusers", "DiTTransformer2DModel"), "vae": ("diffusers", "AutoencoderKL")},
    "ddpm": {"unet": ("diffusers", "UNet2DModel")},
    "sd": {
        "unet": ("diffusers", "UNet2DConditionModel"),
        "vae": ("diffusers", "AutoencoderKL"),
        "text_encoder": ("transformers", "CLIPTextModel"),
    },
}
PIPELINE_CLASSES = {"dit": "DiTPipeline", "ddpm": "DDPMPipeline", "sd": "StableDiffusionPipeline"}
DIT_CLASSES = 1000


@dataclass(frozen=True)
class CheckpointInfo:
    family: str
    size: str
    path: str
    seed: int
    dtype: str
    params: int
    file_bytes: int
    files: tuple[str, ...]
    duration_s: float

    def summary(self) -> str:
        return (
            f"{self.family} {self.size}: {self.params / 1e6:.2f}M params, {self.dtype}, seed {self.seed}, "
            f"{self.file_bytes / 2**20:.1f} MiB in {len(self.files)} files, {self.duration_s:.1f} s "
            f"-> {self.path}"
        )


def tensor_seed(seed: int, name: str) -> int:
    """A generator seed per tensor, from a hash (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seeded_tensor(seed: int, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(tensor_seed(seed, name))
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if len(shape) >= 2:
        fan_in = math.prod(shape[1:])
        value = noise / math.sqrt(fan_in)
    elif name.endswith("weight"):  # a norm's scale
        value = 1.0 + 0.1 * noise
    else:
        value = 0.02 * noise
    return value.to(dtype).contiguous()


def seeded_state_dict(
    module: torch.nn.Module, seed: int, dtype: torch.dtype, progress: Progress | None = None
) -> dict[str, torch.Tensor]:
    """Values for every persistent tensor of a (meta) module. Tied parameters appear once,
    under their first name, as `save_pretrained` writes them. `progress` advances by each
    tensor's elements."""
    params = dict(module.named_parameters())
    aliases = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    buffers = sorted(set(module.state_dict()) - aliases)
    if buffers:
        # A persistent buffer holds computed values (not weights) that random numbers would
        # break; none of the catalog's models has one.
        raise RuntimeError(
            f"{type(module).__name__} has persistent buffers {buffers}; the seeded writer fills parameters only"
        )
    tensors = {}
    for name, p in params.items():
        tensors[name] = seeded_tensor(seed, name, tuple(p.shape), dtype)
        if progress is not None:
            progress.advance(p.numel())
    return tensors


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=SAFETENSORS_METADATA)


def _llm_config(size: Size, token_ids: dict[str, int], dtype: torch.dtype) -> Any:
    from transformers import AutoConfig

    fields = dict(size.configs["model"])
    eos = token_ids["eos_token"]
    bos = token_ids.get("bos_token", eos)
    return AutoConfig.for_model(
        fields.pop("model_type"),
        **fields,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        dtype=str(dtype).removeprefix("torch."),
    )


def _meta_llm(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _meta_diffusion(family: str, size: Size) -> dict[str, torch.nn.Module]:
    import diffusers
    import transformers

    modules = {}
    with torch.device("meta"):
        for name, (library, class_name) in COMPONENT_CLASSES[family].items():
            cls = getattr(diffusers if library == "diffusers" else transformers, class_name)
            fields = size.configs[name]
            # transformers models take a config object, diffusers models its fields.
            modules[name] = cls(cls.config_class(**fields)) if library == "transformers" else cls(**fields)
    return modules


def param_count(family: str, size: str) -> int:
    """Parameters of FAMILY at SIZE (tied ones once), counted on the meta device: no memory."""
    fam, spec = lookup(family, size)
    if fam.kind == DIFFUSION:
        modules = list(_meta_diffusion(family, spec).values())
    else:
        modules = [_meta_llm(_llm_config(spec, {"eos_token": 0}, torch.float32))]
    return _unique_params(modules)


def _unique_params(modules: list[torch.nn.Module]) -> int:
    return sum(p.numel() for module in modules for p in module.parameters())


def _write_llm(
    family: Family, size: Size, directory: Path, seed: int, dtype: torch.dtype, progress: Progress | None = None
) -> int:
    from transformers import GenerationConfig

    vocab = size.configs["model"]["vocab_size"]
    token_ids = write_tokenizer(directory, family.name, vocab if vocab <= PAD_TOKENIZER_UP_TO else None)
    config = _llm_config(size, token_ids, dtype)
    model = _meta_llm(config)
    if progress is not None:
        progress.add_total(_unique_params([model]))
    tensors = seeded_state_dict(model, seed, dtype, progress)
    if progress is not None:
        progress.note("writing model.safetensors")
    config.save_pretrained(str(directory))
    GenerationConfig.from_model_config(config).save_pretrained(str(directory))
    _write_safetensors(tensors, directory / "model.safetensors")
    return sum(t.numel() for t in tensors.values())


def _write_diffusion(
    family: Family, size: Size, directory: Path, seed: int, dtype: torch.dtype, progress: Progress | None = None
) -> int:
    import diffusers
    from diffusers.configuration_utils import ConfigMixin
    from transformers import PreTrainedModel

    components = _meta_diffusion(family.name, size)
    if progress is not None:
        progress.add_total(_unique_params(list(components.values())))
    scheduler_fields = dict(size.configs["scheduler"])
    scheduler = getattr(diffusers, scheduler_fields.pop("_class_name")).from_config(scheduler_fields)
    extra: dict[str, Any] = {}
    if family.name == "sd":
        write_clip_tokenizer(directory / "tokenizer")
        from transformers import CLIPTokenizer

        # No safety checker: its own 1.2 GB CLIP vision model would dwarf a tiny pipeline.
        extra = {
            "tokenizer": CLIPTokenizer.from_pretrained(str(directory / "tokenizer")),
            "safety_checker": None,
            "feature_extractor": None,
            "requires_safety_checker": False,
        }
    pipeline = getattr(diffusers, PIPELINE_CLASSES[family.name])(**components, scheduler=scheduler, **extra)
    if family.name == "dit":
        # DiTPipeline takes id2label from model_index.json but does not register it itself.
        pipeline.register_to_config(id2label={str(i): f"class {i}" for i in range(DIT_CLASSES)})
    pipeline.save_config(str(directory))
    scheduler.save_pretrained(str(directory / "scheduler"))
    params = 0
    for name, module in components.items():
        folder = directory / name
        # The component's name keeps the seeds of two components with equal tensor names apart.
        tensors = seeded_state_dict(module, tensor_seed(seed, name), dtype, progress)
        if isinstance(module, PreTrainedModel):  # COMPONENT_CLASSES names it from transformers
            module.config.save_pretrained(str(folder))
            _write_safetensors(tensors, folder / "model.safetensors")
        else:
            assert isinstance(module, ConfigMixin), f"{name}: a diffusers model keeps its config (ConfigMixin)"
            module.save_config(str(folder))
            _write_safetensors(tensors, folder / "diffusion_pytorch_model.safetensors")
        params += sum(t.numel() for t in tensors.values())
    return params


def _readable_by_all(root: Path) -> None:
    """Modes as the user's umask says: safetensors writes its files 0600, and a checkpoint
    is usually shared (other users, containers running as another uid)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in root.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _check_target(target: Path, force: bool) -> None:
    if target.exists() and not target.is_dir():
        raise ModelSpecError(f"{target} exists and is not a directory; give a directory path")
    if target.is_dir() and any(target.iterdir()) and not force:
        raise ModelSpecError(
            f"{target} is not empty; choose an empty or new directory, or pass --force "
            "(force=True) to write over the files of the same names"
        )


def make_checkpoint(
    family: str,
    size: str,
    directory: str | Path,
    *,
    seed: int = 0,
    dtype: str | None = None,
    force: bool = False,
    progress: Progress | None = None,
) -> CheckpointInfo:
    """Write FAMILY at SIZE into `directory`; deterministic given `seed` (and dtype).
    `progress` counts the parameters generated (omni_core.progress: stderr, terminals only)."""
    from omni_core.runners.synthetic import torch_dtype

    fam, spec = lookup(family, size)
    dtype_name = dtype or spec.dtype
    try:
        torch_type = torch_dtype(dtype_name)
    except ValueError as exc:
        raise ModelSpecError(str(exc)) from None
    target = Path(directory).expanduser().resolve()
    _check_target(target, force)
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    # Written next to the target and moved in at the end: an interrupted run leaves no
    # half checkpoint that from_pretrained would then half load.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    try:
        writer = _write_diffusion if fam.kind == DIFFUSION else _write_llm
        params = writer(fam, spec, staging, seed, torch_type, progress)
        _readable_by_all(staging)
        files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
        file_bytes = sum((staging / f).stat().st_size for f in files)
        target.mkdir(exist_ok=True)
        for entry in sorted(staging.iterdir()):
            destination = target / entry.name
            if destination.is_dir():
                shutil.rmtree(destination)
            entry.replace(destination)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return CheckpointInfo(
        family=family,
        size=size,
        path=str(target),
        seed=seed,
        dtype=dtype_name,
        params=params,
        file_bytes=file_bytes,
        files=tuple(files),
        duration_s=time.perf_counter() - started,
    )
