"""The vllm runner on CPU, with vLLM replaced at the narrowest seam (`VllmEngine`).

What runs for real here: argument checks, the engine arguments the runner hands vLLM, the
order in which vLLM's construction opens omni-core's pools, the KV budget arithmetic, the
request format and the sampling parameters, the sleep/wake hooks and the reload checks on
real tiny safetensors checkpoints. vLLM itself runs on the device
(benchmarks/results/vllm_gpu.md, `python -m benchmarks.vllm_stage`).
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from omni_core.engine.spec import StageSpec
from omni_core.runners import vllm_runner
from omni_core.runners.base import MemoryBudget, RunnerArgumentError
from omni_core.runners.vllm_runner import (
    Completion,
    VllmRunner,
    compare_checkpoints,
    current_binding,
    kv_cache_bytes,
)
from omni_core.runners.weights import read_headers
from omni_core.workers.backends import PortableBackend

CPU = torch.device("cpu")


class FakeModelRunner:
    def __init__(self) -> None:
        self.model = torch.nn.Module()
        self.model.register_buffer("cos_sin_cache", torch.arange(4.0))
        self.reloads: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}  # what vLLM's model.load_weights was given
        self.kv_wakes = 0

    def get_model(self) -> torch.nn.Module:
        return self.model

    def reload_weights(self, *, weights_path: str | None = None, weights_iterator: Any = None, **_: Any) -> None:
        if weights_iterator is None:
            self.reloads.append(weights_path)
            return
        self.reloads.append("iterator")
        for name, tensor in weights_iterator:  # the tensors are valid during the call only: copy
            self.loaded[name] = tensor.clone()

    def post_kv_cache_wake_up(self) -> None:
        self.kv_wakes += 1


class FakeEngine:
    """Does what vllm.LLM does with our worker class: load weights inside the weights pool,
    ask for the KV budget, allocate the KV cache inside its pool, register the worker."""

    made: ClassVar[list[FakeEngine]] = []

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        self.kwargs = engine_kwargs
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        self.calls: list[Any] = []
        self.prefix_resets = 0
        self.reset_ok = True
        binding = current_binding()
        with binding.open_pool("weights"):
            self.calls.append("weights")
        if binding.budget is not None:
            binding.kv_cache_bytes = kv_cache_bytes(
                binding.budget, {"reserved_bytes.all.peak": 300, "reserved_bytes.all.current": 100}
            )
        with binding.open_pool("kv_cache"):
            self.calls.append("kv_cache")
        binding.worker = type("Worker", (), {"model_runner": FakeModelRunner()})()
        FakeEngine.made.append(self)

    def tokenizer(self) -> Any:
        return None

    def generate(self, rows: list[list[int]], sampling_params: list[dict[str, Any]]) -> list[Completion]:
        assert len(sampling_params) == len(rows), "one SamplingParams per prompt"
        self.calls.append(("generate", rows, sampling_params))
        return [Completion([r[0] + 1, r[0] + 2], "length") for r in rows]

    def reset_prefix_cache(self) -> bool:
        self.prefix_resets += 1
        return self.reset_ok


@pytest.fixture
def fake_vllm(monkeypatch):
    FakeEngine.made.clear()
    monkeypatch.setattr(VllmRunner, "engine_factory", FakeEngine)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return FakeEngine


@contextmanager
def _recording_pool(opened: list[str], tag: str):
    opened.append(tag)
    yield


def _loaded(model: Path, budget: MemoryBudget | None = None, **runner_args: Any) -> tuple[VllmRunner, list[str]]:
    runner = VllmRunner(CPU, model=str(model), **runner_args)
    opened: list[str] = []
    runner.load(lambda tag: _recording_pool(opened, tag), ["weights", "kv_cache"], budget)
    return runner, opened


def test_bad_arguments_are_refused_before_anything_loads(checkpoints, tmp_path):
    with pytest.raises(ValueError, match=r"no config\.json"):
        VllmRunner(CPU, model=str(tmp_path))
    with pytest.raises(ValueError, match=r"max_model_len must be an int in 2\.\.256"):
        VllmRunner(CPU, model=str(checkpoints["qwen2"]), max_model_len=100_000)
    with pytest.raises(ValueError, match=r"engine_args \['worker_cls'\] are set by the vllm runner"):
        VllmRunner(CPU, model=str(checkpoints["qwen2"]), engine_args={"worker_cls": "x.Y"})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VllmRunner(CPU, model=str(checkpoints["qwen2"]), gpu_memory_utilization=1.5)


def test_load_hands_vllm_our_worker_and_pools_in_vllms_order(fake_vllm, checkpoints):
    budget = MemoryBudget(0.4, lambda: 1000)
    runner, opened = _loaded(checkpoints["qwen2"], budget, max_model_len=128, attention_backend="TRITON_ATTN")
    engine = fake_vllm.made[-1]
    assert opened == ["weights", "kv_cache"] and engine.calls == ["weights", "kv_cache"]
    assert engine.multiprocessing == "0"  # the engine core in this (the rank's) process
    kwargs = engine.kwargs
    assert kwargs["worker_cls"] == vllm_runner.WORKER_CLS
    assert kwargs["distributed_executor_backend"] == "uni" and kwargs["tensor_parallel_size"] == 1
    assert kwargs["gpu_memory_utilization"] == 0.4  # the stage's fraction, not the runner's default
    assert kwargs["attention_config"] == {"backend": "TRITON_ATTN"} and kwargs["max_model_len"] == 128
    # the budget the process has left, minus the activation peak torch's cache gave back
    assert runner.kv_cache_bytes == 1000 - 200
    assert runner.tensors("weights") == [] and runner.buffers_to_save().keys() == {"cos_sin_cache"}
    with pytest.raises(RuntimeError, match=r"constructed by VllmRunner\.load"):
        current_binding()  # the slot is cleared once the engine exists


def test_several_ranks_form_one_tensor_parallel_group(fake_vllm, checkpoints, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    _loaded(checkpoints["qwen2"])
    kwargs = fake_vllm.made[-1].kwargs
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["gpu_memory_utilization"] == 0.9  # no fraction: the runner's own setting


def test_kv_budget_never_negative():
    assert kv_cache_bytes(MemoryBudget(0.5, lambda: 100), {"reserved_bytes.all.peak": 500}) == 0
    assert kv_cache_bytes(MemoryBudget(0.5, lambda: 100), {}) == 100


def test_only_allocator_backends_and_vllms_tags(fake_vllm, checkpoints):
    runner = VllmRunner(CPU, model=str(checkpoints["qwen2"]))
    with pytest.raises(ValueError, match="needs an allocator backend"):
        runner.load(PortableBackend(CPU).pool, ["weights", "kv_cache"], None)
    with pytest.raises(ValueError, match=r"allocates the tags \['weights', 'kv_cache'\].*the stage has \['weights'\]"):
        runner.load(lambda tag: _recording_pool([], tag), ["weights"], None)
    assert not fake_vllm.made


def test_requests_map_onto_vllm_sampling(fake_vllm, checkpoints):
    runner, _ = _loaded(checkpoints["qwen2"], max_num_seqs=2)
    engine = fake_vllm.made[-1]
    out = runner.execute({"prompt_ids": [5, 6, 7], "max_new_tokens": 2})
    assert out == {"token_ids": [6, 7], "finish_reason": "length", "prompt_tokens": 3}
    _, rows, (params,) = engine.calls[-1]
    assert rows == [[5, 6, 7]]
    assert params == {
        "max_tokens": 2,
        "ignore_eos": False,
        "detokenize": False,
        "temperature": 0.0,
        "seed": None,
        "top_k": 0,
    }
    batched = runner.execute(
        {"prompt_ids": [[1], [2]], "stop_at_eos": False, "sampling": {"temperature": 0.7, "seed": 9, "top_k": 5}}
    )
    assert batched["token_ids"] == [[2, 3], [3, 4]]
    _, _, (params, _) = engine.calls[-1]
    assert (params["temperature"], params["seed"], params["top_k"], params["ignore_eos"]) == (0.7, 9, 5, True)
    calls = len(engine.calls)
    with pytest.raises(ValueError, match="max_batch is 2"):
        runner.execute({"prompt_ids": [[1], [2], [3]]})
    with pytest.raises(ValueError, match="exceeds the KV cache's max_seq_len"):
        runner.execute({"prompt_ids": [1], "max_new_tokens": 10_000})
    assert len(engine.calls) == calls  # refused before vLLM saw them


def test_reset_prefix_cache_is_vllms_own(fake_vllm, checkpoints):
    runner, _ = _loaded(checkpoints["qwen2"])
    engine = fake_vllm.made[-1]
    assert runner.reset_prefix_cache() is None  # vLLM does not say how many blocks it dropped
    assert engine.prefix_resets == 1
    engine.reset_ok = False
    with pytest.raises(RuntimeError, match="vLLM refused to reset its prefix cache"):
        runner.reset_prefix_cache()


def test_prefix_cache_reset_before_the_kv_cache_goes_and_rebuilt_after(fake_vllm, checkpoints):
    runner, _ = _loaded(checkpoints["qwen2"])
    engine, model_runner = fake_vllm.made[-1], runner.worker.model_runner
    runner.before_sleep(frozenset({"weights"}), frozenset())
    assert engine.prefix_resets == 0  # the KV cache stays: its prefix blocks stay valid
    runner.before_sleep(frozenset({"weights"}), frozenset({"kv_cache"}))
    assert engine.prefix_resets == 1
    engine.reset_ok = False
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        runner.before_sleep(frozenset(), frozenset({"weights", "kv_cache"}))
    runner.after_wake(frozenset({"weights"}))
    assert model_runner.kv_wakes == 0
    runner.after_wake(frozenset({"kv_cache"}))
    assert model_runner.kv_wakes == 1


def test_reload_checks_every_header_before_vllm_writes(fake_vllm, checkpoints, tmp_path):
    runner, _ = _loaded(checkpoints["qwen2"])
    reloads = runner.worker.model_runner.reloads
    runner.reload_weights(str(checkpoints["qwen2-seed1"]))  # same architecture: an RL weight update
    runner.reload_weights(None)  # the runner's own checkpoint
    assert reloads == [str(checkpoints["qwen2-seed1"]), str(checkpoints["qwen2"])]
    assert runner.last_reload is not None and runner.last_reload.reload_bytes > 0
    with pytest.raises(RunnerArgumentError, match="has no tensor"):
        runner.reload_weights(str(checkpoints["llama"]))
    with pytest.raises(RunnerArgumentError, match="does not exist"):
        runner.reload_weights(str(tmp_path / "missing"))
    with pytest.raises(RunnerArgumentError, match="must be a checkpoint directory path"):
        runner.reload_weights(7)  # type: ignore[arg-type]
    assert len(reloads) == 2  # none of the refused sources reached vLLM


def test_a_reshaped_tensor_is_named(checkpoints, tmp_path):
    from safetensors.torch import load_file, save_file

    source = tmp_path / "reshaped"
    shutil.copytree(checkpoints["qwen2"], source)
    tensors = load_file(str(source / "model.safetensors"))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 3, dtype=tensors[name].dtype)
    save_file(tensors, str(source / "model.safetensors"))
    with pytest.raises(RunnerArgumentError, match=rf"tensor '{name}' is .*\[3, 3\], the loaded model's is"):
        compare_checkpoints(read_headers(checkpoints["qwen2"]), read_headers(source), str(source))


def test_demo_refuses_vllm_where_it_cannot_run(capsys):
    from omni_core.cli import main

    assert main(["demo", "--llm-runner", "vllm"]) == 2
    assert "needs --device cuda and --size large" in capsys.readouterr().err


def test_an_update_goes_through_vllms_loader_and_is_checked_first(fake_vllm, checkpoints):
    """P-17 into vLLM: the checkpoint's names (a trainer's state_dict), handed to vLLM's
    reload_weights as an iterator (its model.load_weights fuses and quantizes); a tensor that
    is not the checkpoint's, in name, shape or dtype, is refused before vLLM sees anything."""
    from safetensors.torch import load_file

    from omni_core.weights_sender import WeightSender
    from omni_core.workers.weight_receiver import WeightReceiver

    runner, _ = _loaded(checkpoints["qwen2"])
    model_runner = runner.worker.model_runner
    trained = load_file(str(checkpoints["qwen2-seed1"] / "model.safetensors"))
    specs = runner.weight_specs()
    assert {n: (tuple(t.shape), t.dtype) for n, t in trained.items()} == {
        n: spec for n, spec in specs.items() if n != "lm_head.weight"
    }
    assert specs["lm_head.weight"] == specs["model.embed_tokens.weight"]  # tied: a state_dict names both
    receiver = WeightReceiver(CPU, 0)
    with WeightSender() as sender:
        receiver.apply(sender.share(trained), runner)
        assert model_runner.reloads == ["iterator"]
        assert model_runner.loaded.keys() == trained.keys()
        assert all(torch.equal(model_runner.loaded[n], t) for n, t in trained.items())
        assert runner.last_reload.tensors == len(trained) and runner.last_reload.reload_bytes > 0
        name = sorted(trained)[0]
        for bad, why in (
            ({"model.layers.0.self_attn.qkv_proj.weight": trained[name]}, "is not a weight of this model"),
            ({name: trained[name][:1]}, "the model's is"),
            ({name: trained[name].double()}, "the model's is"),
        ):
            with pytest.raises(RunnerArgumentError, match=why):
                receiver.apply(sender.share(bad), runner)
    assert model_runner.reloads == ["iterator"]  # no refused update reached vLLM


