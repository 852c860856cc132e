"""LoRA adapters on the transformers runner through PEFT (P-20), in the pools of a portable
backend, driven as the worker drives it (check, load inside the `adapters` pool, track): an
adapter's greedy tokens equal a PEFT model's, token for token; a level-1 sleep and wake keep
them; a level-2 sleep, reload and add again give them back; bad adapters are refused naming
what, with nothing loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from omni_core.models.lora import make_lora
from omni_core.protocol import AddAdapter
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.transformers_runner import TransformersRunner
from omni_core.runners.weights import own_storage

from .conftest import CPU, Pools

pytest.importorskip("peft", reason="needs the models extra: pip install -e '.[models]'")

GREEDY = {"prompt_ids": [5, 6, 7, 8, 9, 10, 11], "max_new_tokens": 12, "stop_at_eos": False}
TAGS = ("weights", "kv_cache", "adapters")
MODULES = ("q_proj", "v_proj")


def _command(source: Path, name: str = "sql", **fields) -> AddAdapter:
    args = {"rank": 4, "target_modules": MODULES} | fields
    return AddAdapter(task_id=f"add-{name}", epoch=0, name=name, adapter_id=1, source=str(source), **args)


def _add(pools: Pools, command: AddAdapter) -> None:
    """What the rank's shell does for an AddAdapter (omni_core/workers/process.py)."""
    runner = pools.runner
    runner.check_adapter(command)
    with pools.backend.pool("adapters"):
        runner.add_adapter(command)
    pools.backend.track("adapters", runner.tensors("adapters"))


@pytest.fixture(scope="module")
def lora_dir(checkpoints, tmp_path_factory) -> Path:
    return Path(make_lora(checkpoints["qwen2"], tmp_path_factory.mktemp("lora") / "sql", seed=1).path)


@pytest.fixture()
def pools(checkpoints) -> Pools:
    return Pools(TransformersRunner(CPU, model=str(checkpoints["qwen2"]), max_seq_len=64), TAGS)


def _peft_tokens(checkpoints, lora_dir: Path) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(checkpoints["qwen2"]), local_files_only=True)
    own_storage([reference])  # as the runner: CPU kernels choose their path by the weights' alignment
    reference = PeftModel.from_pretrained(reference, str(lora_dir)).eval()
    prompt = torch.tensor([GREEDY["prompt_ids"]])
    with torch.no_grad():
        out = reference.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    return out[0, prompt.shape[1] :].tolist()


def test_adapter_tokens_equal_peft_and_survive_level_one_and_level_two(pools, checkpoints, lora_dir) -> None:
    runner = pools.runner
    base = runner.execute(GREEDY)["token_ids"]
    _add(pools, _command(lora_dir))
    tuned = runner.execute_adapter(GREEDY, "sql")["token_ids"]
    assert tuned == _peft_tokens(checkpoints, lora_dir) and tuned != base
    assert runner.execute(GREEDY)["token_ids"] == base  # no adapter named: none applied
    runner.execute_adapter(GREEDY, "sql")
    # The rank runs plain requests in flight together through execute_batch: the adapter the
    # request before set is not applied to them either.
    assert [out["token_ids"] for out in runner.execute_batch([GREEDY, GREEDY])] == [base, base]
    assert pools.backend.usage()["adapters"] > 0
    assert not {id(t) for t in runner.tensors("adapters")} & {id(t) for t in runner.tensors("weights")}

    pools.sleep(1)
    assert pools.backend.usage()["adapters"] == 0
    pools.wake()
    assert runner.execute_adapter(GREEDY, "sql")["token_ids"] == tuned
    assert runner.execute(GREEDY)["token_ids"] == base

    pools.sleep(2)
    pools.wake()
    pools.reload()
    assert runner.execute(GREEDY)["token_ids"] == base  # the discarded adapter is not applied
    _add(pools, _command(lora_dir))  # added again, as after ListAdapters said gone
    assert runner.execute_adapter(GREEDY, "sql")["token_ids"] == tuned
    runner.remove_adapter("sql")
    assert runner.tensors("adapters") == [] and runner.execute(GREEDY)["token_ids"] == base


def _refused(pools: Pools, command: AddAdapter, match: str) -> None:
    with pytest.raises(RunnerArgumentError, match=match):
        pools.runner.check_adapter(command)
    assert pools.runner.tensors("adapters") == []  # nothing loaded


