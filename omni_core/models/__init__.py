"""Seeded local checkpoints for testing real model stages without a model hub.

`make_checkpoint("qwen2", "tiny", dir, seed=0)` (or `omni-core models make qwen2 tiny DIR`)
writes a directory that transformers or diffusers load with `from_pretrained(dir,
local_files_only=True)`. The catalog (`FAMILIES`) is plain data; transformers and diffusers
are imported only when a checkpoint is written.
"""

from __future__ import annotations

from typing import Any

from omni_core.models.catalog import FAMILIES, Family, ModelSpecError, Size, lookup

__all__ = ["FAMILIES", "CheckpointInfo", "Family", "ModelSpecError", "Size", "lookup", "make_checkpoint"]


def __getattr__(name: str) -> Any:
    # make.py imports torch; listing the catalog or checking a name should not.
    if name in ("CheckpointInfo", "make_checkpoint"):
        from omni_core.models import make

        return getattr(make, name)
    raise AttributeError(f"module 'omni_core.models' has no attribute {name!r}")
