"""TransformersRunner in the pools of a portable backend: generation, sleep levels, reloads.

Driven like the worker drives it (tests/runners/conftest.py:Pools): allocate per tag inside
its pool, track, sleep with the plan the state machine computes, wake, reload.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omni_core.runners.base import RunnerArgumentError, load_runner_class
from omni_core.runners.synthetic import tensor_bytes
from omni_core.runners.transformers_runner import TransformersRunner
from omni_core.runners.weights import own_storage

from .conftest import CPU, Pools

PROMPT = [5, 6, 7, 8, 9, 10, 11]
SAMPLED = {
    "prompt_ids": PROMPT,
    "max_new_tokens": 12,
    "sampling": {"temperature": 1.0, "seed": 7},
    "stop_at_eos": False,
}
GREEDY = {"prompt_ids": PROMPT, "max_new_tokens": 12, "stop_at_eos": False}


def runner_in_pools(directory: Path, **args) -> Pools:
    return Pools(TransformersRunner(CPU, model=str(directory), **{"max_seq_len": 64, **args}))


def weights_digest(runner: TransformersRunner) -> str:
    """Every byte of the weights pool, non-persistent buffers (rotary inv_freq) included."""
    digest = hashlib.sha256()
    for tensor in runner.tensors("weights"):
        digest.update(tensor_bytes(tensor))
    return digest.hexdigest()


@pytest.fixture(scope="module")
def qwen2(checkpoints) -> Pools:
    return runner_in_pools(checkpoints["qwen2"], max_batch=3)


def test_registered_as_builtin():
    assert load_runner_class("transformers") is TransformersRunner


def test_greedy_equals_generate_and_batch_rows_equal_single_prompts(qwen2, checkpoints):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(checkpoints["qwen2"]), local_files_only=True)
    own_storage([reference])  # as the runner: CPU kernels choose their path by the weights' alignment
    expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None)[
        0, len(PROMPT) :
    ].tolist()
    out = qwen2.runner.execute(GREEDY)
    assert out["token_ids"] == expected and out["finish_reason"] == "length" and out["prompt_tokens"] == 7
    prompts = [PROMPT, [40, 41], [100, 3, 4, 5]]  # unequal lengths: left padding and a mask
    batch = qwen2.runner.execute({"prompt_ids": prompts, "max_new_tokens": 12, "stop_at_eos": False})
    assert batch["token_ids"][0] == expected
    assert batch["token_ids"] == [qwen2.runner.execute({**GREEDY, "prompt_ids": p})["token_ids"] for p in prompts]


def test_sampling_is_seeded(qwen2):
    first = qwen2.runner.execute(SAMPLED)["token_ids"]
    assert qwen2.runner.execute(SAMPLED)["token_ids"] == first
    other = qwen2.runner.execute({**SAMPLED, "sampling": {"temperature": 1.0, "seed": 8}})["token_ids"]
    assert other != first
    top1 = qwen2.runner.execute({**SAMPLED, "sampling": {"temperature": 0.5, "seed": 8, "top_k": 1}})
    assert top1["token_ids"] == qwen2.runner.execute(GREEDY)["token_ids"]


def test_text_prompts_go_through_the_tokenizer(qwen2):
    out = qwen2.runner.execute({"prompt": ["The quick brown fox", "Level two"], "max_new_tokens": 4})
    tokenizer = qwen2.runner.tokenizer
    assert out["prompt_tokens"] == [len(tokenizer(text)["input_ids"]) for text in ("The quick brown fox", "Level two")]
    assert out["text"] == [tokenizer.decode(ids) for ids in out["token_ids"]]


@pytest.mark.parametrize("family", ["qwen2", "llama"])  # tied and untied embeddings
def test_sleep_levels_restore_every_byte(family, checkpoints):
    pools = runner_in_pools(checkpoints[family])
    runner = pools.runner
    tokens, digest = runner.execute(SAMPLED)["token_ids"], weights_digest(runner)
    pools.sleep(1)
    assert pools.backend.usage() == {"weights": 0, "kv_cache": 0}
    pools.wake()
    assert weights_digest(runner) == digest and runner.execute(SAMPLED)["token_ids"] == tokens
    assert "model.rotary_emb.inv_freq" in runner.buffers_to_save()  # computed at load: no checkpoint has it
    pools.sleep(2)
    pools.wake()
    assert runner.execute(SAMPLED)["token_ids"] != tokens  # level 2 kept nothing: zeros until reloaded
    pools.reload()
    assert weights_digest(runner) == digest and runner.execute(SAMPLED)["token_ids"] == tokens


def test_reload_from_another_checkpoint_and_back(checkpoints):
    pools, other = runner_in_pools(checkpoints["qwen2"]), runner_in_pools(checkpoints["qwen2-seed1"])
    runner = pools.runner
    tokens, digest = runner.execute(SAMPLED)["token_ids"], weights_digest(runner)
    pools.reload(str(checkpoints["qwen2-seed1"]))  # an RL weight update, in place
    assert weights_digest(runner) == weights_digest(other.runner)
    assert runner.execute(SAMPLED)["token_ids"] == other.runner.execute(SAMPLED)["token_ids"] != tokens
    report = runner.last_reload
    tensors = load_file(checkpoints["qwen2-seed1"] / "model.safetensors")
    file_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert report.reload_bytes == file_bytes and report.tensors == 26 and report.gb_per_s > 0
    assert report.source == str(checkpoints["qwen2-seed1"])
    pools.reload(None)
    assert weights_digest(runner) == digest and runner.execute(SAMPLED)["token_ids"] == tokens


def _broken_copy(source: Path, target: Path, change: str) -> Path:
    """seed-1 weights, valid but for one change: a reload that wrote before validating
    everything would leave the seed-1 tensors before the bad one behind."""
    shutil.copytree(source, target)
    tensors = load_file(source / "model.safetensors")
    last = "model.norm.weight"  # late in the file and in the model's order
    if change == "shape":
        tensors[last] = torch.ones(65)
    elif change == "dtype":
        tensors = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    elif change == "missing":
        del tensors[last]
    elif change == "extra":
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.ones(128, 64)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("shape", r"tensor 'model.norm.weight' has shape \[65\], the model's is \[64\]"),
        ("dtype", r"tensor 'model.embed_tokens.weight' is BF16, the loaded checkpoint's is F32"),
        ("missing", r"tensor 'model.norm.weight' is missing"),
        ("extra", r"tensor 'model.layers.2.mlp.up_proj.weight' is not in this model"),
        ("llama", r"\(the source is a 'llama'\): tensor 'model.layers.0.self_attn.q_proj.bias' is missing"),
        ("nowhere", r"does not exist or is not a directory"),
    ],
)
def test_unusable_reload_is_refused_before_any_write(change, message, checkpoints, tmp_path):
    pools = runner_in_pools(checkpoints["qwen2"])
    runner = pools.runner
    tokens, digest = runner.execute(SAMPLED)["token_ids"], weights_digest(runner)
    if change == "llama":
        source = checkpoints["llama"]
    elif change == "nowhere":
        source = tmp_path / "nowhere"
    else:
        source = _broken_copy(checkpoints["qwen2-seed1"], tmp_path / change, change)
    with pytest.raises(RunnerArgumentError, match=message):
        runner.reload_weights(str(source))
    assert weights_digest(runner) == digest and runner.execute(SAMPLED)["token_ids"] == tokens


def test_partial_wake_refuses_to_execute(qwen2):
    tokens = qwen2.runner.execute(GREEDY)["token_ids"]
    qwen2.sleep(1)
    qwen2.wake(("weights",))
    with pytest.raises(RuntimeError, match="holds no memory: its pool is asleep"):
        qwen2.runner.execute(GREEDY)
    qwen2.wake(("kv_cache",))
    assert qwen2.runner.execute(GREEDY)["token_ids"] == tokens


def test_static_cache_lives_in_its_pool_for_good(qwen2):
    cache = qwen2.runner.tensors("kv_cache")
    layer = qwen2.runner.cache.layers[0]
    assert tuple(layer.keys.shape) == (3, 2, 64, 16)  # max_batch x kv heads x max_seq_len x head_dim
    pointers = [t.data_ptr() for t in cache]
    qwen2.runner.execute({"prompt_ids": [PROMPT] * 3, "max_new_tokens": 20})
    # Nothing allocated lazily at the first request (outside the pool), nothing replaced.
    assert [t.data_ptr() for t in qwen2.runner.tensors("kv_cache")] == pointers
    assert sum(t.numel() * t.element_size() for t in cache) == qwen2.backend.usage()["kv_cache"]


def test_weights_are_read_on_the_loading_thread(checkpoints, monkeypatch):
    """A backend's pool takes only the calling thread's allocations (torch.cuda.use_mem_pool);
    tensors materialised on transformers' loader threads would stay outside `weights`."""
    import threading

    import transformers.core_model_loading as loading

    threads: set[int] = set()
    original = loading._materialize_copy

    def recording(*args, **kwargs):
        threads.add(threading.get_ident())
        return original(*args, **kwargs)

    monkeypatch.setattr(loading, "_materialize_copy", recording)
    monkeypatch.delenv("HF_DEACTIVATE_ASYNC_LOAD", raising=False)
    Pools(TransformersRunner(CPU, model=str(checkpoints["qwen2"]), max_seq_len=32))
    assert threads == {threading.get_ident()}
    assert "HF_DEACTIVATE_ASYNC_LOAD" not in os.environ  # the switch is the loader's alone


