"""A synthetic runner that reloads from a checkpoint directory, as a real runner does: the
directory's file `seed` holds the seed its weights are filled from. The serve tests name it by
import path (`tests.serve.checkpoint_runner:CheckpointRunner`) to send reloads and updates from
disk that a rank honours (the synthetic runner itself takes 'seed:<int>' only), and adapters
from such a directory."""

from __future__ import annotations

from pathlib import Path

import msgspec

from omni_core.protocol import AddAdapter
from omni_core.runners.synthetic import SyntheticRunner


class CheckpointRunner(SyntheticRunner):
    def reload_weights(self, source: str | None) -> None:
        if source is not None and Path(source).is_dir():
            seed = (Path(source) / "seed").read_text(encoding="utf-8").strip()
            source = f"seed:{seed}"
        super().reload_weights(source)

    # An adapter from a directory too (P-20): its file `seed` seeds it, as 'seed:<int>' would.
    def check_adapter(self, command: AddAdapter) -> None:
        super().check_adapter(_seeded(command))

    def add_adapter(self, command: AddAdapter) -> None:
        super().add_adapter(_seeded(command))


def _seeded(command: AddAdapter) -> AddAdapter:
    path = Path(command.source)
    if command.tensors is None and (path / "seed").is_file():
        seed = (path / "seed").read_text(encoding="utf-8").strip()
        return msgspec.structs.replace(command, source=f"seed:{seed}")
    return command


def write_checkpoint(root: Path, name: str, seed: int) -> Path:
    """A checkpoint directory under `root` that CheckpointRunner fills its weights from."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "seed").write_text(str(seed), encoding="utf-8")
    return path
