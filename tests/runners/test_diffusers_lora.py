"""LoRA adapters on the diffusers runner (P-20), in the pools of a portable backend and driven
as the worker drives them (check, load inside the `adapters` pool, track): Stable Diffusion's
UNet through diffusers' own `load_lora_weights`, the DiT's transformer through PEFT. The image
with the adapter differs from the one without, equals a stock pipeline's with the same adapter
applied, byte for byte, and survives a level-1 sleep bit for bit; a step-wise request keeps its
adapter; adapters of another rank or model are refused naming what, with nothing loaded."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from omni_core.models.lora import make_diffusers_lora
from omni_core.protocol import AddAdapter
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import tensor_bytes
from omni_core.runners.weights import own_storage

from .conftest import Pools
from .test_diffusers_runner import DIT, SD, runner_in_pools

pytest.importorskip("peft", reason="needs the models extra: pip install -e '.[models]'")

TAGS = ("weights", "kv_cache", "requests", "adapters")
MODULES = ("to_q", "to_v")
REQUESTS = {"dit": DIT, "sd": SD}


def _command(source: Path, name: str = "style", **fields) -> AddAdapter:
    args = {"rank": 4, "target_modules": MODULES} | fields
    return AddAdapter(task_id=f"add-{name}", epoch=0, name=name, adapter_id=1, source=str(source), **args)


def _add(pools: Pools, command: AddAdapter) -> None:
    """What the rank's shell does for an AddAdapter (omni_core/workers/process.py)."""
    pools.runner.check_adapter(command)
    with pools.backend.pool("adapters"):
        pools.runner.add_adapter(command)
    pools.backend.track("adapters", pools.runner.tensors("adapters"))


def _reference(family: str, checkpoint: Path, lora: Path) -> str:
    """The stock pipeline with the same adapter: diffusers' load_lora_weights (SD), PEFT (DiT)."""
    import diffusers
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict
    from safetensors.torch import load_file

    pipeline = diffusers.DiffusionPipeline.from_pretrained(str(checkpoint), local_files_only=True)
    own_storage([c for n, c in pipeline.components.items() if n in ("transformer", "vae", "unet", "text_encoder")])
    pipeline.set_progress_bar_config(disable=True)
    request = REQUESTS[family]
    if family == "sd":
        pipeline.load_lora_weights(str(lora), adapter_name="style")
        kwargs = {"prompt": SD["prompt"], "negative_prompt": SD["negative_prompt"]}
    else:
        state = {
            k.removeprefix("transformer."): v
            for k, v in load_file(str(lora / "pytorch_lora_weights.safetensors")).items()
        }
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=list(MODULES)), pipeline.transformer)
        set_peft_model_state_dict(pipeline.transformer, state)
        kwargs = {"class_labels": [DIT["class_label"]]}
    images = pipeline(
        generator=torch.Generator().manual_seed(request["seed"]), num_inference_steps=8, output_type="pt", **kwargs
    ).images
    return hashlib.sha256(tensor_bytes(images)).hexdigest()


@pytest.mark.parametrize("family", ["sd", "dit"])
def test_an_adapter_changes_the_image_as_the_stock_pipeline_does_and_survives_level_one(
    family, checkpoints, tmp_path
) -> None:
    lora = Path(make_diffusers_lora(checkpoints[family], tmp_path / "lora", seed=1).path)
    pools = runner_in_pools(checkpoints[family], TAGS)
    runner, request = pools.runner, REQUESTS[family]
    base = runner.execute(dict(request))["sha256"]
    _add(pools, _command(lora))
    assert pools.backend.usage()["adapters"] > 0
    assert not {id(t) for t in runner.tensors("adapters")} & {id(t) for t in runner.tensors("weights")}
    tuned = runner.execute_adapter(dict(request), "style")["sha256"]
    assert tuned != base and tuned == _reference(family, checkpoints[family], lora)
    assert runner.execute(dict(request))["sha256"] == base  # no adapter named: every one off

    pools.sleep(1)
    assert pools.backend.usage()["adapters"] == 0  # offloaded with the weights
    pools.wake()
    assert runner.execute_adapter(dict(request), "style")["sha256"] == tuned  # bit for bit
    assert runner.execute(dict(request))["sha256"] == base

    started = runner.execute_adapter({"op": "start", **request}, "style")
    with pytest.raises(ValueError, match="started with adapter 'style'"):
        runner.execute({"op": "step", "request_id": started["request_id"], "steps": 2})
    assert runner.execute_adapter({"op": "finish", "request_id": started["request_id"]}, "style")["sha256"] == tuned
    runner.remove_adapter("style")
    assert runner.tensors("adapters") == [] and runner.execute(dict(request))["sha256"] == base


