"""The control-plane benchmark runs in CI in its short mode and writes its results."""

from __future__ import annotations

import json

from benchmarks.__main__ import main


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
