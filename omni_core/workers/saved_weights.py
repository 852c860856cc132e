"""A rank's half of SaveWeights: the runner's files written beside the target, an index that
names the version, and one rename that makes the directory appear whole.

The target is a path a caller named (the HTTP server holds it to `allowed_reload_sources`
first, `AppState.check_source`): it must be absolute, and no component of it that exists
may be a symlink (a link would send the rank's writes elsewhere). The runner writes into a
fresh temporary directory beside the target (`.<name>.saving-*`, the same file system, so
the rename is atomic), every file is synced, the index is written last, and only then is the
directory renamed into place: a save that fails or is killed leaves no directory under the
target's name, and the temporary one holds no index, so nothing loads it as a save. A target
that exists is refused unless the command says `overwrite`; then the old one is moved aside,
the new one renamed in, and the old one removed.

A stage of one rank writes `directory` itself, a checkpoint its runner loads as its own; of
several, rank r writes `directory/rank-<r>`, and `rank_source` sends each rank's reload (and
a restart's) to its own shard.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omni_core.protocol import SaveWeights
from omni_core.protocol.weights import MAX_WEIGHTS_VERSION
from omni_core.runners.base import ModelRunner, RunnerArgumentError

INDEX_FILE = "omni_weights.json"
FORMAT = "omni-core/saved-weights/1"
MAX_INDEX_BYTES = 1 << 20


@dataclass(frozen=True)
class SavedRank:
    """Who writes: the rank, its stage's rank count, the version it holds and where it came from."""

    rank: int
    version: int
    origin: str | None


@dataclass(frozen=True)
class Reloaded:
    """What a rank's reload did: the derived caches it dropped (the Ack names them) and the
    version it now holds (`saved_version`)."""

    caches: tuple[str, ...]
    version: int


def target_of(command: SaveWeights, rank: int) -> Path:
    """Where `rank` writes: the directory itself for a stage of one rank, else its shard."""
    if rank >= command.ranks:
        raise RunnerArgumentError(
            f"rank {rank} is not among the {command.ranks} ranks the SaveWeights names; send the stage's rank count"
        )
    directory = checked_path(command.directory)
    return directory if command.ranks == 1 else directory / f"rank-{rank}"


def checked_path(text: str) -> Path:
    """`text` as an absolute path none of whose existing components is a symlink."""
    if "\0" in text or not os.path.isabs(text):
        raise RunnerArgumentError(f"the save directory {text[:200]!r} must be an absolute path without NUL characters")
    path = Path(os.path.normpath(text))
    if ".." in Path(text).parts:
        raise RunnerArgumentError(f"the save directory {text[:200]!r} holds '..': name the directory itself")
    for here in [*reversed(path.parents), path]:
        if here.is_symlink():
            raise RunnerArgumentError(
                f"the save directory {text[:200]!r} goes through the symlink {str(here)!r}; a save "
                "never follows one: name the real directory"
            )
    return path


def save_rank(runner: ModelRunner, command: SaveWeights, who: SavedRank) -> str:
    """Write this rank's weights where `command` says, whole or not at all; the path written."""
    target = target_of(command, who.rank)
    if command.ranks > 1:
        with_parent(target.parent)
    elif not target.parent.is_dir():
        raise RunnerArgumentError(f"the save directory's parent {str(target.parent)!r} does not exist; create it first")
    if (target.exists() or target.is_symlink()) and not command.overwrite:
        raise RunnerArgumentError(
            f"{str(target)!r} exists; nothing was written: name a new directory, or send overwrite=true to replace it"
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.saving-", dir=target.parent))
    try:
        files = runner.save_weights(staging, command.max_file_bytes)
        index = {
            "format": FORMAT,
            "weights_version": who.version,
            "rank": who.rank,
            "ranks": command.ranks,
            "derived_from": who.origin,
            "runner": type(runner).__name__,
            "files": sorted(files),
        }
        _sync_tree(staging)
        _write_synced(staging / INDEX_FILE, json.dumps(index, indent=1).encode())
        _install(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return str(target)


def with_parent(directory: Path) -> None:
    """The shared directory of a many-rank save: made by the first rank there, a real directory."""
    try:
        directory.mkdir(exist_ok=True)
    except FileNotFoundError:
        raise RunnerArgumentError(
            f"the save directory's parent {str(directory.parent)!r} does not exist; create it first"
        ) from None
    if directory.is_symlink() or not directory.is_dir():
        raise RunnerArgumentError(f"{str(directory)!r} is not a directory; name a directory for the save")


def _install(staging: Path, target: Path) -> None:
    """Rename the finished `staging` to `target`; an old target (overwrite) is moved aside
    first and removed after, so the name always holds a whole save or nothing."""
    old: Path | None = None
    if target.exists() or target.is_symlink():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.replaced-", dir=target.parent))
        os.rename(target, old / "old")  # a symlink is moved, never followed
    os.rename(staging, target)
    _sync_dir(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(directory: Path) -> None:
    """Every file written reaches the disk before the index says the save is whole."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _sync_dir(Path(root))


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(directory: str) -> dict[str, object] | None:
    """The index of a saved directory, None where `directory` holds none (a plain checkpoint,
    or a source that is no absolute path: a seed, a hub name, which never names the cwd)."""
    path = Path(directory) / INDEX_FILE
    # os.path.isfile, not Path.is_file: a name too long for the file system is no save either
    # (Path.is_file raises ENAMETOOLONG, which ended a rank on a fuzzed 5000-digit seed).
    if not os.path.isabs(directory) or not os.path.isfile(path):
        return None
    if path.stat().st_size > MAX_INDEX_BYTES:
        raise RunnerArgumentError(f"{str(path)!r} is larger than {MAX_INDEX_BYTES} bytes: not a save's index")
    try:
        index = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise RunnerArgumentError(f"cannot read the save index {str(path)!r}: {exc}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise RunnerArgumentError(f"{str(path)!r} is not a save index of format {FORMAT!r}")
    return index


def rank_source(source: str, rank: int) -> str:
    """Where `rank` reads a saved directory from: its own shard of a many-rank save, else `source`."""
    shard = os.path.join(source, f"rank-{rank}")
    if not os.path.isfile(os.path.join(source, INDEX_FILE)) and os.path.isfile(os.path.join(shard, INDEX_FILE)):
        return shard
    return source


def saved_version(source: str | None) -> int:
    """The weights version a reload of `source` brings: the one a save's index names, 0 for
    the runner's own source or a plain checkpoint. Read before anything is written, so that a
    bad index refuses the reload (RunnerArgumentError) with the weights untouched."""
    index = None if source is None else read_index(source)
    if index is None:
        return 0
    version = index.get("weights_version")
    if not isinstance(version, int) or isinstance(version, bool) or not 0 <= version <= MAX_WEIGHTS_VERSION:
        raise RunnerArgumentError(
            f"the save index in {source!r} names weights version {version!r}, not an int in "
            f"0..{MAX_WEIGHTS_VERSION}: it is not a save omni-core wrote; save again"
        )
    return version


def check_saved_version(source: str, version: int) -> None:
    """A restart at `version` from `source`: a saved directory must hold that version."""
    index = read_index(source)
    if index is not None and saved_version(source) != version:
        raise RunnerArgumentError(
            f"{source!r} holds weights version {index.get('weights_version')!r}, and the stage restarts at "
            f"version {version}: the directory was replaced since it was saved; save again, or restart "
            "with from_checkpoint=True"
        )
