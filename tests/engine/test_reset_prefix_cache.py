"""Engine.reset_prefix_cache end to end on CPU: real rank processes whose runner caches across
requests; the caches are emptied, no pool byte is released, the state never changes, and a
sleeping stage refuses it."""

from __future__ import annotations

import asyncio

import pytest

from omni_core.engine import AsyncEngine, InvalidArgumentError, LifecycleReport
from tests.engine.conftest import PROBE, small_spec

RUNNER = "omni_testing.faults:PrefixCachingRunner"
CACHE = {"op": "prefix_cache"}


def test_reset_prefix_cache_empties_every_ranks_cache_and_releases_nothing(engine_factory) -> None:
    engine = engine_factory(small_spec("cache", ranks=2, runner=RUNNER))
    for seed in (1, 2):
        engine.execute("cache", {**PROBE, "seed": seed})
    assert engine.execute("cache", CACHE) == {"entries": 2, "dropped": 0}
    report = engine.reset_prefix_cache("cache")
    assert isinstance(report, LifecycleReport)
    assert (report.command, report.status, report.state) == ("ResetPrefixCache", "OK", "RUNNING")
    assert sorted(report.ranks) == [0, 1]
    for rank in report.ranks.values():
        assert rank.freed_bytes == 0 and rank.pool_bytes_after == rank.pool_bytes_before
        assert rank.pool_bytes_after["kv_cache"] > 0
    assert engine.execute("cache", CACHE) == {"entries": 0, "dropped": 2}
    assert engine.sleep("cache").state == "SLEEPING"
    with pytest.raises(InvalidArgumentError, match="cannot reset the prefix cache in SLEEPING"):
        engine.reset_prefix_cache("cache")
    assert engine.status()["cache"]["state"] == "SLEEPING"


def test_the_async_engine_mirrors_it() -> None:
    async def main() -> tuple[str, str]:
        async with AsyncEngine([small_spec("acache", runner=RUNNER)]) as engine:
            await engine.execute("acache", PROBE)
            report = await engine.reset_prefix_cache("acache", task_id="r1")
            cache = await engine.execute("acache", CACHE)
            return report.task_id, cache

    assert asyncio.run(main()) == ("r1", {"entries": 0, "dropped": 1})
