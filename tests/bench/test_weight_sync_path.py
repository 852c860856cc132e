"""The path of a weight update through the engine: one command and one reply per rank, no
other frame while the caller waits, and phases that account for the caller's whole wait."""

from __future__ import annotations

import pytest

from benchmarks.weight_sync_path import PHASES, cpu_update_path, update_path
from omni_core.fsm import trace_records as tr


def test_an_update_is_one_command_and_one_reply_per_rank_and_nothing_else() -> None:
    paths = cpu_update_path(updates=5, ranks=2, log=lambda line: None)
    assert len(paths) == 3  # the first two (buckets opened) are left out
    for path in paths:
        assert (path.commands_sent, path.replies_received, path.ranks) == (2, 2, 2), path
        assert path.other_frames == [], path
        assert set(path.phases) == {key for key, _ in PHASES}
        assert all(value >= 0 for value in path.phases.values()), path.phases
        assert sum(path.phases.values()) == pytest.approx(path.wall_s, abs=1e-9)
        assert path.phases["apply_s"] > 0


def _line(mono_s: float, rank: int, record: object) -> tr.TraceLine:
    return tr.TraceLine(0, mono_s, 1, "rollout", rank, 0, record)  # type: ignore[arg-type]


def _update_lines(task: str, start_s: float) -> list[tr.TraceLine]:
    return [
        _line(start_s + 0.001, -1, tr.StageIssued(0, task, "UpdateWeights", "RUNNING", "WAKING", 9.0)),
        _line(start_s + 0.002, -1, tr.StageSent(0, 0, task, "UpdateWeights", "WAKING")),
        _line(start_s + 0.003, 0, tr.WorkerReceived(0, task, "UpdateWeights", "ACTIVE")),
        _line(start_s + 0.009, 0, tr.EffectDone(task, "UpdateWeights", "ACTIVE", 0.005)),
        _line(start_s + 0.010, 0, tr.ReplySent(0, task, "ack", "ACTIVE")),
        _line(start_s + 0.012, -1, tr.StageReceived(0, 0, task, "ack", "WAKING")),
        _line(start_s + 0.013, -1, tr.TaskEnded(task, "UpdateWeights", True, "RUNNING")),
    ]


def test_the_phases_partition_the_call_and_a_frame_of_another_task_is_counted() -> None:
    lines = _update_lines("u1", 100.0)
    lines.insert(5, _line(100.0105, -1, tr.StageSent(0, 0, "status-1", "Status", "WAKING")))
    path = update_path(lines, "u1", 100.0, 100.015)
    assert path.phases == pytest.approx(
        {
            "api_s": 0.001,
            "to_rank_s": 0.002,
            "rank_extra_s": 0.002,
            "apply_s": 0.005,
            "to_engine_s": 0.002,
            "commit_s": 0.001,
            "return_s": 0.002,
        }
    )
    assert path.other_frames == ["StageSent:Status status-1"]
    assert (path.commands_sent, path.replies_received) == (1, 1)


def test_a_record_missing_from_the_trace_is_named() -> None:
    lines = [line for line in _update_lines("u1", 100.0) if not isinstance(line.record, tr.EffectDone)]
    with pytest.raises(ValueError, match="no EffectDone of task 'u1'"):
        update_path(lines, "u1", 100.0, 100.015)


def test_the_bench_table_shows_each_rows_phases_and_frames() -> None:
    from benchmarks.weight_sync import render

    phases = {key: 0.001 * (i + 1) for i, (key, _) in enumerate(PHASES)}
    row = {
        "case": "same GPU, ipc, again (handles reused)",
        "update_wall_s": 0.0195,
        "rank_s": 0.0146,
        "gbps_wall": 823.0,
        "share_s": 0.0125,
        "exact": True,
        "exact_after_sleep_wake": True,
        "path": {**phases, "commands_sent": 1, "replies_received": 1, "other_frames": []},
    }
    results = {"machine": "m", "commit": "c", "command": "x", "shapes": [{"shape": "16g", "rows": [row]}]}
    results["vllm"] = {"skipped": "no vllm"}
    results["memory_figure"] = {"per_call_s": 0.0004, "source": "nvml"}
    text = render(results)
    assert "One rank memory figure (nvml) costs 0.400 ms here" in text
    assert (
        "| 16g | same GPU, ipc, again (handles reused) | 1.00 | 2.00 | 3.00 | 4.00 | 5.00 | 6.00 | 7.00 | 1 / 1 | 0 |"
        in text
    )
    assert text.rstrip().endswith("vLLM's own update path: not measured (no vllm).")
