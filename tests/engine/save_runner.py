"""Runners for the save tests, named by import path (`tests.engine.save_runner:...`); the rank
imports them from the repository root."""

from __future__ import annotations

from pathlib import Path

from omni_core.runners.base import ModelRunner
from omni_core.runners.synthetic import SyntheticRunner


class BrokenSaveRunner(SyntheticRunner):
    """Writes its files, then fails before the save is whole (a disk that fills up)."""

    def save_weights(self, directory: Path, max_file_bytes: int) -> list[str]:
        super().save_weights(directory, max_file_bytes)
        raise OSError(28, "No space left on device (the test's disk)")


class NoSaveRunner(SyntheticRunner):
    """A runner that cannot save: it keeps the base class's refusal."""

    save_weights = ModelRunner.save_weights  # type: ignore[assignment]
