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


@pytest.mark.timeout(420)  # the example's own bound (360 s) and pytest's start
def test_rl_example_with_a_vllm_rollout_matches_the_trainer(tmp_path):
    """examples/rl_loop.py with vLLM as the rollout (a Qwen2-0.5B-shaped model in float32):
    updates over CUDA IPC (vLLM's own loader) and from disk, each step's greedy tokens equal to
    the trainer's own transformers model holding the same weights, and again after a sleep and
    wake. The example runs in a child process (the trainer, CUDA and vLLM's allocator end with
    os._exit there); OMNI_RL_OUT keeps its records and log."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("vllm", reason="needs vLLM (on the device: source .vllm/setup-vllm.sh)")
    example = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"
    out = Path(os.environ.get("OMNI_RL_OUT") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    size = os.environ.get("OMNI_RL_SIZE", "0.5b")
    command = [sys.executable, str(example), "--rollout", "vllm", "--size", size, "--iterations", "3"]
    done = subprocess.run(
        [*command, "--workdir", str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=360
    )
    (out / "rl_loop_vllm.log").write_text(done.stdout + done.stderr[-20000:])
    assert done.returncode == 0, done.stderr[-4000:]
    records = [json.loads(line) for line in (out / "rl_loop.jsonl").read_text().splitlines()]
    steps, final = records[:-1], records[-1]
    assert [s["version"] for s in steps] == [1, 2, 3] and final["status"] == 3
    assert [s["source"] for s in steps] == ["ipc", "disk", "ipc"]
    assert final["start_equal_to_reference"]
    assert all(s["equal_to_reference"] and s["equal_after_wake"] for s in steps)
