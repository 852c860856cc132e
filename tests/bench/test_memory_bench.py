"""`python -m benchmarks` (memory path) on CPU: argument handling, the summary and target
arithmetic, and the Markdown/PNG rendering from a results file. The measurement itself
needs a GPU and runs on the device machine (benchmarks/results/memory.md)."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import memory
from benchmarks.__main__ import main as cli_main

GB = 1e9


def case(
    method: str,
    workload: str = "8g",
    *,
    sleep_gbps=(52.0, 54.0, 53.0),
    wake_gbps=(51.0, 52.0, 50.5),
    nbytes: int = 8 * 2**30,
    host_ratio: float = 1.001,
    l2_s: float | None = 0.05,
    exact=True,
    **extra,
):
    r = {
        "method": method,
        "workload": workload,
        "offloaded_bytes": nbytes,
        "kv_bytes": 4 * 2**30,
        "sleep_s": [nbytes / (g * GB) for g in sleep_gbps],
        "wake_s": [nbytes / (g * GB) for g in wake_gbps],
        "bit_exact": [exact] * len(sleep_gbps),
        "host_bytes": int(host_ratio * nbytes),
        "allocations": 256,
        "freed_bytes": [nbytes + 4 * 2**30] * len(sleep_gbps),
        "prepare_s": 1.5,
    }
    if l2_s is not None:
        r.update(l2_sleep_s=l2_s, l2_wake_s=0.03, l2_bytes=nbytes + 4 * 2**30)
    r.update(extra)
    return r


def data(results):
    return {
        "command": "python -m benchmarks",
        "machine": {"gpu": "NVIDIA H200, 143771 MiB", "cpus": 16},
        "reps": 3,
        "workloads": ["8g", "mixed"],
        "methods": [],
        "results": results,
        "wall_s": 12.0,
    }


def test_parse_method_and_options():
    assert memory.parse_method("fast") == ("fast", {})
    assert memory.parse_method("fast:streams=1,chunk_mib=64") == ("fast", {"streams": "1", "chunk_mib": "64"})
    assert memory.parse_method("fast:clean=1+run_mib=512") == ("fast", {"clean": "1", "run_mib": "512"})
    with pytest.raises(ValueError, match="unknown method 'nccl'"):
        memory.parse_method("nccl")
    with pytest.raises(ValueError, match="not key=value"):
        memory.parse_method("fast:wake")


def test_workloads_match_the_issue():
    w = memory.WORKLOADS
    assert w["8g"].weights_bytes == 8 * 2**30 and len(w["8g"].weights) == 256 and w["8g"].kv_bytes == 4 * 2**30
    assert w["1g"].weights_bytes == 2**30 and w["32g"].weights_bytes == 32 * 2**30
    sizes = w["mixed"].weights
    assert sum(1 for s in sizes if s <= 3 * 2**20) >= 1000 and sum(1 for s in sizes if s >= 2**30) == 4
    assert all(s % 2 == 0 for wl in w.values() for s in wl.weights)  # bfloat16 tensors


def test_summary_separates_first_sleep_and_reports_medians():
    s = memory.summarize(case("vllm", sleep_gbps=(2.5, 30.0, 36.0), wake_gbps=(46.0, 45.0, 47.0)))
    assert s["first_sleep_GBps"] == pytest.approx(2.5)
    assert s["later_sleep_GBps_median"] == pytest.approx(33.0) and s["later_sleep_GBps_min"] == pytest.approx(30.0)
    assert s["wake_GBps_median"] == pytest.approx(46.0) and s["bit_exact"]
    assert s["l2_sleep_ms"] == pytest.approx(50.0) and s["host_ratio"] == pytest.approx(1.001, abs=1e-6)
    assert memory.summarize({"method": "fast", "workload": "8g", "error": "boom"}) == {}


def test_targets_met_and_missed_say_by_how_much():
    met = memory.targets([case("fast")])
    assert met and all(t["met"] for t in met), met
    missed = memory.targets(
        [case("fast", sleep_gbps=(49.0, 51.0), wake_gbps=(40.0, 51.0), l2_s=0.2, host_ratio=1.2, exact=False)]
    )
    by = {t["target"]: t for t in missed}
    assert not by["L1 first sleep >= 50 GB/s"]["met"] and by["L1 first sleep >= 50 GB/s"]["by"] == "1 (2%)"
    assert by["L1 later sleeps (each) >= 50 GB/s"]["met"]
    assert by["L1 wake (each) >= 50 GB/s"]["by"] == "10 (20%)"
    assert not by["L2 sleep of 12.0 GiB < 100 ms"]["met"]
    assert not by["host bytes <= 1.05 x offloaded"]["met"] and not by["bit-exact after every wake"]["met"]
    # the fast backend's own arena figure counts when present (MemAvailable is noisier)
    arena = memory.targets([case("fast", host_ratio=1.2, reported_first_sleep={"arena_bytes": 8 * 2**30})])
    assert next(t for t in arena if t["target"].startswith("host"))["met"]
    assert memory.targets([case("vllm")]) == []  # targets are the fast backend's


def test_markdown_has_every_method_and_the_targets():
    tms = {"method": "tms", "workload": "8g", "error": "torch_memory_saver is not installed"}
    md = memory.render_markdown(
        data(
            [
                case("limit", l2_s=None, l2_note="a copy, not a sleep"),
                case("vllm", sleep_gbps=(2.4, 30.0)),
                case("fast"),
                tms,
                case("fast", "mixed", sleep_gbps=(45.0, 47.0)),
            ]
        )
    )
    assert "host-link limit (pinned copy)" in md and "vLLM CuMemAllocator (stock)" in md
    assert "| omni-core fast | 52.0 (0.165) |" in md
    assert "error: torch_memory_saver is not installed" in md
    assert "## Targets (omni-core fast)" in md and "missed by 5 (10%)" in md


def test_png_is_drawn_when_matplotlib_is_present(tmp_path):
    pytest.importorskip("matplotlib")
    results = [
        case("limit", l2_s=None),
        case("vllm", sleep_gbps=(2.4, 30.0)),
        case("fast"),
        case("limit", "mixed", l2_s=None),
        case("fast", "mixed"),
    ]
    assert memory.render_png(data(results), tmp_path / "m.png") is None
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_render_from_a_results_file(tmp_path, capsys):
    path = tmp_path / "in.json"
    path.write_text(json.dumps(data([case("limit", l2_s=None), case("fast")])))
    assert cli_main(["--render", str(path), "--out", str(tmp_path / "out")]) == 0
    assert "omni-core fast" in (tmp_path / "out" / "memory.md").read_text()
    assert json.loads((tmp_path / "out" / "memory.json").read_text())["results"][1]["method"] == "fast"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_the_bench_says_why_and_writes_nothing(tmp_path, capsys):
    assert cli_main(["--workloads", "1g", "--out", str(tmp_path / "x")]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_unknown_names_are_refused(tmp_path, capsys):
    assert cli_main(["--workloads", "64g", "--out", str(tmp_path)]) == 2
    assert "unknown workload(s) ['64g']" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown method"):
        cli_main(["--methods", "limit,mmap", "--out", str(tmp_path)])