class LoraEngine(FakeEngine):
    """The stand-in with vLLM's LoRA calls, recorded (P-20)."""

    def add_lora(self, lora: Any) -> bool:
        self.calls.append(("add_lora", lora))
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        self.calls.append(("remove_lora", lora_int_id))
        return True

    def pin_lora(self, lora_int_id: int) -> bool:
        self.calls.append(("pin_lora", lora_int_id))
        return True

    def generate(self, rows: list[list[int]], sampling_params: dict[str, Any], lora: Any = None) -> list[Completion]:
        self.calls.append(("generate", rows, lora))
        return [Completion([r[0] + (3 if lora else 1)], "length") for r in rows]


def test_adapters_go_to_vllms_own_lora_slots(monkeypatch, checkpoints, tmp_path):
    import msgspec

    from omni_core.models.lora import make_lora
    from omni_core.protocol import AddAdapter
    from omni_core.runners.vllm_runner import LoraSlot

    pytest.importorskip("peft", reason="needs the models extra")
    FakeEngine.made.clear()
    monkeypatch.setattr(VllmRunner, "engine_factory", LoraEngine)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lora = make_lora(checkpoints["qwen2"], tmp_path / "sql").path
    add = AddAdapter(
        task_id="a", epoch=0, name="sql", adapter_id=7, source=lora, rank=4, target_modules=("q_proj", "v_proj")
    )
    plain, _ = _loaded(checkpoints["qwen2"])
    with pytest.raises(RunnerArgumentError, match="started without LoRA: set runner_args engine_args"):
        plain.check_adapter(add)
    runner, _ = _loaded(checkpoints["qwen2"], engine_args={"enable_lora": True, "max_loras": 2})
    engine = FakeEngine.made[-1]
    with pytest.raises(RunnerArgumentError, match="its directory holds rank 4, the AddAdapter says 8"):
        runner.check_adapter(msgspec.structs.replace(add, rank=8))
    runner.check_adapter(add)
    runner.add_adapter(msgspec.structs.replace(add, pinned=True))
    slot = LoraSlot("sql", 7, lora)
    assert engine.calls[-2:] == [("add_lora", slot), ("pin_lora", 7)]
    prompt = {"prompt_ids": [5, 6], "max_new_tokens": 1}
    assert runner.execute_adapter(prompt, "sql")["token_ids"] == [8] and engine.calls[-1][2] == slot
    assert runner.execute(prompt)["token_ids"] == [6]
    runner.remove_adapter("sql")
    assert engine.calls[-1] == ("remove_lora", 7) and runner.loras == {}


