"""The fuzzing campaign's CI run: both directions, fixed seeds, about a minute in all.

The same seed sends the same frames (`omni_testing.fuzz.generate`); a time box only guards
against a machine far slower than ours, and stops the run early with the same frames as a
prefix. Long runs: `python -m omni_testing.fuzz` (benchmarks/results/fuzz.md).
"""

from __future__ import annotations

import pytest

from omni_testing.fuzz.common import FuzzReport
from omni_testing.fuzz.engine_target import EngineFuzzConfig, EngineFuzzer
from omni_testing.fuzz.worker_target import WorkerFuzzConfig, WorkerFuzzer

SEED = 20261123
MIN_FRAMES = 2_000  # even a time-boxed run must have sent this many


def assert_clean(report: FuzzReport) -> None:
    text = report.summary()
    assert report.frames_sent >= MIN_FRAMES, text
    assert report.crashes == 0, text
    assert report.hangs == 0, text
    assert report.violations == 0, text
    assert report.valid_commands > 0 and report.valid_answered == report.valid_commands, text
    assert report.memory_flat is True, text


def test_worker_survives_fuzzed_frames(tmp_path) -> None:
    config = WorkerFuzzConfig(seed=SEED, frames=15_000, time_box_s=60.0, big_every_frames=5_000, out_dir=str(tmp_path))
    report = WorkerFuzzer(config).run()
    assert_clean(report)
    assert report.replies >= report.frames_sent  # one reply per frame, the oracle's on top
    if not report.time_boxed:
        assert report.frames_by_kind.get("big") == 3


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_engine_refuses_and_counts_frames_from_strangers(transport: str) -> None:
    config = EngineFuzzConfig(seed=SEED, frames=8_000, time_box_s=40.0, transport=transport, big_every_frames=4_000)
    report = EngineFuzzer(config).run()
    assert_clean(report)
    counters = report.extra["engine_counters"]
    refused = sum(
        counters[k] for k in ("bad_replies", "unknown_peers", "rebind_refused", "forged_hellos", "rank_mismatch")
    )
    assert refused == report.frames_sent == report.extra["frames_counted_by_engine"]
    assert counters["bad_replies"] > 0 and counters["unknown_peers"] > 0 and counters["rank_mismatch"] == 0
    assert report.extra["client"]["executes_ok"] > 0
