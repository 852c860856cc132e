"""The anchors' LoRA routes (P-20) end to end: HTTP, the engine, a rank of the transformers
runner loading a real PEFT adapter for a tiny qwen2. vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (body `{lora_name, lora_path}`, text answers), SGLang's
`/load_lora_adapter` and `/unload_lora_adapter` (`{success, error_message, loaded_adapters}`),
the adapters in `/v1/models`, an execute naming its adapter; a level-2 sleep leaves the adapter
gone (refused naming it) until loaded again; bad adapters are refused naming what."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.serve.conftest import Served, make_config, serving

pytest.importorskip("peft", reason="needs the models extra: pip install -e '.[models]'")
pytest.importorskip("transformers", reason="needs the models extra: pip install -e '.[models]'")

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = {"prompt_ids": PROMPT, "max_new_tokens": 8, "stop_at_eos": False}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    from omni_core.models import make_checkpoint
    from omni_core.models.lora import make_lora

    root = tmp_path_factory.mktemp("lora-serve")
    make_checkpoint("qwen2", "tiny", root / "qwen2")
    make_lora(root / "qwen2", root / "sql", seed=1)
    make_lora(root / "qwen2", root / "sql-2", seed=2)
    make_checkpoint("llama", "tiny", root / "llama")
    make_lora(root / "llama", root / "llama-lora")
    return root


@pytest.fixture(scope="module")
def chat(root) -> Iterator[Served]:
    stage = {
        "name": "chat",
        "runner": "transformers",
        "runner_args": {"model": str(root / "qwen2"), "max_seq_len": 64, "cpu_threads": 1},
        "backend": "portable",
        "tags": ["weights", "kv_cache", "adapters"],
        "deadline_s": 60.0,
        "start_deadline_s": 240.0,
        "request_timeout_s": 120.0,
    }
    config = make_config(stage, default_stage="chat", allowed_reload_sources=[str(root)])
    with serving(config) as served:
        yield served


def _peft_tokens(root: Path, lora: str = "sql") -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from omni_core.runners.weights import own_storage

    reference = AutoModelForCausalLM.from_pretrained(str(root / "qwen2"), local_files_only=True)
    own_storage([reference])  # as the runner: CPU kernels choose their path by the weights' alignment
    reference = PeftModel.from_pretrained(reference, str(root / lora)).eval()
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    return out[0, len(PROMPT) :].tolist()


def _tokens(chat: Served, adapter: str | None = None) -> dict:
    body = {"payload": GREEDY} | ({"adapter": adapter} if adapter else {})
    answer = chat.client.post("/v1/stages/chat/execute", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_vllm_load_serves_peft_tokens_and_level_two_needs_a_reload_of_it(chat: Served, root: Path) -> None:
    base = _tokens(chat)["output"]["token_ids"]
    loaded = chat.client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")})
    assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'sql' added successfully."
    models = chat.client.get("/v1/models").json()["data"]
    assert {"id": "sql", "root": str(root / "sql"), "parent": str(root / "qwen2")}.items() <= models[1].items()
    tuned = _tokens(chat, "sql")
    assert tuned["output"]["token_ids"] == _peft_tokens(root) != base
    assert (tuned["adapter"], tuned["adapter_version"]) == ("sql", 1)

    assert chat.client.post("/sleep?level=1").status_code == 200
    assert chat.client.post("/wake_up").status_code == 200
    assert _tokens(chat, "sql")["output"] == tuned["output"]  # level 1 kept it bit for bit

    assert chat.client.post("/sleep?level=2").status_code == 200
    assert chat.client.post("/wake_up").status_code == 200
    assert chat.client.post("/collective_rpc", json={"method": "reload_weights"}).status_code == 200
    refused = chat.client.post("/v1/stages/chat/execute", json={"payload": GREEDY, "adapter": "sql"})
    assert refused.status_code != 200 and "adapter 'sql' was discarded by a level-2 sleep" in refused.text
    assert _tokens(chat)["output"]["token_ids"] == base
    again = chat.client.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")})
    assert again.status_code == 200 and again.json()["success"] is True, again.text
    assert again.json()["loaded_adapters"] == {"sql": str(root / "sql")}
    assert _tokens(chat, "sql")["output"] == tuned["output"]
    gone = chat.client.post("/unload_lora_adapter", json={"lora_name": "sql"})
    assert gone.json()["success"] is True and gone.json()["loaded_adapters"] == {}
    assert chat.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200  # ALREADY


def test_bad_adapters_are_refused_naming_what_and_the_stage_serves_on(chat: Served, root: Path, tmp_path) -> None:
    outside = chat.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert outside.status_code == 403 and "allowed_reload_sources" in outside.text
    missing = chat.client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "none")})
    assert missing.status_code == 400 and "adapter_config.json" in missing.text, missing.text
    other = chat.client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": str(root / "llama-lora")})
    body = other.json()
    assert other.status_code == 400 and body["success"] is False, other.text
    assert "was made for a LlamaForCausalLM, and this stage serves a Qwen2ForCausalLM" in body["error_message"]
    assert chat.engine.list_adapters("chat").adapters == ()  # nothing loaded
    assert chat.stage("chat")["state"] == "RUNNING" and _tokens(chat)["output"]["finish_reason"] == "length"


def test_sglang_load_from_tensors_refits_the_adapter_over_shm(chat: Served, root: Path) -> None:
    import msgspec
    from safetensors.torch import load_file

    from omni_core.weights_sender import WeightSender

    assert (
        chat.client.post("/load_lora_adapter", json={"lora_name": "rl", "lora_path": str(root / "sql")}).status_code
        == 200
    )
    sender = WeightSender()
    try:
        source = msgspec.to_builtins(sender.share(load_file(str(root / "sql-2" / "adapter_model.safetensors"))))
        config = {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]}
        pickled = chat.client.post(
            "/load_lora_adapter_from_tensors",
            json={"lora_name": "rl", "config_dict": config, "serialized_tensors": "gASV"},
        )
        assert pickled.status_code == 400 and "SGLang's are pickles" in pickled.text
        disk = chat.client.post(
            "/load_lora_adapter_from_tensors",
            json={"lora_name": "rl", "source": {"type": "disk", "path": str(root / "sql")}},
        )
        assert disk.status_code == 422 and "POST /load_lora_adapter takes it" in disk.text
        refit = chat.client.post(
            "/load_lora_adapter_from_tensors", json={"lora_name": "rl", "config_dict": config, "source": source}
        )
        assert refit.status_code == 200 and refit.json()["success"] is True, refit.text
        assert refit.json()["loaded_adapters"]["rl"] == "__tensor__"
        served = _tokens(chat, "rl")
        assert served["output"]["token_ids"] == _peft_tokens(root, "sql-2") != _peft_tokens(root)
        assert served["adapter_version"] == 2  # one above the version held: no version sent
    finally:
        sender.close()
    assert chat.client.post("/unload_lora_adapter", json={"lora_name": "rl"}).json()["success"] is True


def test_the_openai_routes_serve_an_adapter_named_as_the_model(chat: Served, root: Path) -> None:
    """vLLM's way: an adapter loaded through /v1/load_lora_adapter is a model of GET /v1/models,
    and a completion naming it as `model` runs with it, its answer naming the adapter's version."""
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    base = chat.client.post("/v1/completions", json=body).json()["choices"][0]
    assert "adapter" not in base
    loaded = chat.client.post("/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")})
    assert loaded.status_code == 200, loaded.text
    answer = chat.client.post("/v1/completions", json=body | {"model": "sql"})
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["token_ids"] == _peft_tokens(root) != base["token_ids"]
    assert (answer.json()["model"], choice["adapter"], choice["adapter_version"]) == ("sql", "sql", 1)
    assert chat.client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 200
    unknown = chat.client.post("/v1/completions", json=body | {"model": "sql"})
    assert unknown.status_code == 404 and "model 'sql' is not served here" in unknown.text


