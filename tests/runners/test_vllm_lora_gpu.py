"""LoRA adapters on a real vLLM stage (P-20), through vLLM's own LoRA (enable_lora, LoRARequest,
add_lora / remove_lora / pin_lora): greedy tokens with the adapter equal a PEFT model's on the
same weights, a level-1 sleep and wake keep them, and vLLM 0.26's deep-sleep case (a level-2
sleep with an adapter loaded, wake, reload, generate) refuses the adapter naming it until it
is added again (ListAdapters and Engine.status() say it is gone), then gives the same tokens,
through a second deep sleep too. Needs CUDA and vLLM."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = {"prompt_ids": PROMPT, "max_new_tokens": 8, "stop_at_eos": False}


def test_vllm_adapter_tokens_survive_level_one_and_come_back_after_level_two(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from omni_core.engine import Engine, RequestFailedError, StageSpec
    from omni_core.models import make_checkpoint
    from omni_core.models.lora import make_lora

    model = make_checkpoint("qwen2", "tiny", tmp_path / "qwen2").path
    lora = make_lora(model, tmp_path / "sql", seed=1).path
    reference = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32).cuda()
    reference = PeftModel.from_pretrained(reference, lora).eval()
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([PROMPT]).cuda(), max_new_tokens=8, do_sample=False)
    expected = out[0, len(PROMPT) :].tolist()
    del reference
    torch.cuda.empty_cache()
    spec = StageSpec(
        "chat",
        runner="vllm",
        device="cuda",
        backend="cumem",
        gpu_memory_fraction=0.3,
        runner_args={
            "model": model,
            "dtype": "float32",
            "engine_args": {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8},
        },
        start_deadline_s=600.0,
    )
    with Engine([spec]) as engine:
        engine.add_adapter("chat", "sql", lora)
        tuned = engine.execute("chat", GREEDY, adapter="sql")["token_ids"]
        assert tuned == expected
        engine.sleep("chat", 1)
        engine.wake("chat")
        assert engine.execute("chat", GREEDY, adapter="sql")["token_ids"] == tuned
        engine.sleep("chat", 2)
        engine.wake("chat")
        engine.reload_weights("chat")
        with pytest.raises(RequestFailedError, match="adapter 'sql' was discarded by a level-2 sleep"):
            engine.execute("chat", GREEDY, adapter="sql")
        # The ranks say so, and the engine's view (status page, metrics) follows their Acks.
        assert [(a.name, a.status) for a in engine.list_adapters("chat").adapters] == [("sql", "gone")]
        assert [(a["name"], a["residency"]) for a in engine.status()["chat"]["adapters"]] == [("sql", "gone")]
        engine.add_adapter("chat", "sql", lora)
        assert engine.execute("chat", GREEDY, adapter="sql")["token_ids"] == tuned
        assert [(a["name"], a["residency"]) for a in engine.status()["chat"]["adapters"]] == [("sql", "resident")]
        # An adapter pushed after level 2 is served, not silently dropped: again, through a
        # second deep sleep, with the tokens of the first add.
        engine.sleep("chat", 2)
        engine.wake("chat")
        engine.reload_weights("chat")
        engine.add_adapter("chat", "sql", lora)
        assert engine.execute("chat", GREEDY, adapter="sql")["token_ids"] == tuned