def test_bad_adapters_are_refused_naming_what(pools, checkpoints, lora_dir, tmp_path) -> None:
    _refused(pools, _command(tmp_path / "none"), "is not a PEFT adapter directory")
    _refused(pools, _command(lora_dir, rank=8), "its directory holds rank 4, the AddAdapter says 8")
    other = Path(make_lora(checkpoints["llama"], tmp_path / "llama-lora").path)
    _refused(pools, _command(other), "was made for a LlamaForCausalLM, and this stage serves a Qwen2ForCausalLM")
    bent = tmp_path / "bent"
    bent.mkdir()
    (bent / "adapter_model.safetensors").write_bytes((lora_dir / "adapter_model.safetensors").read_bytes())
    config = json.loads((lora_dir / "adapter_config.json").read_text())
    (bent / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["gate_projx"]}))
    _refused(pools, _command(bent, target_modules=("gate_projx",)), r"targets modules \['gate_projx'\] this model")
    assert pools.runner.execute(GREEDY)["finish_reason"] == "length"  # serving on


def test_models_make_lora_writes_an_adapter_peft_loads(tmp_path, capsys) -> None:
    from peft import PeftConfig

    from omni_core.cli import main as cli_main

    target = tmp_path / "qwen2"
    assert cli_main(["models", "make", "qwen2", "tiny", str(target), "--lora", "--quiet", "--seed", "2"]) == 0
    assert "LoRA rank 4 on q_proj,v_proj, seed 2" in capsys.readouterr().out
    config = PeftConfig.from_pretrained(str(target / "lora"))
    assert (config.r, sorted(config.target_modules), config.base_model_name_or_path) == (4, list(MODULES), str(target))
    assert cli_main(["models", "make", "dit", "tiny", str(tmp_path / "dit"), "--lora", "--quiet"]) == 0
    assert "LoRA rank 4 on to_q,to_v, seed 0" in capsys.readouterr().out
    assert (tmp_path / "dit" / "lora" / "pytorch_lora_weights.safetensors").is_file()  # diffusers' format
    assert cli_main(["models", "make", "ddpm", "tiny", str(tmp_path / "ddpm"), "--lora", "--quiet"]) == 2
    assert "is not a transformers checkpoint (no config.json): a LoRA needs its base model" in capsys.readouterr().err


def _refit(pools: Pools, receiver, command: AddAdapter) -> None:
    """What the rank's shell does for an AddAdapter with tensors: the receiver checks every
    tensor and opens every bucket, then the runner writes inside the adapters' pool."""
    runner = pools.runner
    runner.check_adapter(command)
    tensors = receiver.open_adapter(command, runner)
    with pools.backend.pool("adapters"):
        runner.write_adapter(command, tensors())
    pools.backend.track("adapters", runner.tensors("adapters"))


def _tensors_of(lora: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(lora / "adapter_model.safetensors"))


def _tensor_command(source, name: str = "sql", **fields) -> AddAdapter:
    return _command(Path("tensors:shm"), name, tensors=source, **fields)


def test_an_adapter_only_refit_over_shm_gives_peft_tokens_of_the_new_weights(
    pools, checkpoints, lora_dir, tmp_path
) -> None:
    from omni_core.weights_sender import WeightSender
    from omni_core.workers.weight_receiver import WeightReceiver

    receiver, sender = WeightReceiver(CPU, 0), WeightSender()
    new = Path(make_lora(checkpoints["qwen2"], tmp_path / "sql-2", seed=2).path)
    try:
        runner = pools.runner
        _add(pools, _command(lora_dir))
        weights = [t.clone() for t in runner.tensors("weights")]
        _refit(pools, receiver, _tensor_command(sender.share(_tensors_of(new)), version=2))
        refit = runner.execute_adapter(GREEDY, "sql")["token_ids"]
        assert refit == _peft_tokens(checkpoints, new) != _peft_tokens(checkpoints, lora_dir)
        assert all(torch.equal(a, b) for a, b in zip(weights, runner.tensors("weights"), strict=True))  # base untouched
        pools.sleep(1)
        pools.wake()
        assert runner.execute_adapter(GREEDY, "sql")["token_ids"] == refit  # level 1 keeps the refit

        # A new adapter from tensors alone: alpha as PEFT's config says (make_lora: the rank).
        _refit(pools, receiver, _tensor_command(sender.share(_tensors_of(new)), "fresh", lora_alpha=4.0))
        assert runner.execute_adapter(GREEDY, "fresh")["token_ids"] == refit

        other = Path(make_lora(checkpoints["qwen2"], tmp_path / "rank-8", rank=8).path)
        with pytest.raises(
            RunnerArgumentError, match=r"lora_A.weight' is float32 \[8, 64\], the model's is float32 \[4, 64\]"
        ):
            _refit(pools, receiver, _tensor_command(sender.share(_tensors_of(other)), version=3))
        assert runner.execute_adapter(GREEDY, "sql")["token_ids"] == refit  # refused: nothing written
    finally:
        sender.close()
        receiver.close()
