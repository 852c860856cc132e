"""The control-plane benchmark runs in CI in its short mode and writes its results."""

from __future__ import annotations

import json

from benchmarks.__main__ import main
from omni_core.cli import main as cli_main


def test_control_plane_bench_short_mode(tmp_path, capsys) -> None:
    assert (
        main(["--control-plane", "--short", "--ranks", "1", "--ranks", "2", "--cycles", "10", "--out", str(tmp_path)])
        == 0
    )
    data = json.loads((tmp_path / "control_plane.json").read_text())
    assert [r["ranks"] for r in data["results"]] == [1, 2]
    for result in data["results"]:
        assert result["samples"] == 20
        assert 0 < result["p50_ms"] <= result["p99_ms"] <= result["max_ms"]
    table = (tmp_path / "control_plane.md").read_text()
    assert "| 2 | 20 |" in table
    assert "ranks 2: p50" in capsys.readouterr().out


def test_the_installed_cli_names_where_the_benchmarks_went(capsys) -> None:
    assert cli_main(["bench", "--control-plane"]) == 2
    assert "python -m benchmarks" in capsys.readouterr().err


def test_stage_queue_bench_writes_its_targets(tmp_path) -> None:
    from benchmarks.stage_queue import main as stage_queue_main

    assert stage_queue_main(str(tmp_path), "test", counts=(100, 400)) == 0
    data = json.loads((tmp_path / "stage_queue.json").read_text())
    assert [r["queued"] for r in data["results"]] == [100, 400]
    table = (tmp_path / "stage_queue.md").read_text()
    assert "## Targets" in table and "per-submit cost at 400 queued" in table
