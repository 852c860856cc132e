"""SaveWeights through a real vLLM stage, on the GPU: a stage updated from memory (a checkpoint
shared over host buckets, as a trainer sends it) saves through vLLM's own save_sharded_state;
a restart then reloads the save and comes back at that version with the same greedy tokens
(without the save it would come back NEEDS_RELOAD under the floor), and so does a reload of it
after an update to other weights; and vLLM itself, asked for
load_format="sharded_state", loads what omni-core saved to the same tokens. Needs CUDA and vLLM
(../shared/device/VLLM.md). Not run on the CPU machine this was written on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runners.test_vllm_prefix_gpu import _spec

pytestmark = pytest.mark.gpu

PROMPT = [(37 * i + 11) % 5000 + 100 for i in range(40)]
REQUEST = {"prompt_ids": [PROMPT], "max_new_tokens": 16, "stop_at_eos": False}
# vLLM's own loader in a child process (its engine and allocator end with the process).
SHARDED_STATE = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], load_format="sharded_state", max_model_len=512, enforce_eager=True,
          gpu_memory_utilization=0.35)
out = llm.generate([{"prompt_token_ids": json.loads(sys.argv[2])}], SamplingParams(temperature=0, max_tokens=16,
                   ignore_eos=True), use_tqdm=False)
print(json.dumps(list(out[0].outputs[0].token_ids)))
"""


def test_a_vllm_save_survives_a_restart_and_loads_in_vllm_as_sharded_state(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    from safetensors.torch import load_file

    from omni_core.engine import Engine
    from omni_core.models.make import make_checkpoint
    from omni_core.weights_sender import WeightSender

    a, b = tmp_path / "a", tmp_path / "b"
    make_checkpoint("qwen2", "0.5b", a, seed=0, dtype="bfloat16")
    make_checkpoint("qwen2", "0.5b", b, seed=1, dtype="bfloat16")
    saved = tmp_path / "saved"
    with Engine([_spec(a)]) as engine, WeightSender() as sender:
        shared = {}
        for part in sorted(b.glob("*.safetensors")):
            shared.update(load_file(str(part)))
        engine.update_weights("llm", sender.share(shared), version=5)
        on_b = engine.execute("llm", REQUEST)["token_ids"]
        engine.save_weights("llm", str(saved))
        restart = engine.restart("llm")
        assert (restart.state, restart.weights_version, restart.weights_source) == ("RUNNING", 5, "disk")
        assert engine.execute("llm", REQUEST)["token_ids"] == on_b
        # A reload of the save, after an update to other weights, is the saved version again.
        engine.update_weights("llm", str(a), version=6)
        engine.sleep("llm", level=2)
        engine.wake("llm")
        assert engine.reload_weights("llm", str(saved)).weights_version == 5
        assert engine.execute("llm", REQUEST)["token_ids"] == on_b
    assert sorted(p.name for p in saved.glob("model-rank-0-part-*.safetensors"))
    assert json.loads((saved / "omni_weights.json").read_text())["weights_version"] == 5
    done = subprocess.run(
        [sys.executable, "-c", SHARDED_STATE, str(saved), json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == on_b[0]