def test_bad_diffusion_adapters_are_refused_naming_what(checkpoints, tmp_path) -> None:
    pools = runner_in_pools(checkpoints["sd"], TAGS)
    lora = Path(make_diffusers_lora(checkpoints["sd"], tmp_path / "lora", seed=1).path)
    other = Path(make_diffusers_lora(checkpoints["dit"], tmp_path / "dit-lora", seed=1).path)
    cases = [
        (_command(tmp_path / "none"), "is not a diffusers LoRA directory"),
        (_command(lora, rank=8), "at rank 8: an adapter of another model or rank"),
        (
            _command(lora, target_modules=("to_q",)),
            r"its file targets \['to_q', 'to_v'\], the AddAdapter says \['to_q'\]",
        ),
        (_command(other), "adapts no linear module of this pipeline's unet"),
    ]
    for command, match in cases:
        with pytest.raises(RunnerArgumentError, match=match):
            pools.runner.check_adapter(command)
    assert pools.runner.tensors("adapters") == []  # nothing loaded
    with pytest.raises(RunnerArgumentError, match="takes no LoRA adapters"):
        runner_in_pools(checkpoints["ddpm"]).runner.check_adapter(_command(lora))


def test_a_batch_steps_with_every_adapter_off_and_refuses_a_request_started_with_one(checkpoints, tmp_path) -> None:
    """Step-wise ops of several requests run together with no adapter: a request that started
    with one fails alone, naming it, and the others' images are those without an adapter."""
    lora = Path(make_diffusers_lora(checkpoints["dit"], tmp_path / "lora", seed=1).path)
    pools = runner_in_pools(checkpoints["dit"], TAGS)
    runner = pools.runner
    base = runner.execute(dict(DIT))["sha256"]
    _add(pools, _command(lora))
    tuned = runner.execute_adapter({"op": "start", **DIT}, "style")["request_id"]
    plain = [runner.execute({"op": "start", **DIT})["request_id"] for _ in range(2)]
    outputs = runner.execute_batch([{"op": "finish", "request_id": r} for r in (tuned, *plain)])
    assert isinstance(outputs[0], ValueError) and "started with adapter 'style'" in str(outputs[0])
    assert [o["sha256"] for o in outputs[1:]] == [base, base]
    assert runner.execute_adapter({"op": "finish", "request_id": tuned}, "style")["sha256"] != base


def test_pipelines_whose_linear_modules_stream_or_shard_take_no_adapter(checkpoints, tmp_path) -> None:
    from omni_core.runners.block_offload import OFFLOAD_TAG
    from omni_core.runners.diffusers_lora import adapter_problem

    lora = Path(make_diffusers_lora(checkpoints["dit"], tmp_path / "lora", seed=1).path)
    tags = ("weights", OFFLOAD_TAG, "kv_cache", "requests")
    streamed = runner_in_pools(checkpoints["dit"], tags, offload="layerwise")
    with pytest.raises(RunnerArgumentError, match="offload='layerwise' streams the denoiser's blocks"):
        streamed.runner.check_adapter(_command(lora))
    assert "tensor-parallel DiT" in (adapter_problem("dit", "none", 2, "tensor") or "")
    assert adapter_problem("dit", "none", 2, "cfg") is None  # each rank holds every module whole
