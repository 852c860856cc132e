"""LoRA adapters on a diffusion pipeline's denoiser (P-20), for the diffusers runner.

An adapter is a directory holding diffusers' LoRA file (`pytorch_lora_weights.safetensors`,
what `save_lora_weights` writes: `unet.<module>.lora_A.weight` / `lora_B.weight`, or
`transformer.` for a DiT), checked whole before anything is loaded: every tensor adapts a
linear module the denoiser has, at the AddAdapter's rank, on its target modules. Stable
Diffusion loads it with diffusers' own `load_lora_weights`; the DiT transformer, which diffusers
gives no LoRA loader, through PEFT's `inject_adapter_in_model` with the same names. The
adapter's scale is 1 (alpha = rank, as diffusers takes a file without alphas). A request runs
with one adapter set on every LoRA layer, or with all of them off; a step-wise request keeps
the adapter (and its load) it started with: an op naming another fails, never mixing two."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from omni_core.protocol import AddAdapter
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.weights import own_storage

LORA_FILE = "pytorch_lora_weights.safetensors"
DENOISER = {"dit": "transformer", "ddpm": "unet", "sd": "unet"}


def adapter_problem(kind: str, offload: str, world: int, parallel: str) -> str | None:
    """Why this pipeline's runner takes no adapter, or None."""
    if kind == "ddpm":
        return "the DDPM pipeline's UNet2DModel takes no LoRA adapters; use a DiT or SD one"
    if offload != "none":
        # The streamed blocks' weights are host tensors between forwards: a LoRA layer made
        # beside them would live on the host, outside every pool, and never stream.
        return (
            f"offload={offload!r} streams the denoiser's blocks, which take no LoRA adapters: "
            "serve adapters with offload='none'"
        )
    if world > 1 and parallel == "tensor":
        # Each rank holds a shard of every linear module: a whole adapter fits none of them.
        return (
            "a tensor-parallel DiT holds shards of its linear modules, which take no LoRA adapters: "
            "serve adapters with parallel='cfg'"
        )
    return None


class DiffusersAdapters:
    """The adapters of one pipeline's denoiser (`unet` or `transformer`)."""

    def __init__(self, pipeline: Any, kind: str) -> None:
        self.pipeline, self.kind = pipeline, kind
        self.component = DENOISER[kind]
        self.denoiser: torch.nn.Module = getattr(pipeline, self.component)
        self.loads: dict[str, int] = {}  # name -> the count of its load: a step-wise request's own
        self._count = 0
        self.started: dict[str, tuple[str | None, int]] = {}  # request_id -> (adapter, its load)

    def _file(self, command: AddAdapter) -> Path:
        path = Path(command.source).expanduser() / LORA_FILE
        if not path.is_file():
            raise RunnerArgumentError(
                f"adapter {command.name!r}: {path.parent} is not a diffusers LoRA directory (needs {LORA_FILE}, "
                "as save_lora_weights writes it); nothing was loaded"
            )
        return path

    def check(self, command: AddAdapter) -> None:
        """Every tensor of the file against the denoiser's modules and the command."""
        from safetensors import safe_open

        modules, name, seen = dict(self.denoiser.named_modules()), command.name, set()
        with safe_open(str(self._file(command)), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                owner, _, kind = key.removeprefix(f"{self.component}.").rpartition(".lora_")
                weight = getattr(modules.get(owner), "weight", None)
                if not key.startswith(f"{self.component}.") or weight is None or weight.dim() != 2:
                    raise RunnerArgumentError(
                        f"adapter {name!r}: tensor {key} adapts no linear module of this pipeline's "
                        f"{self.component} ({type(self.denoiser).__name__}); nothing was loaded"
                    )
                shape, (out_features, in_features) = tuple(handle.get_slice(key).get_shape()), weight.shape
                want = (command.rank, in_features) if kind.startswith("A") else (out_features, command.rank)
                if shape != want:
                    raise RunnerArgumentError(
                        f"adapter {name!r}: tensor {key} has shape {list(shape)}, and {owner} needs {list(want)} "
                        f"at rank {command.rank}: an adapter of another model or rank; nothing was loaded"
                    )
                seen.add(owner.rsplit(".", 1)[-1])
        if seen != set(command.target_modules):
            raise RunnerArgumentError(
                f"adapter {name!r}: its file targets {sorted(seen)}, the AddAdapter says {list(command.target_modules)}"
            )

    def add(self, command: AddAdapter) -> None:
        name = command.name
        self.remove(name)
        if self.kind == "sd":  # diffusers' own loader for the pipeline
            self.pipeline.load_lora_weights(str(Path(command.source).expanduser()), adapter_name=name)
        else:
            self._inject(command)
        own_storage([self.denoiser])  # tensors read from the file map it: the pool must own them
        self._count += 1
        self.loads[name] = self._count
        self._enable(None)

    def _inject(self, command: AddAdapter) -> None:
        from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
        from safetensors.torch import load_file

        prefix = f"{self.component}."
        state = {k.removeprefix(prefix): v for k, v in load_file(str(self._file(command))).items()}
        config = LoraConfig(r=command.rank, lora_alpha=command.rank, target_modules=list(command.target_modules))
        inject_adapter_in_model(config, self.denoiser, adapter_name=command.name)
        set_peft_model_state_dict(self.denoiser, state, adapter_name=command.name)

    def remove(self, name: str) -> None:
        if name not in self.loads:
            return
        if self.kind == "sd":
            self.pipeline.delete_adapters(name)
        else:
            from peft.tuners.tuners_utils import BaseTunerLayer

            for module in self.denoiser.modules():
                if isinstance(module, BaseTunerLayer):
                    module.delete_adapter(name)
        del self.loads[name]

    def tensors(self) -> list[torch.Tensor]:
        return [p for n, p in self.denoiser.named_parameters() if "lora_" in n]

    def _enable(self, name: str | None) -> None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for module in self.denoiser.modules():
            if isinstance(module, BaseTunerLayer) and module.active_adapters is not None:
                if name is None:
                    module.enable_adapters(False)
                elif name in module.lora_A:  # type: ignore[operator]
                    module.set_adapter(name)
                    module.enable_adapters(True)

    @contextlib.contextmanager
    def using(self, name: str | None, payload: Any) -> Iterator[None]:
        """Run one op with adapter `name` alone (None: every adapter off); an op on a step-wise
        request must name the adapter, and the load of it, that the request started with."""
        self.check_started(name, payload)
        self._enable(name)
        try:
            yield
        finally:
            self._enable(None)

    def check_started(self, name: str | None, payload: Any) -> None:
        """An op on a step-wise request must name the adapter, and the load of it, that the
        request started with (None: every adapter off)."""
        request_id = payload.get("request_id") if isinstance(payload, dict) else None
        if request_id is not None and request_id in self.started:
            began = self.started[request_id]
            if began != (name, self.loads.get(name or "", 0) if name else 0):
                raise ValueError(
                    f"request {request_id!r} started with adapter {began[0]!r} (that load of it); this op names "
                    f"{name!r}: every op of a step-wise request runs with the adapter it started with; start it again"
                )

    def record(self, name: str | None, result: Any, live: Any) -> None:
        """A step-wise request started: remember its adapter; forget those no longer live."""
        for request_id in [r for r in self.started if r not in live]:
            del self.started[request_id]
        if isinstance(result, dict) and "request_id" in result and result["request_id"] in live:
            self.started[result["request_id"]] = (name, self.loads.get(name, 0) if name else 0)
