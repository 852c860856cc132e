"""The rank's half of SaveWeights without a process: the path checks, where each rank writes,
the staging directory that a failure removes, overwrite, the index, and where a reload or a
restart of a save reads (its own shard; the version it holds)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from omni_core.protocol import SaveWeights
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.saved_weights import (
    INDEX_FILE,
    SavedRank,
    check_saved_version,
    checked_path,
    rank_source,
    read_index,
    save_rank,
    saved_version,
    target_of,
)

SMALL = {"weights_bytes": 1 << 16, "kv_bytes": 1 << 12, "tensor_count": 2}


def _runner() -> SyntheticRunner:
    runner = SyntheticRunner(torch.device("cpu"), **SMALL)
    runner.load_weights()
    runner.allocate_caches()
    return runner


def _save(directory: Path, **fields: object) -> SaveWeights:
    return SaveWeights(task_id="s", epoch=0, directory=str(directory), **fields)  # type: ignore[arg-type]


def test_paths_must_be_absolute_plain_and_free_of_symlinks(tmp_path: Path) -> None:
    for bad, why in (("rel/w", "must be an absolute path"), (f"{tmp_path}/../x", "holds '..'"), ("/a\0b", "NUL")):
        with pytest.raises(RunnerArgumentError, match=why):
            checked_path(bad)
    (tmp_path / "link").symlink_to(tmp_path)
    with pytest.raises(RunnerArgumentError, match="goes through the symlink"):
        checked_path(str(tmp_path / "link" / "w"))
    assert checked_path(str(tmp_path / "w")) == tmp_path / "w"


def test_one_rank_writes_the_directory_several_write_a_shard_each(tmp_path: Path) -> None:
    assert target_of(_save(tmp_path / "w"), 0) == tmp_path / "w"
    assert target_of(_save(tmp_path / "w", ranks=3), 2) == tmp_path / "w" / "rank-2"
    with pytest.raises(RunnerArgumentError, match="rank 3 is not among the 3 ranks"):
        target_of(_save(tmp_path / "w", ranks=3), 3)


def test_a_save_holds_an_index_and_reloads_bit_for_bit(tmp_path: Path) -> None:
    runner = _runner()
    written = save_rank(runner, _save(tmp_path / "w"), SavedRank(0, 7, "seed:0"))
    index = read_index(written)
    assert index is not None and (index["weights_version"], index["derived_from"]) == (7, "seed:0")
    assert sorted(os.listdir(tmp_path)) == ["w"]
    before = [w.clone() for w in runner.weights]
    runner.reload_weights("seed:5")
    runner.reload_weights(written)
    assert all(torch.equal(a, b) for a, b in zip(runner.weights, before, strict=True))
    check_saved_version(written, 7)
    with pytest.raises(RunnerArgumentError, match="holds weights version 7, and the stage restarts at version 8"):
        check_saved_version(written, 8)


def test_a_failure_leaves_nothing_and_overwrite_replaces_whole(tmp_path: Path, monkeypatch) -> None:
    runner = _runner()
    save_rank(runner, _save(tmp_path / "w"), SavedRank(0, 1, None))
    with pytest.raises(RunnerArgumentError, match="exists; nothing was written"):
        save_rank(runner, _save(tmp_path / "w"), SavedRank(0, 2, None))

    def broken(directory: Path, max_file_bytes: int) -> list[str]:
        (directory / "half.safetensors").write_bytes(b"x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "save_weights", broken)
    with pytest.raises(OSError, match="No space left"):
        save_rank(runner, _save(tmp_path / "w", overwrite=True), SavedRank(0, 2, None))
    assert sorted(os.listdir(tmp_path)) == ["w"]  # the old save stands, no staging is left
    assert json.loads((tmp_path / "w" / INDEX_FILE).read_text())["weights_version"] == 1
    monkeypatch.undo()
    save_rank(runner, _save(tmp_path / "w", overwrite=True), SavedRank(0, 2, None))
    assert json.loads((tmp_path / "w" / INDEX_FILE).read_text())["weights_version"] == 2
    assert sorted(os.listdir(tmp_path)) == ["w"]


def test_each_rank_reads_its_own_shard_of_a_many_rank_save(tmp_path: Path) -> None:
    runner = _runner()
    for rank in (0, 1):
        save_rank(runner, _save(tmp_path / "w", ranks=2), SavedRank(rank, 4, None))
    assert rank_source(str(tmp_path / "w"), 1) == str(tmp_path / "w" / "rank-1")
    assert rank_source(str(tmp_path / "w" / "rank-1"), 1) == str(tmp_path / "w" / "rank-1")  # a save itself
    assert rank_source("seed:3", 0) == "seed:3"  # not a directory: as given
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / INDEX_FILE).write_text('{"format": "other"}')
    with pytest.raises(RunnerArgumentError, match="is not a save index"):
        read_index(str(tmp_path / "foreign"))


@pytest.mark.parametrize("version", [-1, True, "3", 1 << 63, None])
def test_a_reload_reads_the_saves_version_and_refuses_an_index_that_names_none(tmp_path: Path, version) -> None:
    runner = _runner()
    written = save_rank(runner, _save(tmp_path / "w"), SavedRank(0, 7, None))
    assert (saved_version(written), saved_version("seed:3"), saved_version(None)) == (7, 0, 0)
    index = json.loads((tmp_path / "w" / INDEX_FILE).read_text())
    (tmp_path / "w" / INDEX_FILE).write_text(json.dumps({**index, "weights_version": version}))
    with pytest.raises(RunnerArgumentError, match=r"names weights version .*not an int in 0\.\."):
        saved_version(written)


def test_only_an_absolute_path_is_read_as_a_save(tmp_path: Path, monkeypatch) -> None:
    written = save_rank(_runner(), _save(tmp_path / "w"), SavedRank(0, 5, None))
    monkeypatch.chdir(tmp_path)  # "w" names the save from here, but a relative source is a seed or a hub name
    assert (saved_version(written), read_index("w"), saved_version("w")) == (5, None, 0)
    assert read_index("/" + "9" * 5000) is None  # longer than a name may be: no save, not an OSError
