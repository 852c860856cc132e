"""A restart keeps the weights version or says it cannot, end to end on CPU with real rank
processes: after a disk update the fresh ranks serve that version; after an update from memory
the stage comes back NEEDS_RELOAD under a version floor, refuses work naming it, refuses an
update below it and takes one at it; `from_checkpoint=True` says version 0 everywhere."""

from __future__ import annotations

import logging

import pytest

from omni_core.engine import RestartReport
from omni_core.engine.errors import InvalidArgumentError, RequestRejectedError
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, small_spec
from tests.engine.test_weight_updates import digest, new_weights, reference


def test_a_restart_after_a_disk_update_serves_the_updated_version(engine_factory) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    engine.update_weights("r", "seed:9", version=4)
    ref.reload_weights("seed:9")
    updated = ref.execute(PROBE)["sha256"]
    assert digest(engine, "r") == updated

    report = engine.restart("r")
    assert isinstance(report, RestartReport)
    assert (report.state, report.epoch, report.weights_version, report.version_floor) == ("RUNNING", 1, 4, 0)
    assert report.weights_source == "disk" and report.version_reset_from is None
    assert "seed:9" in report.detail
    answer = engine.execute("r", PROBE, with_version=True)
    assert (answer.output["sha256"], answer.weights_version) == (updated, 4)
    status = engine.status()["r"]
    assert (status["weights_version"], status["weights_source"], status["version_floor"]) == (4, "disk", 0)
    assert status["ranks"][0]["weights_version"] == 4


def test_a_restart_after_a_memory_update_needs_an_update_at_or_above_the_floor(engine_factory, caplog) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        v3 = new_weights(ref, 13)
        engine.update_weights("r", sender.share(v3), version=3)
        with caplog.at_level(logging.WARNING, logger="omni_core.engine"):
            report = engine.restart("r")
        assert (report.state, report.weights_version, report.version_floor) == ("NEEDS_RELOAD", 0, 3)
        assert report.weights_source == "memory" and "version 3" in report.detail
        assert any("lived in memory only" in r.getMessage() for r in caplog.records)  # the operator's log
        status = engine.status()["r"]
        assert (status["state"], status["version_floor"], status["weights_source"]) == ("NEEDS_RELOAD", 3, "memory")

        # Work is refused, naming the floor and what to do; so is a reload (version 0).
        with pytest.raises(RequestRejectedError, match=r"restarted from version 3.*update its weights to version 3"):
            engine.execute("r", PROBE)
        with pytest.raises(InvalidArgumentError, match="a reload would serve version 0, below the floor"):
            engine.reload_weights("r")
        with pytest.raises(InvalidArgumentError, match="below the stage's version floor 3"):
            engine.update_weights("r", sender.share(v3), version=2)
        assert engine.status()["r"]["state"] == "NEEDS_RELOAD"

        # The trainer sends the version again: the stage serves it.
        assert engine.update_weights("r", sender.share(v3), version=3).state == "RUNNING"
        ref.update_weights(v3.items())
        answer = engine.execute("r", PROBE, with_version=True)
        assert (answer.output["sha256"], answer.weights_version) == (ref.execute(PROBE)["sha256"], 3)
        assert engine.status()["r"]["version_floor"] == 0


def test_a_restart_from_the_checkpoint_resets_the_version_and_says_so(engine_factory, caplog) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    original = ref.execute(PROBE)["sha256"]
    with WeightSender(bucket_bytes=1 << 20) as sender:
        engine.update_weights("r", sender.share(new_weights(ref, 13)), version=5)
    with caplog.at_level(logging.WARNING, logger="omni_core.engine"):
        report = engine.restart("r", from_checkpoint=True)
    assert (report.state, report.weights_version, report.version_floor, report.version_reset_from) == (
        "RUNNING",
        0,
        0,
        5,
    )
    assert "reset from 5 to 0" in report.detail
    assert any("reset from 5 to 0" in r.getMessage() for r in caplog.records)
    status = engine.status()["r"]
    assert (status["weights_version"], status["version_reset_from"], status["weights_source"]) == (
        0,
        5,
        "checkpoint",
    )
    answer = engine.execute("r", PROBE, with_version=True)
    assert (answer.output["sha256"], answer.weights_version) == (original, 0)
    with pytest.raises(InvalidArgumentError, match="from_checkpoint must be True or False"):
        engine.restart("r", from_checkpoint="yes")  # type: ignore[arg-type]
