"""`python -m benchmarks --request-path`: its target arithmetic and rendering from recorded
figures, and the in-process breakdown of a no-op command (seconds). The run itself (minutes
on the 2-core machine) is committed in benchmarks/results/request_path.md."""

from __future__ import annotations

from benchmarks import request_path


def _data(wide64: float, noop1: float, noop4: float, floor1: float, floor4: float) -> dict:
    def row(stage: str, batch: int, concurrency: int, rps: float) -> dict:
        return {
            "stage": stage,
            "max_batch": batch,
            "concurrency": concurrency,
            "requests": 64,
            "seconds": 64 / rps,
            "requests_per_s": rps,
            "tokens_per_s": rps * 16,
        }

    def timing(p50: float) -> dict:
        return {"p50_ms": p50, "p99_ms": 2 * p50, "mean_ms": p50}

    return {
        "machine": {"cpus": 2, "platform": "test", "python": "3", "commit": "abc"},
        "command": "python -m benchmarks --request-path",
        "load_at_start": 1.0,
        "throughput": [
            row("single", 1, 1, 10.0),
            row("wide", 64, 1, 8.0),
            row("wide", 64, 8, 30.0),
            row("wide", 64, 64, wide64),
        ],
        "noop": [
            {"ranks": 1, "command": timing(noop1), "floor": timing(floor1)},
            {"ranks": 4, "command": timing(noop4), "floor": timing(floor4)},
        ],
        "noop_parts": {"rank_us": 50.0, "stage_core_us": 100.0},
    }


def test_targets_compare_against_the_better_single_request_stage_and_the_floor() -> None:
    text = request_path.render_markdown(_data(wide64=45.0, noop1=0.3, noop4=0.6, floor1=0.1, floor4=0.25))
    targets = text.split("## Targets")[1]
    assert "| 4.5x (45.0 vs 10.0 requests/s) | met |" in targets
    assert "| 3.0x | met |" in targets
    assert "0.100 ms per rank against 0.050 | missed by 0.050 ms per rank" in targets
    assert text.rstrip().endswith("|"), "the file ends with its targets table"


def test_a_throughput_below_the_target_says_by_how_much() -> None:
    text = request_path.render_markdown(_data(wide64=20.0, noop1=0.6, noop4=0.6, floor1=0.1, floor4=0.4))
    assert "| 2.0x (20.0 vs 10.0 requests/s) | missed by 2.0x |" in text
    assert "| 6.0x | missed by 2.0x: the stage core's steps (100 µs)" in text
    assert "0.000 ms per rank against 0.100 | met |" in text


def test_the_no_op_breakdown_runs_a_rank_and_a_stage_core_in_process() -> None:
    parts = request_path.measure_parts(count=50)
    assert set(parts) == {"rank_us", "stage_core_us"} and all(v > 0 for v in parts.values())