def test_sglang_generate_runs_the_adapter_its_lora_path_names(chat: Served, root: Path) -> None:
    """SGLang's way: `lora_path` in POST /generate names an adapter loaded through
    /load_lora_adapter (one for every prompt, or one per prompt), and its tokens are PEFT's;
    `meta_info` names the adapter and its version beside the weights version. A name no
    adapter here has is a 400 naming it, and nothing runs."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}
    base = chat.client.post("/generate", json=body)
    assert base.status_code == 200, base.text
    assert "adapter" not in base.json()["meta_info"]
    loaded = chat.client.post("/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(root / "sql")})
    assert loaded.json()["success"] is True, loaded.text
    answer = chat.client.post("/generate", json=body | {"lora_path": "sql"})
    assert answer.status_code == 200, answer.text
    one = answer.json()
    assert one["output_ids"] == _peft_tokens(root) != base.json()["output_ids"]
    meta = one["meta_info"]
    assert (meta["adapter"], meta["adapter_version"], meta["completion_tokens"]) == ("sql", 1, 8)
    assert meta["finish_reason"] == {"type": "length"} and meta["prompt_tokens"] == len(PROMPT)

    batch = chat.client.post("/generate", json=body | {"input_ids": [PROMPT, PROMPT], "lora_path": [None, "sql"]})
    assert batch.status_code == 200, batch.text
    plain, tuned = batch.json()
    assert plain["output_ids"] == base.json()["output_ids"] and "adapter" not in plain["meta_info"]
    assert tuned["output_ids"] == one["output_ids"] and tuned["meta_info"]["adapter"] == "sql"

    unknown = chat.client.post("/generate", json=body | {"lora_path": "chat-v2"})
    assert unknown.status_code == 400
    assert "lora_path 'chat-v2' names no LoRA adapter loaded here (loaded: ['sql'])" in unknown.text
    miscounted = chat.client.post("/generate", json=body | {"input_ids": [PROMPT], "lora_path": ["sql", None]})
    assert miscounted.status_code == 400 and "names 2 adapters for 1 prompts" in miscounted.text
    refused = chat.client.post("/generate", json=body | {"stream": True})
    assert refused.status_code == 400 and "['stream']" in refused.text
    assert chat.client.post("/unload_lora_adapter", json={"lora_name": "sql"}).json()["success"] is True
    gone = chat.client.post("/generate", json=body | {"lora_path": "sql"})
    assert gone.status_code == 400 and "names no LoRA adapter loaded here" in gone.text
