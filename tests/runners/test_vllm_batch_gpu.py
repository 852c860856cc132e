"""Many requests in flight on a vllm stage, on the GPU: the rank runs them in vLLM's engine
loop together (continuous batching), each answer its own request's, before and after a sleep.
Needs CUDA and vLLM (../shared/device/VLLM.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_64_requests_in_flight_equal_each_run_alone(tmp_path: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    import msgspec

    from omni_core.engine import Engine
    from omni_core.models.make import make_checkpoint
    from tests.runners.test_vllm_prefix_gpu import _spec

    model = tmp_path / "qwen2"
    make_checkpoint("qwen2", "0.5b", model, seed=0, dtype="bfloat16")
    prefix_spec = _spec(model)
    runner_args = {**prefix_spec.runner_args, "max_num_seqs": 64}
    spec = msgspec.structs.replace(prefix_spec, runner_args=runner_args, max_in_flight=64, batch_max_requests=64)
    payloads = [
        {
            "prompt_ids": [(13 * i + k) % 5000 + 100 for k in range(8 + i % 5)],
            "max_new_tokens": 32 + i % 7,
            "stop_at_eos": False,
        }
        for i in range(64)
    ]
    with Engine([spec]) as engine:
        alone = [engine.execute("llm", p, with_version=True) for p in payloads]
        futures = [engine.submit("llm", p, with_version=True) for p in payloads]
        together = [f.result(timeout=300) for f in futures]
        engine.sleep("llm", level=1)
        engine.wake("llm")
        again = [f.result(timeout=300) for f in [engine.submit("llm", p, with_version=True) for p in payloads]]
    # vLLM is not batch-invariant: a random-weights model's near-tie logits are decided
    # differently beside other sequences (on the H100 16 of 64 answers equalled the request run
    # alone, 46 in their first 8 tokens; float32 diverged too). Equality with plain vLLM's own
    # batched generate is measured by benchmarks/request_path_gpu.py (243 of 256). What is the
    # rank's: every answer is its own request's (its prompt, its length), after a sleep too.
    for runs in (together, again):
        assert [r.output["prompt_tokens"] for r in runs] == [len(p["prompt_ids"]) for p in payloads]
        assert [len(r.output["token_ids"]) for r in runs] == [p["max_new_tokens"] for p in payloads]
        first = sum(r.output["token_ids"][:8] == a.output["token_ids"][:8] for r, a in zip(runs, alone, strict=True))
        assert first >= len(payloads) // 2, first
    assert {r.weights_version for r in together} == {0}