def test_a_batch_goes_into_one_vllm_generate_each_prompt_with_its_own_sampling(fake_vllm, checkpoints):
    runner, _ = _loaded(checkpoints["qwen2"], max_num_seqs=2)
    engine = fake_vllm.made[-1]
    payloads = [
        {"prompt_ids": [5, 6], "max_new_tokens": 2},
        {"prompt_ids": [[1], [2]], "max_new_tokens": 4, "sampling": {"temperature": 0.5, "seed": 3}},
        {"prompt_ids": [[1], [2], [3]]},  # over max_num_seqs: this request's error only
        {"prompt_ids": [9], "stop_at_eos": False},
    ]
    out = runner.execute_batch(payloads)
    generates = [c for c in engine.calls if c[0] == "generate"]
    assert len(generates) == 1, "one engine call for the whole batch: vLLM's scheduler batches it"
    _, rows, params = generates[0]
    assert rows == [[5, 6], [1], [2], [9]]
    assert [(p["max_tokens"], p["temperature"], p["seed"], p["ignore_eos"]) for p in params] == [
        (2, 0.0, None, False),
        (4, 0.5, 3, False),
        (4, 0.5, 3, False),
        (16, 0.0, None, True),
    ]
    assert out[0] == {"token_ids": [6, 7], "finish_reason": "length", "prompt_tokens": 2}
    assert out[1]["token_ids"] == [[2, 3], [3, 4]] and out[3]["token_ids"] == [10, 11]
    assert isinstance(out[2], ValueError) and "max_batch is 2" in str(out[2])
    assert runner.execute_batch([{"prompt_ids": "x"}])[0].__class__ is TypeError  # nothing for vLLM
    assert len([c for c in engine.calls if c[0] == "generate"]) == 1


