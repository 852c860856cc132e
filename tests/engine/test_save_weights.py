"""Engine.save_weights end to end on CPU with real rank processes (synthetic runner): a stage
updated from memory saves its version, a restart reloads the save and comes back at that
version with the same outputs (not the NEEDS_RELOAD floor it would come back under without the
save); each rank of a stage writes its own shard; an existing directory is refused unless
overwrite; a save while the weights sleep is refused by the table, nothing written; a failed
write leaves nothing under the target's name."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from omni_core.engine.errors import InvalidArgumentError, StageFailedError
from omni_core.weights_sender import WeightSender
from omni_core.workers.saved_weights import INDEX_FILE
from tests.engine.conftest import PROBE, small_spec
from tests.engine.test_weight_updates import digest, new_weights, reference


def test_a_save_makes_a_memory_version_survive_a_restart(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("s"))
    ref = reference(seed=1)
    saved = tmp_path / "v3"
    with WeightSender(bucket_bytes=1 << 20) as sender:
        engine.update_weights("s", sender.share(new_weights(ref, 13)), version=3)
    served = digest(engine, "s")
    assert engine.status()["s"]["weights_source"] == "memory"

    report = engine.save_weights("s", str(saved))
    assert (report.command, report.status, report.state) == ("SaveWeights", "OK", "RUNNING")
    index = json.loads((saved / INDEX_FILE).read_text())
    assert (index["weights_version"], index["rank"], index["ranks"]) == (3, 0, 1)
    assert "model.safetensors" in index["files"] and (saved / "model.safetensors").is_file()
    assert engine.status()["s"]["weights_source"] == "disk"

    restart = engine.restart("s")
    assert (restart.state, restart.weights_version, restart.version_floor) == ("RUNNING", 3, 0)
    assert restart.weights_source == "disk" and str(saved) in restart.detail
    answer = engine.execute("s", PROBE, with_version=True)
    assert (answer.output["sha256"], answer.weights_version) == (served, 3)


def test_each_rank_writes_its_own_shard_and_reloads_it(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("two", ranks=2))
    engine.update_weights("two", "seed:9", version=2)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        engine.update_weights("two", sender.share(new_weights(reference(seed=3), 5)), version=4)
    served = digest(engine, "two")
    engine.save_weights("two", str(tmp_path / "s"))
    for rank in (0, 1):
        index = json.loads((tmp_path / "s" / f"rank-{rank}" / INDEX_FILE).read_text())
        assert (index["rank"], index["ranks"], index["weights_version"]) == (rank, 2, 4)
    restart = engine.restart("two")
    assert (restart.state, restart.weights_version) == ("RUNNING", 4)
    assert digest(engine, "two") == served


def test_an_existing_directory_is_refused_unless_overwrite(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("o"))
    target = tmp_path / "w"
    engine.save_weights("o", str(target))
    before = (target / "model.safetensors").read_bytes()
    engine.update_weights("o", "seed:9", version=1)
    with pytest.raises(InvalidArgumentError, match="exists; nothing was written"):
        engine.save_weights("o", str(target))
    assert (target / "model.safetensors").read_bytes() == before
    engine.save_weights("o", str(target), overwrite=True)
    assert json.loads((target / INDEX_FILE).read_text())["weights_version"] == 1
    assert (target / "model.safetensors").read_bytes() != before
    assert sorted(os.listdir(tmp_path)) == ["w"]  # neither the old copy nor a staging directory stays


def test_a_save_while_the_weights_sleep_is_refused_and_writes_nothing(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("z"))
    engine.sleep("z", level=2)
    with pytest.raises(InvalidArgumentError, match="cannot save weights in SLEEPING: valid weights must be awake"):
        engine.save_weights("z", str(tmp_path / "never"))
    assert os.listdir(tmp_path) == []
    assert engine.status()["z"]["state"] == "SLEEPING"


def test_a_path_through_a_symlink_or_relative_is_refused(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("l"))
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(InvalidArgumentError, match="goes through the symlink"):
        engine.save_weights("l", str(tmp_path / "link" / "w"))
    assert os.listdir(real) == []
    with pytest.raises(InvalidArgumentError, match="must be an absolute path"):
        engine.save_weights("l", "relative/w")
    assert engine.status()["l"]["weights_source"] == "checkpoint"


def test_a_failed_write_leaves_nothing_that_loads(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("f", runner="tests.engine.save_runner:BrokenSaveRunner"))
    with pytest.raises(InvalidArgumentError, match="does not exist; create it first"):
        engine.save_weights("f", str(tmp_path / "missing" / "w"))
    with pytest.raises(InvalidArgumentError, match="No space left on device"):
        engine.save_weights("f", str(tmp_path / "w"))
    assert os.listdir(tmp_path) == []  # the files written before the failure went with their staging
    assert engine.status()["f"]["weights_source"] == "checkpoint"  # nothing durable was recorded
    assert engine.execute("f", PROBE)["sha256"]  # the stage serves on


def test_a_runner_that_cannot_save_is_refused_unsupported(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("n", runner="tests.engine.save_runner:NoSaveRunner"))
    with pytest.raises(InvalidArgumentError, match=r"UNSUPPORTED.*capability 'save_weights' not declared"):
        engine.save_weights("n", str(tmp_path / "w"))
    assert os.listdir(tmp_path) == []


def _saved_at_three(engine, stage: str, target: Path) -> str:  # type: ignore[no-untyped-def]
    """Stage `stage` updated from memory to version 3 and saved to `target`: what it served."""
    with WeightSender(bucket_bytes=1 << 20) as sender:
        engine.update_weights(stage, sender.share(new_weights(reference(seed=1), 13)), version=3)
    engine.save_weights(stage, str(target))
    return digest(engine, stage)


def test_a_reload_of_a_save_comes_back_at_the_saved_version_bit_for_bit(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("r"))
    served = _saved_at_three(engine, "r", tmp_path / "v3")
    engine.update_weights("r", "seed:9", version=5)  # other weights, from disk
    assert digest(engine, "r") != served
    engine.sleep("r", level=2)
    engine.wake("r")
    report = engine.reload_weights("r", str(tmp_path / "v3"))
    assert (report.state, report.weights_version, report.ranks[0].weights_version) == ("RUNNING", 3, 3)
    answer = engine.execute("r", PROBE, with_version=True)
    assert (answer.output["sha256"], answer.weights_version) == (served, 3)
    status = engine.status()["r"]
    assert (status["weights_version"], status["weights_source"]) == (3, "disk")
    restart = engine.restart("r")  # the reloaded save is where version 3 lives now
    assert (restart.state, restart.weights_version) == ("RUNNING", 3) and digest(engine, "r") == served
    with pytest.raises(InvalidArgumentError, match="weights version 3 is not above the stage's version 3"):
        engine.update_weights("r", "seed:9", version=3)
    assert engine.update_weights("r", "seed:9", version=4).weights_version == 4


def test_a_reload_of_a_save_below_the_floor_fails_rather_than_serve_it(engine_factory, tmp_path: Path) -> None:
    engine = engine_factory(small_spec("b"))
    _saved_at_three(engine, "b", tmp_path / "v3")
    with WeightSender(bucket_bytes=1 << 20) as sender:
        engine.update_weights("b", sender.share(new_weights(reference(seed=1), 17)), version=4)
    assert engine.restart("b").version_floor == 4  # version 4 lived in memory only
    with pytest.raises(InvalidArgumentError, match="a reload would serve version 0, below the floor"):
        engine.reload_weights("b")  # the runner's own weights
    with pytest.raises(StageFailedError, match=r"reloaded weights version 3 .*below the stage's floor 4"):
        engine.reload_weights("b", str(tmp_path / "v3"))
    assert engine.status()["b"]["state"] == "FAILED"  # never RUNNING at 3
    assert engine.restart("b").version_floor == 4  # and the floor stands
