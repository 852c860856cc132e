"""Adapter-only refit (P-20) over typed CUDA IPC handles on the GPU: a trainer's adapter
tensors on its device, shared by `WeightSender` as IPC buckets, refit a transformers stage's
PEFT adapter in place through the rank's own receiver (the checks of every weight update), and
its greedy tokens equal a PEFT model's with the new adapter weights; a level-1 sleep keeps
them. Needs CUDA and the models extra."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_core.engine import Engine, StageSpec
from omni_core.models.lora import make_lora

pytestmark = pytest.mark.gpu

GREEDY = {"prompt_ids": [5, 6, 7, 8, 9, 10, 11], "max_new_tokens": 12, "stop_at_eos": False}


def _peft_tokens(model: str, lora: str) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, local_files_only=True, dtype=torch.float32).cuda()
    reference = PeftModel.from_pretrained(reference, lora).eval()
    prompt = torch.tensor([GREEDY["prompt_ids"]]).cuda()
    with torch.no_grad():
        out = reference.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)
    return out[0, prompt.shape[1] :].tolist()


def test_an_adapter_refit_over_cuda_ipc_gives_peft_tokens_of_the_new_weights(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("peft", reason="needs the models extra: pip install -e '.[models]'")
    from safetensors.torch import load_file

    from omni_core.models import make_checkpoint
    from omni_core.protocol import IpcSource
    from omni_core.weights_sender import WeightSender

    model = make_checkpoint("qwen2", "tiny", tmp_path / "qwen2").path
    first = make_lora(model, tmp_path / "sql-1", seed=1).path
    second = make_lora(model, tmp_path / "sql-2", seed=2).path
    expected = _peft_tokens(model, second)
    spec = StageSpec(
        "chat",
        runner="transformers",
        device="cuda",
        backend="portable",
        tags=("weights", "kv_cache", "adapters"),
        runner_args={"model": model, "max_seq_len": 64},
        start_deadline_s=300.0,
    )
    sender = WeightSender()
    try:
        with Engine([spec]) as engine:
            engine.add_adapter("chat", "sql", first)
            tensors = {k: v.cuda() for k, v in load_file(str(Path(second) / "adapter_model.safetensors")).items()}
            source = sender.share(tensors)
            assert isinstance(source, IpcSource)
            engine.add_adapter("chat", "sql", tensors=source, version=2)
            refit = engine.execute("chat", GREEDY, adapter="sql", with_version=True)
            assert refit.output["token_ids"] == expected and refit.adapter_version == 2
            engine.sleep("chat", 1)
            engine.wake("chat")
            assert engine.execute("chat", GREEDY, adapter="sql")["token_ids"] == expected
    finally:
        sender.close()