class SteppingEngine(FakeEngine):
    """vLLM's engine loop: each added row finishes after as many steps as its first token."""

    def __init__(self, engine_kwargs: dict[str, Any]) -> None:
        super().__init__(engine_kwargs)
        self.rows: dict[str, list[Any]] = {}
        self.aborted: list[str] = []
        self.fail = False

    def add_request(self, request_id: str, row: list[int], sampling_params: dict[str, Any]) -> str:
        self.rows[request_id] = [row, row[0]]
        return request_id

    def step(self) -> list[tuple[str, Completion]]:
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access")
        done = []
        for request_id, entry in list(self.rows.items()):
            entry[1] -= 1
            if entry[1] <= 0:
                del self.rows[request_id]
                done.append((request_id, Completion([entry[0][0] + 1], "length")))
        return done

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids

    def has_unfinished(self) -> bool:
        return bool(self.rows)


def test_requests_join_and_leave_vllms_engine_between_steps(monkeypatch, checkpoints):
    monkeypatch.setattr(VllmRunner, "engine_factory", SteppingEngine)
    runner, _ = _loaded(checkpoints["qwen2"], max_num_seqs=4)
    engine = FakeEngine.made[-1]
    assert runner.supports_continuous()
    runner.start_request("a", {"prompt_ids": [3], "max_new_tokens": 1})
    runner.start_request("b", {"prompt_ids": [[1], [2]], "max_new_tokens": 1})
    with pytest.raises(TypeError):
        runner.start_request("c", {"prompt_ids": "x"})  # refused, nothing added to vLLM
    with pytest.raises(ValueError, match="running already"):
        runner.start_request("a", {"prompt_ids": [3]})
    assert runner.running_requests() == 2 and len(engine.rows) == 3
    assert runner.step_requests() == []  # b's first row finished, its second not yet
    assert runner.step_requests() == [
        ("b", {"token_ids": [[2], [3]], "finish_reason": ["length"] * 2, "prompt_tokens": [1, 1]})
    ]
    runner.start_request("d", {"prompt_ids": [1], "max_new_tokens": 1})  # joins while a runs
    assert runner.step_requests() == [
        ("a", {"token_ids": [4], "finish_reason": "length", "prompt_tokens": 1}),
        ("d", {"token_ids": [2], "finish_reason": "length", "prompt_tokens": 1}),
    ]
    runner.start_request("e", {"prompt_ids": [5]})
    engine.fail = True
    with pytest.raises(RuntimeError, match="illegal memory access"):
        runner.step_requests()
    assert runner.running_requests() == 0 and engine.aborted == ["e/0"]
    engine.fail = False
    runner.start_request("f", {"prompt_ids": [5]})
    engine.rows.clear()  # vLLM lost it (an id not echoed back): it fails, never waits forever
    with pytest.raises(RuntimeError, match="holds none of the 1 requests"):
        runner.step_requests()
    assert runner.running_requests() == 0


