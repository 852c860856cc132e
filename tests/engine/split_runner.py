"""A synthetic runner whose rank 1 refuses one adapter source: the engine tests name it by
import path (`tests.engine.split_runner:SplitRunner`) to make an adapter command that some
ranks of a stage take and another refuses, as a rank that cannot open a bucket or read a
file does. Every other rank, and every other source, is the synthetic runner's."""

from __future__ import annotations

import os

from omni_core.protocol import AddAdapter
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.synthetic import SyntheticRunner

REFUSED_ON_RANK_1 = "refused-on-rank-1"  # an AddAdapter `source` (a label for tensors) rank 1 refuses


class SplitRunner(SyntheticRunner):
    def check_adapter(self, command: AddAdapter) -> None:
        if command.source == REFUSED_ON_RANK_1 and os.environ.get("RANK") == "1":
            raise RunnerArgumentError(f"rank 1 refuses adapter source {REFUSED_ON_RANK_1!r} (a test's split)")
        super().check_adapter(command)
