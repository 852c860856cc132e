"""A tag the runner releases and restores itself (`comm`, ModelRunner.runner_tags) on CPU: the
rank's Hello and every report carry it with the runner's bytes, a sleep releases it through
the runner (the backend never holds it), and a wake gives it back before a request runs."""

from __future__ import annotations

from omni_core.fsm.tags import COMM_TAG
from tests.engine.comm_runner import COMM_BYTES
from tests.engine.conftest import PROBE, small_spec

TAGS = ("weights", "kv_cache", COMM_TAG)


def test_a_runner_held_tag_sleeps_and_wakes_through_the_runner(engine_factory) -> None:
    spec = small_spec("r", runner="tests.engine.comm_runner:CommRunner", tags=TAGS)
    engine = engine_factory(spec)
    before = engine.execute("r", PROBE)
    slept = engine.sleep("r", 1)
    rank = slept.ranks[0]
    assert rank.pool_bytes_before[COMM_TAG] == COMM_BYTES and rank.pool_bytes_after[COMM_TAG] == 0
    assert set(engine.status()["r"]["asleep_tags"]) == set(TAGS)
    woke = engine.wake("r")
    assert woke.ranks[0].pool_bytes_after[COMM_TAG] == COMM_BYTES
    assert engine.execute("r", PROBE) == before  # the runner raises without its buffer


def test_a_partial_wake_leaves_the_runner_held_tag_asleep(engine_factory) -> None:
    spec = small_spec("r", runner="tests.engine.comm_runner:CommRunner", tags=TAGS)
    engine = engine_factory(spec)
    engine.sleep("r", 1)
    partial = engine.wake("r", ["weights", "kv_cache"])
    assert partial.state == "PARTIAL" and partial.ranks[0].pool_bytes_after[COMM_TAG] == 0
    assert engine.wake("r", [COMM_TAG]).ranks[0].pool_bytes_after[COMM_TAG] == COMM_BYTES
