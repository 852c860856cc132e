"""LoRA adapters on a transformers model through PEFT (P-20), for the transformers runner.

An adapter directory (PEFT's adapter_config.json + adapter_model.safetensors) is checked whole
before anything is loaded: its config's rank, target modules and base model class, and each
tensor's name and shape against the model's own modules, so an adapter of another
architecture, another rank or modules the model lacks is refused naming what (a
`RunnerArgumentError`: the rank answers INVALID_ARGUMENT and serves on). The first add wraps
the model in a `PeftModel` (its LoRA layers are injected in place: the base weights keep their
tensors); a request without an adapter runs with every adapter disabled.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omni_core.protocol import AddAdapter
from omni_core.runners.base import RunnerArgumentError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20


def _config(command: AddAdapter) -> dict[str, Any]:
    path = Path(command.source).expanduser() / ADAPTER_CONFIG
    weights = path.parent / ADAPTER_WEIGHTS
    if not path.is_file() or not weights.is_file():
        raise RunnerArgumentError(
            f"adapter {command.name!r}: {path.parent} is not a PEFT adapter directory "
            f"(needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}); nothing was loaded"
        )
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise RunnerArgumentError(f"adapter {command.name!r}: {path} is over {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunnerArgumentError(f"adapter {command.name!r}: {path} is not JSON ({exc})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise RunnerArgumentError(f"adapter {command.name!r}: {path} is not a LoRA adapter config (peft_type LORA)")
    return config


def _modules(config: dict[str, Any]) -> list[str]:
    modules = config.get("target_modules")
    return [modules] if isinstance(modules, str) else list(modules or [])


def check_peft_dir(command: AddAdapter, own_class: str) -> list[str]:
    """What a PEFT directory says about itself, against the command and the model's class
    (`own_class`, e.g. Qwen2ForCausalLM): its modules, once each is checked."""
    config = _config(command)
    name = command.name
    base_class = (config.get("auto_mapping") or {}).get("base_model_class")
    if base_class and own_class and base_class != own_class:
        raise RunnerArgumentError(
            f"adapter {name!r} was made for a {base_class}, and this stage serves a {own_class}; nothing was loaded"
        )
    if config.get("r") != command.rank:
        raise RunnerArgumentError(
            f"adapter {name!r}: its directory holds rank {config.get('r')!r}, the AddAdapter says {command.rank}"
        )
    declared = sorted(_modules(config))
    if declared != sorted(command.target_modules):
        raise RunnerArgumentError(
            f"adapter {name!r}: its directory targets {declared}, the AddAdapter says {list(command.target_modules)}"
        )
    return declared


class PeftAdapters:
    """The adapters of one transformers model, loaded through PEFT."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model  # the base model: PEFT injects its LoRA layers into its modules
        self.peft: Any = None  # the PeftModel, from the first add on
        self.names: set[str] = set()

    def check(self, command: AddAdapter) -> None:
        """Everything about the adapter checked before anything is loaded or evicted (its
        tensors, when they come through a weight plane, by the receiver against `specs`)."""
        name, own_class = command.name, type(self.model).__name__
        declared = sorted(command.target_modules) if command.tensors is not None else check_peft_dir(command, own_class)
        own = {module_name.rsplit(".", 1)[-1] for module_name, _ in self.model.named_modules()}
        missing = sorted(set(declared) - own)
        if missing:
            raise RunnerArgumentError(
                f"adapter {name!r} targets modules {missing} this model ({own_class}) lacks; nothing was loaded"
            )
        if command.tensors is None:
            self._check_shapes(command)

    def _targets(self, modules: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The base weight of every module an adapter on `modules` adapts, by the module's name."""
        found = {}
        for owner, module in self.model.named_modules():
            weight = getattr(module, "weight", None)
            if owner.rsplit(".", 1)[-1] in modules and isinstance(weight, torch.Tensor) and weight.dim() == 2:
                found[owner] = weight
        return found

    def specs(self, command: AddAdapter) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The tensors of an adapter of `command.rank` on its modules, by PEFT's saved names."""
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        for owner, weight in self._targets(command.target_modules).items():
            out_features, in_features = weight.shape
            specs[f"base_model.model.{owner}.lora_A.weight"] = ((command.rank, in_features), weight.dtype)
            specs[f"base_model.model.{owner}.lora_B.weight"] = ((out_features, command.rank), weight.dtype)
        return specs

    def _shape(self, name: str) -> tuple[int, tuple[str, ...], float] | None:
        """(rank, modules, alpha) of the adapter `name` held, or None."""
        if self.peft is None or name not in self.names:
            return None
        config = self.peft.peft_config[name]
        return config.r, tuple(sorted(_modules(vars(config)))), float(config.lora_alpha)

    def write(self, command: AddAdapter, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Refit the adapter held in place when its rank, modules and alpha stay; else make it
        afresh (PEFT injects its layers), then copy every tensor in."""
        from peft import LoraConfig, PeftModel

        name, held = command.name, self._shape(command.name)
        alpha = command.lora_alpha if command.lora_alpha is not None else (held[2] if held else float(command.rank))
        if held != (command.rank, tuple(sorted(command.target_modules)), alpha):
            # PEFT types lora_alpha int, and scales by it as a float (alpha / r): a refit's alpha may be one.
            config = LoraConfig(r=command.rank, lora_alpha=alpha, target_modules=list(command.target_modules))  # type: ignore[arg-type]
            if self.peft is None:
                self.peft = PeftModel(self.model, config, adapter_name=name)
            else:
                self.remove(name)
                self.peft.add_adapter(name, config)
            self.names.add(name)
            self.peft.eval()
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for key, tensor in tensors:
                owner, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
                params[f"{owner}.lora_{kind[0]}.{name}.weight"].copy_(tensor)

    def _check_shapes(self, command: AddAdapter) -> None:
        """Each lora_A (rank, in) and lora_B (out, rank) against the module it adapts."""
        from safetensors import safe_open

        modules = dict(self.model.named_modules())
        path = Path(command.source).expanduser() / ADAPTER_WEIGHTS
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                shape = tuple(handle.get_slice(key).get_shape())
                owner, _, kind = key.removeprefix("base_model.model.").rpartition(".lora_")
                module = modules.get(owner)
                weight = getattr(module, "weight", None)
                if weight is None:
                    raise RunnerArgumentError(
                        f"adapter {command.name!r}: tensor {key} adapts {owner!r}, which this model lacks"
                    )
                out_features, in_features = weight.shape
                want = (command.rank, in_features) if kind.startswith("A") else (out_features, command.rank)
                if shape != want:
                    raise RunnerArgumentError(
                        f"adapter {command.name!r}: tensor {key} has shape {list(shape)}, and {owner} needs "
                        f"{list(want)}: an adapter of another architecture or rank; nothing was loaded"
                    )

    def add(self, command: AddAdapter) -> None:
        from peft import PeftModel

        source, name = str(Path(command.source).expanduser()), command.name
        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.model, source, adapter_name=name, is_trainable=False)
        else:
            if name in self.names:
                self.peft.delete_adapter(name)
            self.peft.load_adapter(source, adapter_name=name, is_trainable=False)
        self.names.add(name)
        self.peft.eval()

    def remove(self, name: str) -> None:
        if self.peft is not None and name in self.names:
            self.peft.delete_adapter(name)
            self.names.discard(name)

    def tensors(self) -> list[torch.Tensor]:
        """Every adapter's tensors: the LoRA parameters PEFT injected."""
        if self.peft is None:
            return []
        return [p for n, p in self.model.named_parameters() if "lora_" in n]

    @contextlib.contextmanager
    def using(self, name: str | None) -> Iterator[None]:
        """Run with adapter `name` alone, or (None) with every adapter disabled."""
        if self.peft is None or not self.names:  # none held: the LoRA layers add nothing
            yield
            return
        if name is None:
            with self.peft.disable_adapter():
                yield
            return
        self.peft.set_adapter(name)
        yield


def lora_specs(
    weight_specs: dict[str, tuple[tuple[int, ...], torch.dtype]], command: AddAdapter
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of an adapter of `command.rank` on its modules, by PEFT's saved names, from a
    model's own weights (`<module>.weight` of shape (out, in)): lora_A (rank, in), lora_B (out, rank)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name, (shape, dtype) in weight_specs.items():
        owner = name.removesuffix(".weight")
        if owner != name and len(shape) == 2 and owner.rsplit(".", 1)[-1] in command.target_modules:
            specs[f"base_model.model.{owner}.lora_A.weight"] = ((command.rank, shape[1]), dtype)
            specs[f"base_model.model.{owner}.lora_B.weight"] = ((shape[0], command.rank), dtype)
    return specs


def write_peft_dir(
    directory: Path, command: AddAdapter, alpha: float, tensors: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """An adapter's tensors as a PEFT directory, for a framework that loads adapters only from
    one (vLLM's add_lora): adapter_model.safetensors and its adapter_config.json."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    save_file({name: t.detach().to("cpu").contiguous() for name, t in tensors}, str(directory / ADAPTER_WEIGHTS))
    config = {
        "peft_type": "LORA",
        "r": command.rank,
        "lora_alpha": alpha,
        "target_modules": list(command.target_modules),
    }
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, sort_keys=True) + "\n", encoding="utf-8")


def peft_alpha(directory: str) -> float | None:
    """The lora_alpha a PEFT directory's config says, or None."""
    try:
        config = json.loads((Path(directory) / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        alpha = config.get("lora_alpha")
    except (OSError, ValueError, AttributeError):
        return None
    return float(alpha) if isinstance(alpha, int | float) else None
