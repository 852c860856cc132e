"""A real vLLM stage on the GPU through every lifecycle, on cumem and fast.

Runs benchmarks/vllm_stage's `stage` part: a Qwen2-1.5B-shaped checkpoint (made here, seeded) in a
`vllm` stage, greedy tokens identical after L1 x2, L2 + reload, a partial wake, a weight
update and back, and a refused reload of another shape. Needs CUDA and vLLM (the device's
trimmed bundle: ../shared/device/VLLM.md); its output is committed in
benchmarks/results/vllm_gpu.md.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_vllm_stage_through_every_lifecycle(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    from benchmarks.vllm_stage import main

    rc = main(["--parts", "stage", "--out", str(tmp_path), "--models", str(tmp_path / "models")])
    data = json.loads((tmp_path / "vllm_stage.json").read_text())
    misses = [(run["backend"], c["what"]) for run in data["stage"] for c in run["checks"] if not c["ok"]]
    assert rc == 0 and not misses, (misses, [run.get("error") for run in data["stage"]])
    assert {run["backend"] for run in data["stage"]} == {"cumem", "fast"}
