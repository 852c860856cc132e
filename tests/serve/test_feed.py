"""The status feed's memory history, fed lifecycle reports directly (no engine): what the
status page's chart draws."""

from __future__ import annotations

from typing import Any

from omni_core.engine import LifecycleReport
from omni_core.engine.report import RankReport
from omni_core.serve.feed import MEMORY_SAMPLES_KEPT, StatusFeed
from omni_core.serve.metrics import ServeMetrics
from tests.serve.conftest import make_config, stage_table


def _feed() -> StatusFeed:
    config = make_config(stage_table("talker", ranks=2))

    async def no_status() -> dict[str, Any]:
        return {}

    return StatusFeed(config.stages, config.server, ServeMetrics(dict), no_status, ())


def _report(command: str, before: dict[str, int], after: dict[str, int], status: str = "OK") -> LifecycleReport:
    ranks = {
        r: RankReport(r, "SLEEPING", status, 0.0, pool_bytes_before=dict(before), pool_bytes_after=dict(after))
        for r in (0, 1)
    }
    return LifecycleReport("talker", "t", command, status, "SLEEPING", 0.25, ranks)


RESIDENT = {"weights": 200, "kv_cache": 50}
RELEASED = {"weights": 0, "kv_cache": 0}


def test_a_sleep_and_a_wake_are_three_points_over_every_rank() -> None:
    feed = _feed()
    feed.note_report("talker", "sleep", _report("sleep", RESIDENT, RELEASED), 1)
    feed.note_report("talker", "wake", _report("wake", RELEASED, RESIDENT), None)
    points = feed.build_snapshot(None)["memory_history"]["talker"]
    assert [bytes_ for _, bytes_ in points] == [500, 0, 500]  # before the first report, then each
    assert points[0][0] < points[1][0] <= points[2][0]


def test_a_report_that_changes_nothing_adds_no_point_and_a_restart_a_gap() -> None:
    feed = _feed()
    feed.note_report("talker", "sleep", _report("sleep", RESIDENT, RELEASED), 1)
    feed.note_report("talker", "sleep", _report("sleep", {}, {}, status="ALREADY"), 1)  # not measured
    feed.note_report("talker", "wake", _report("wake", RELEASED, RELEASED), None)  # measured, unchanged
    feed.forget("talker")
    feed.note_report("talker", "sleep", _report("sleep", RESIDENT, RELEASED), 1)
    assert [b for _, b in feed.build_snapshot(None)["memory_history"]["talker"]] == [500, 0, None, 500, 0]


def test_memory_moved_by_a_call_the_server_did_not_see_shows_before_the_next_report() -> None:
    feed = _feed()
    feed.note_report("talker", "sleep", _report("sleep", RESIDENT, RELEASED), 1)
    # woken through the Python API: no report here; the next sleep starts from resident
    feed.note_report("talker", "sleep", _report("sleep", RESIDENT, RELEASED), 1)
    assert [b for _, b in feed.build_snapshot(None)["memory_history"]["talker"]] == [500, 0, 500, 0]


def test_the_history_is_bounded() -> None:
    feed = _feed()
    for i in range(MEMORY_SAMPLES_KEPT * 2):
        after = RESIDENT if i % 2 else RELEASED
        feed.note_report("talker", "wake" if i % 2 else "sleep", _report("x", RESIDENT, after), 1)
    points = feed.build_snapshot(None)["memory_history"]["talker"]
    assert len(points) == MEMORY_SAMPLES_KEPT
    assert points[-1][1] == 500  # the newest kept, the oldest dropped