def test_auto_cache_length_fits_the_budget(checkpoints):
    runner = TransformersRunner(CPU, model=str(checkpoints["qwen2"]), max_seq_len="auto", max_batch=2)
    per_token = 2 * 2 * 2 * 16 * 4 * 2  # K and V x layers x kv heads x head_dim x fp32 x batch
    assert runner.kv_bytes_per_token == per_token
    runner.fit_caches(100 * per_token + 5)
    assert runner.max_seq_len == 100
    runner.fit_caches(10**12)
    assert runner.max_seq_len == 256  # the model's max_position_embeddings


@pytest.mark.parametrize(
    ("payload", "error", "message"),
    [
        ([1, 2, 3], TypeError, "payload must be a dict"),
        ({"prompt_ids": [1], "temperature": 1.0}, ValueError, r"unknown payload key\(s\) \['temperature'\]"),
        ({"prompt_ids": [1], "prompt": "x"}, ValueError, "exactly one of 'prompt_ids'"),
        ({"prompt_ids": []}, TypeError, "non-empty list of token ids"),
        ({"prompt_ids": [1, 512]}, ValueError, r"ints in \[0, 512\)"),
        ({"prompt_ids": [[1]] * 4}, ValueError, "4 prompts in one request; this runner's max_batch is 3"),
        ({"prompt_ids": [1] * 60, "max_new_tokens": 5}, ValueError, "exceeds the KV cache's max_seq_len 64"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1"),
        ({"prompt_ids": [1], "sampling": "beam"}, ValueError, "sampling must be 'greedy' or"),
        ({"prompt_ids": [1], "sampling": {"temperature": 0}}, ValueError, "temperature must be a number > 0"),
        ({"prompt": ""}, TypeError, "non-empty string"),
    ],
)
def test_bad_payloads_say_what_is_wrong(qwen2, payload, error, message):
    with pytest.raises(error, match=message):
        qwen2.runner.execute(payload)


def test_bad_runner_arguments(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="not a transformers checkpoint directory"):
        TransformersRunner(CPU, model=str(tmp_path))
    with pytest.raises(ValueError, match=r"max_seq_len must be an int in 2..256"):
        TransformersRunner(CPU, model=str(checkpoints["qwen2"]), max_seq_len=1000)
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported"):
        TransformersRunner(CPU, model=str(checkpoints["qwen2"]), dtype="fp8")


def test_a_shared_memory_update_equals_a_model_loaded_with_those_weights(checkpoints):
    """P-17 in one process: a trainer's state_dict through shm buckets into the runner, checked
    first (a wrong shape writes nothing), then greedy tokens equal the other checkpoint's."""
    from omni_core.weights_sender import WeightSender
    from omni_core.workers.weight_receiver import WeightReceiver

    pools, other = runner_in_pools(checkpoints["qwen2"]), runner_in_pools(checkpoints["qwen2-seed1"])
    runner, receiver = pools.runner, WeightReceiver(CPU, 0)
    trained = load_file(checkpoints["qwen2-seed1"] / "model.safetensors")
    before = weights_digest(runner)
    with WeightSender(bucket_bytes=64 << 10) as sender:
        bad = dict(trained, **{"model.norm.weight": torch.ones(65)})
        with pytest.raises(RunnerArgumentError, match=r"'model.norm.weight' is float32 \[65\], the model's is"):
            receiver.apply(sender.share(bad), runner)
        assert weights_digest(runner) == before
        source = sender.share(trained)
        assert len(source.buckets) > 1
        receiver.apply(source, runner)
    assert weights_digest(runner) == weights_digest(other.runner)
    assert runner.execute(GREEDY)["token_ids"] == other.runner.execute(GREEDY)["token_ids"]


def test_the_cache_goes_under_the_name_the_models_forward_takes() -> None:
    """transformers 5.25 renamed forward's `past_key_values` to `cache` (the old name warns, and
    goes in 5.40); the runner passes its cache under whichever the installed model declares."""
    from transformers.models.llama.modeling_llama import LlamaForCausalLM

    from omni_core.runners.transformers_runner import cache_keyword

    def renamed(input_ids=None, attention_mask=None, cache=None, use_cache=None):  # type: ignore[no-untyped-def]
        return None

    def old(input_ids=None, past_key_values=None, use_cache=None):  # type: ignore[no-untyped-def]
        return None

    assert (cache_keyword(renamed), cache_keyword(old)) == ("cache", "past_key_values")
    installed = cache_keyword(LlamaForCausalLM.forward)
    import inspect

    assert installed in inspect.signature(LlamaForCausalLM.forward).parameters


def test_a_save_loads_as_the_runners_own_model_and_reloads_bit_for_bit(checkpoints, tmp_path):
    """SaveWeights' runner half: an updated runner saves (parts of a third each, with an index),
    and the save is a checkpoint this runner loads as its `model` (config and tokenizer copied)
    and reloads from, both bit for bit equal to the updated weights."""
    pools, other = runner_in_pools(checkpoints["qwen2"]), runner_in_pools(checkpoints["qwen2-seed1"])
    runner = pools.runner
    pools.reload(str(checkpoints["qwen2-seed1"]))
    updated, tokens = weights_digest(runner), runner.execute(GREEDY)["token_ids"]
    saved = tmp_path / "saved"
    saved.mkdir()
    total_bytes = sum(
        t.numel() * t.element_size() for t in load_file(checkpoints["qwen2"] / "model.safetensors").values()
    )
    files = runner.save_weights(saved, total_bytes // 3)
    assert "config.json" in files and "model.safetensors.index.json" in files
    parts = sorted(p.name for p in saved.glob("*.safetensors"))
    biggest = max(t.numel() * t.element_size() for t in load_file(checkpoints["qwen2"] / "model.safetensors").values())
    assert len(parts) >= 3 and all((saved / p).stat().st_size <= max(total_bytes // 3, biggest) + 4096 for p in parts)
    assert runner.weights_origin() == str(checkpoints["qwen2"])

    loaded = runner_in_pools(saved).runner
    assert weights_digest(loaded) == updated and loaded.execute(GREEDY)["token_ids"] == tokens
    other.reload(str(saved))
    assert weights_digest(other.runner) == updated


def test_dummy_weights_read_no_file_refuse_a_reload_of_their_own_and_take_an_update(checkpoints, tmp_path):
    """load_format 'dummy' (vLLM's): the architecture of config.json with random weights, no
    weights file read (the directory has none); a reload of its own weights is refused before
    anything is written, naming the format; an update of a real checkpoint's tensors makes it
    that checkpoint, and a reload from a directory too."""
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    for path in checkpoints["qwen2"].iterdir():
        if not path.name.endswith(".safetensors"):
            shutil.copyfile(path, config_only / path.name)
    pools, real = runner_in_pools(config_only, load_format="dummy"), runner_in_pools(checkpoints["qwen2"])
    runner = pools.runner
    assert runner.dummy_weights and runner.weights_origin() is None
    assert weights_digest(runner) != weights_digest(real.runner)
    before = weights_digest(runner)
    with pytest.raises(RunnerArgumentError, match="Model reloading with dummy format"):
        runner.reload_weights(None)
    assert weights_digest(runner) == before
    runner.update_weights(load_file(checkpoints["qwen2"] / "model.safetensors").items())
    assert weights_digest(runner) == weights_digest(real.runner)
    assert runner.execute(GREEDY)["token_ids"] == real.runner.execute(GREEDY)["token_ids"]
    other = runner_in_pools(config_only, load_format="dummy")
    other.reload(str(checkpoints["qwen2"]))
    assert weights_digest(other.runner) == weights_digest(real.runner)
    with pytest.raises(ValueError, match="load_format must be one of"):
        TransformersRunner(CPU, model=str(config_only), load_format="pt")
