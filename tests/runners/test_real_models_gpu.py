"""A Qwen2 stage and a DiT stage co-located on one GPU, per memory backend (cumem, fast):
every lifecycle bit-identical, each rank's NVML figure down at every sleep and back at wake.
`benchmarks.real_models` does the run; this test asserts on what it recorded.

Skipped without CUDA. On the lent device machine (docs/design.md, "Running on a GPU"):

    source .device/setup.sh && python3 -m pytest -m gpu tests/runners/test_real_models_gpu.py

Tiny models by default (seconds); OMNI_REAL_MODELS_SIZE=large runs Qwen2 1.5B + DiT 600M
(made in OMNI_MODELS_DIR, default a temporary folder). OMNI_GPU_RESULTS_DIR, when set,
receives real_models.json and real_models.md.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from benchmarks.real_models import BACKENDS, Config, run_bench, write_outputs
from omni_core.workers.backends import cumem_unavailable_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 1 << 20
# Below this the pools are a few allocation granules and the process figure's drop says
# little about them; above it, a sleep must release (nearly) all the pool bytes it reports.
AUDIT_MIN_POOL_BYTES = 256 * MiB
MIN_DROP_OVER_FREED = 0.9


def test_llm_and_dit_co_located_bit_exact_through_every_lifecycle(tmp_path) -> None:
    reason = cumem_unavailable_reason(torch.device("cuda"))
    if reason:
        pytest.skip(f"cumem and fast need vLLM's allocator: {reason}")
    size = os.environ.get("OMNI_REAL_MODELS_SIZE", "tiny")
    cfg = Config(
        backends=BACKENDS,
        size=size,
        models_dir=Path(os.environ.get("OMNI_MODELS_DIR", tmp_path)),
        cycles=2,
        dit_steps=6 if size == "tiny" else 20,
    )
    data = run_bench(cfg, f"pytest {__file__} (size {size})")
    if os.environ.get("OMNI_GPU_RESULTS_DIR"):
        write_outputs(data, Path(os.environ["OMNI_GPU_RESULTS_DIR"]))
    for run in data["runs"]:
        missed = [c for c in run["checks"] if not c["ok"]]
        assert "error" not in run, (run["backend"], run.get("traceback"))
        assert run["bit_exact"] and not missed, (run["backend"], missed)
        for a in run["audit"]:
            where = (run["backend"], a["stage"], a["level"])
            assert a["source"] == "nvml", where  # each rank's own figure, not the device's
            assert a["sleeping"] < a["active_before"], where
            if a["pool_freed"] >= AUDIT_MIN_POOL_BYTES:
                assert a["drop_over_freed"] >= MIN_DROP_OVER_FREED, (where, a)
    assert data["verdict"] == "PASS"
