"""A 2-rank tensor-parallel stage (gloo on CPU, NCCL on the device): shards, all-reduces,
sleeps and wakes with bit-identical outputs."""

from __future__ import annotations

import os

import pytest
import torch

from omni_core.runners.synthetic import tensor_bytes
from omni_core.runners.tensor_parallel import reference_output
from tests.engine.conftest import small_spec

TP_ARGS = {"hidden": 64, "layers": 3, "seed": 5, "kv_rows": 16, "cpu_threads": 1}
PROBE = {"seed": 9, "batch": 4}


def _run_cycle(engine_factory, device: str, devices: tuple[str, ...] | None, args: dict) -> dict:
    spec = small_spec(
        "tp",
        ranks=2,
        runner="omni_core.runners.tensor_parallel:TensorParallelRunner",
        runner_args=args,
        device=device,
        devices=devices,
        backend="portable" if device == "cpu" else "auto",
    )
    engine = engine_factory(spec)
    before = engine.execute("tp", PROBE)
    figures = {"sleep_l1": engine.sleep("tp", level=1)}
    after_l1 = engine.execute("tp", PROBE) if engine.wake("tp").state == "RUNNING" else None
    figures["sleep_l2"] = engine.sleep("tp", level=2)
    assert engine.wake("tp").state == "NEEDS_RELOAD"
    figures["reload"] = engine.reload_weights("tp")
    after_l2 = engine.execute("tp", PROBE)
    assert before["world"] == 2
    assert after_l1 == before, "output changed across a level-1 sleep"
    assert after_l2 == before, "output changed across a level-2 sleep + reload"
    for name in ("sleep_l1", "sleep_l2"):
        report = figures[name]
        assert set(report.ranks) == {0, 1}
        assert all(r.freed_bytes > 0 for r in report.ranks.values()), report
    return {"before": before, "figures": figures}


def test_tensor_parallel_stage_on_cpu_matches_the_single_process_model(engine_factory) -> None:
    result = _run_cycle(engine_factory, "cpu", None, TP_ARGS)
    expected = reference_output(PROBE, world=2, hidden=64, layers=3, seed=5)
    got = result["before"]
    assert got["shape"] == list(expected.shape)
    assert got["data"] == tensor_bytes(expected), "stage output differs from shards summed in one process"


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_tensor_parallel_stage_on_two_gpus_over_nccl(engine_factory) -> None:
    args = {"hidden": 8192, "layers": 16, "seed": 5, "kv_rows": 64, "dtype": "bfloat16"}
    result = _run_cycle(engine_factory, "cuda", ("0", "1"), args)
    lines = []
    for name, report in result["figures"].items():
        for rank, rr in report.ranks.items():
            lines.append(
                f"{name} rank {rank}: state {rr.state}, pool freed {rr.freed_bytes} B, process "
                f"{rr.process_bytes_before} -> {rr.process_bytes_after} B ({rr.process_bytes_source}), "
                f"{rr.duration_s * 1000:.1f} ms"
            )
    out = os.environ.get("OMNI_GPU_RESULTS")
    if out:
        with open(out, "a") as handle:
            handle.write("\n".join(["# tensor-parallel stage, 2 ranks on 2 GPUs (NCCL)", *lines, ""]))
    # Each rank reports its own process memory, not a device-wide figure.
    l1 = result["figures"]["sleep_l1"].ranks
    assert all(r.process_bytes_source.startswith("nvml") for r in l1.values()), l1