def test_an_adapter_refit_from_tensors_reaches_vllms_add_lora_checked_first(monkeypatch, checkpoints, tmp_path):
    """vLLM loads adapters from a directory only: the rank's receiver checks the tensors (the
    weight planes' checks), the runner writes them to a private directory of its own and hands
    it to add_lora in place of the old version's, which goes; removing the adapter removes it."""
    import json as _json

    import msgspec
    from safetensors.torch import load_file

    from omni_core.models.lora import make_lora
    from omni_core.protocol import AddAdapter
    from omni_core.weights_sender import WeightSender
    from omni_core.workers.weight_receiver import WeightReceiver

    pytest.importorskip("peft", reason="needs the models extra")
    FakeEngine.made.clear()
    monkeypatch.setattr(VllmRunner, "engine_factory", LoraEngine)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    runner, _ = _loaded(checkpoints["qwen2"], engine_args={"enable_lora": True, "max_loras": 2})
    engine = FakeEngine.made[-1]
    first = make_lora(checkpoints["qwen2"], tmp_path / "sql").path
    add = AddAdapter(
        task_id="a", epoch=0, name="sql", adapter_id=7, source=first, rank=4, target_modules=("q_proj", "v_proj")
    )
    runner.add_adapter(add)
    tensors = load_file(
        str(Path(make_lora(checkpoints["qwen2"], tmp_path / "new", seed=2).path) / "adapter_model.safetensors")
    )
    receiver = WeightReceiver(torch.device("cpu"), 0)
    with WeightSender() as sender:
        refit = msgspec.structs.replace(add, source="tensors:shm", tensors=sender.share(tensors), version=2)
        runner.check_adapter(refit)
        runner.write_adapter(refit, receiver.open_adapter(refit, runner)())
        bent = dict(tensors, **{next(iter(tensors)): torch.zeros(8, 64)})
        with pytest.raises(RunnerArgumentError, match="the model's is float32"):
            receiver.open_adapter(msgspec.structs.replace(refit, tensors=sender.share(bent), version=3), runner)
    receiver.close()
    (_, removed), (_, slot) = engine.calls[-2:]
    assert removed == 7 and slot.lora_int_id == 7 and slot.path != first
    written = load_file(str(Path(slot.path) / "adapter_model.safetensors"))
    assert written.keys() == tensors.keys() and all(torch.equal(written[k], tensors[k]) for k in tensors)
    config = _json.loads((Path(slot.path) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (4, 4.0, ["q_proj", "v_proj"])
    runner.remove_adapter("sql")
    assert not Path(slot.path).exists()  # the refit's directory goes with the adapter
    runner.close()


class SavingModelRunner(FakeModelRunner):
    """A model with parameters, as vLLM's (fused names, this rank's shard)."""

    def __init__(self) -> None:
        super().__init__()
        self.model.qkv_proj = torch.nn.Linear(4, 12, bias=False)
        self.model.norm = torch.nn.LayerNorm(4)


def _sharded_state_worker(model_runner: FakeModelRunner) -> Any:
    """vLLM's Worker.save_sharded_state as vLLM writes it (ShardedStateLoader.save_model):
    this rank's state dict in files `model-rank-{rank}-part-{part}.safetensors` of at most
    max_size bytes each."""
    from safetensors.torch import save_file

    def save_sharded_state(path: str, pattern: str | None = None, max_size: int | None = None) -> None:
        pattern = pattern or vllm_runner.SHARDED_PATTERN
        parts: list[dict[str, torch.Tensor]] = [{}]
        used = 0
        for name, tensor in model_runner.get_model().state_dict().items():
            nbytes = tensor.numel() * tensor.element_size()
            if parts[-1] and max_size is not None and used + nbytes > max_size:
                parts.append({})
                used = 0
            parts[-1][name] = tensor.clone()
            used += nbytes
        for part, tensors in enumerate(parts):
            save_file(tensors, os.path.join(path, pattern.format(rank=0, part=part)))

    return type("Worker", (), {"model_runner": model_runner, "save_sharded_state": staticmethod(save_sharded_state)})()


def test_a_save_is_vllms_sharded_state_and_reloads_bit_for_bit(fake_vllm, checkpoints, tmp_path):
    runner, _ = _loaded(checkpoints["qwen2"])
    runner.worker = _sharded_state_worker(SavingModelRunner())
    model = runner.worker.model_runner.get_model()
    saved_state = {k: v.clone() for k, v in model.state_dict().items()}
    target = tmp_path / "saved"
    target.mkdir()
    files = runner.save_weights(target, 64)  # 64 bytes a file: the weight alone, the small ones together
    assert "config.json" in files and "model.safetensors" not in files  # the checkpoint's weights stay out
    parts = sorted(target.glob("model-rank-0-part-*.safetensors"))
    assert len(parts) >= 2
    with torch.no_grad():
        for tensor in model.state_dict().values():
            tensor.zero_()
    runner.reload_weights(str(target))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved_state.items())
    assert runner.worker.model_runner.reloads == []  # vLLM's checkpoint loader was not asked
    assert runner.last_reload.tensors == len(saved_state) and runner.last_reload.reload_bytes > 0


def test_a_sharded_state_of_another_model_is_refused_before_any_write(fake_vllm, checkpoints, tmp_path):
    from safetensors.torch import save_file

    runner, _ = _loaded(checkpoints["qwen2"])
    runner.worker = _sharded_state_worker(SavingModelRunner())
    before = {k: v.clone() for k, v in runner.worker.model_runner.get_model().state_dict().items()}
    other = tmp_path / "other"
    other.mkdir()
    save_file({"qkv_proj.weight": torch.ones(3, 3)}, str(other / "model-rank-0-part-0.safetensors"))
    with pytest.raises(RunnerArgumentError, match=r"'qkv_proj.weight' \[3, 3\] is not the model's"):
        runner.reload_weights(str(other))
    after = runner.worker.model_runner.get_model().state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_vllm_without_save_sharded_state_is_refused_naming_it(fake_vllm, checkpoints, tmp_path):
    runner, _ = _loaded(checkpoints["qwen2"])
    with pytest.raises(RunnerArgumentError, match="has no save_sharded_state"):
        runner.save_weights(tmp_path, 1 << 20)


def test_vllms_dummy_load_format_is_a_rank_that_starts_needs_reload(fake_vllm, checkpoints):
    runner, _ = _loaded(checkpoints["qwen2"], load_format="dummy")
    assert runner.dummy_weights and FakeEngine.made[-1].kwargs["load_format"] == "dummy"
    assert not _loaded(checkpoints["qwen2"])[0].dummy_weights
    assert StageSpec(name="rollout", runner="vllm", runner_args={"model": "m", "load_format": "dummy"}).dummy_weights
    with pytest.raises(ValueError, match="load_format must be one of"):
        VllmRunner(CPU, model=str(checkpoints["qwen2"]), load_format="pt")
