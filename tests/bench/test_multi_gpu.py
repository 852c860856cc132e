"""`python -m benchmarks --multi-gpu` on CPU: the smoke run CI takes (two gloo ranks per stage,
the swap on a simulated device), and the verdict and summary arithmetic. The GPU run is the
device machine's (benchmarks/results/)."""

from __future__ import annotations

import hashlib
import json

import pytest

from benchmarks import multi_gpu
from benchmarks.__main__ import main as cli_main
from omni_core.runners.synthetic import tensor_bytes
from omni_core.runners.tensor_parallel import reference_output


def test_cpu_smoke_runs_tp_and_swap_and_every_output_stays_exact(tmp_path, capsys):
    out = tmp_path / "results"
    assert (
        cli_main(
            [
                "--multi-gpu",
                "--device",
                "cpu",
                "--parts",
                "tp,swap",
                "--out",
                str(out),
                "--models-dir",
                str(tmp_path / "models"),
            ]
        )
        == 0
    )
    data = json.loads((out / "multi_gpu.json").read_text())
    assert data["verdict"] == "PASS" and set(data["parts"]) == {"tp", "swap"}
    assert (out / "multi_gpu.md").read_text().startswith("# Tensor-parallel stages on two GPUs")

    tp = data["parts"]["tp"]
    names = [c["what"] for c in tp["checks"]]
    skipped = next(c for c in tp["checks"] if c["what"] == "vllm TP=2 stage skipped")
    assert "needs CUDA" in skipped["detail"]
    for stage in ("hf", "tp"):  # the transformers runner sharded by its own plan; the synthetic one
        for expected in (
            f"{stage} in PARTIAL refuses a request naming PARTIAL",
            f"{stage} in NEEDS_RELOAD refuses a request naming NEEDS_RELOAD",
            f"{stage} output after L2 + reload identical",
            f"{stage} output after partial wake identical",
        ):
            assert expected in names, names
    stages = {s["stage"]: s for s in tp["stages"]}
    assert stages["hf"]["kind"] == "transformers" and stages["tp"]["kind"] == "synthetic"
    assert {r["rank"] for r in tp["lifecycle"]} == {0, 1}
    assert all(r["weights_bytes"] > 0 for r in tp["lifecycle"])
    # The stage's output is the model computed in one process from the same shards: the two
    # ranks really split the layers and all-reduced.
    expected = reference_output(multi_gpu.TP_PROBE, world=2, hidden=64, layers=3, seed=0)
    assert stages["tp"]["reference"] == hashlib.sha256(tensor_bytes(expected)).hexdigest()

    swap = data["parts"]["swap"]
    hows = [m["how"] for m in swap["moves"]]
    assert hows == ["sequential", "swap"] * 2
    assert sum("bit-exact" in c["what"] and c["ok"] for c in swap["checks"]) == 4
    assert swap["reference"]["a"] != swap["reference"]["b"]  # two models: a mix-up would show
    assert all(g["bytes"] > 0 for m in swap["moves"] for g in m["per_gpu"].values())
    assert "part swap:" in capsys.readouterr().out  # progress lines with timings


def _data(parts: dict, planned: tuple[str, ...] = ("tp", "swap")) -> dict:
    return {"parts": parts, "config": {"parts": list(planned)}}


def test_verdict_fails_on_a_miss_or_an_error_and_is_incomplete_when_cut_short():
    ok = {"checks": [{"what": "x", "ok": True}], "stages": [{}]}
    assert multi_gpu.verdict(_data({"tp": ok, "swap": ok})) == "PASS"
    assert multi_gpu.verdict(_data({"tp": ok, "swap": {"checks": [{"what": "y", "ok": False}]}})) == "FAIL"
    assert multi_gpu.verdict(_data({"tp": ok, "swap": {**ok, "stages": [{"error": "boom"}]}})) == "FAIL"
    assert multi_gpu.verdict(_data({"tp": ok})) == "INCOMPLETE"
    # A skipped part (no Ray) is not a failure.
    assert multi_gpu.verdict(_data({"tp": ok, "ray": {"skipped": "ray not importable"}}, ("tp", "ray"))) == "PASS"


def test_swap_summary_is_per_gpu_and_compares_with_sequential():
    def move(how: str, wall_s: float) -> dict:
        return {"how": how, "wall_s": wall_s, "per_gpu": {0: {"GBps": 10 / wall_s}, 1: {"GBps": 8 / wall_s}}}

    summary = multi_gpu.summarize_moves(
        [move("sequential", 2.0), move("swap", 1.0), move("sequential", 4.0), move("swap", 1.0)]
    )
    assert summary["sequential"]["median_s"] == 3.0 and summary["swap"]["median_s"] == 1.0
    assert summary["swap"]["GBps_per_gpu"] == {0: 10.0, 1: 8.0}
    assert summary["speedup"] == 3.0


def test_digest_reads_tokens_or_the_tensor_hash():
    assert multi_gpu.digest({"sha256": "abc", "data": b""}) == "abc"
    assert multi_gpu.digest({"token_ids": [[1, 2]]}) != multi_gpu.digest({"token_ids": [[2, 1]]})


def test_unknown_part_and_device_are_named():
    with pytest.raises(ValueError, match="unknown part"):
        multi_gpu.Config(parts=("tp", "sawp"))
    with pytest.raises(ValueError, match="device"):
        multi_gpu.Config(device="tpu")
    with pytest.raises(ValueError, match=r"unknown runner\(s\) \['vlm'\]"):
        multi_gpu.Config(runners=("vlm",))


@pytest.mark.ray
def test_ray_part_on_cpu_fails_the_killed_rank_by_name_and_restarts(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'omni-core[ray]'")
    data = multi_gpu.run_bench(multi_gpu.Config(device="cpu", parts=("ray",)), "test", tmp_path)
    part = data["parts"]["ray"]
    assert data["verdict"] == "PASS", [c for c in part["checks"] if not c["ok"]]
    stage = part["stages"][0]
    assert "rank 1" in stage["failure"] and stage["node"] in stage["failure"]
    assert "ray.kill" in stage["failure"]
