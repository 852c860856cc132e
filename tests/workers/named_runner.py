"""A synthetic runner that reports `names` loaded weights (`loaded_weights`) and step mode, for
the tests of what a rank's Hello says of them. Named by import path
(`tests.workers.named_runner:NamedWeightsRunner`); the rank imports it from the repository root."""

from __future__ import annotations

from typing import Any

import torch

from omni_core.runners.synthetic import SyntheticRunner


class NamedWeightsRunner(SyntheticRunner):
    supports_step_mode = True

    def __init__(self, device: torch.device, *, names: int = 3, name_chars: int = 8, **kwargs: Any) -> None:
        super().__init__(device, **kwargs)
        self.names = [f"w{i:0{name_chars - 1}d}" for i in reversed(range(names))]

    def loaded_weights(self) -> frozenset[str]:
        return frozenset(self.names)
