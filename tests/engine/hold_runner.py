"""A runner that never finishes loading: its rank says no Hello, so only the start-up
deadline can end the start. Named by import path from the engine tests
(`tests.engine.hold_runner:HoldRunner`); the rank imports it from the repository root."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from omni_core.runners.synthetic import SyntheticRunner


class HoldRunner(SyntheticRunner):
    def __init__(self, device: torch.device, *, hold_s: float, **runner_args: Any) -> None:
        # Silent for hold_s, then gone without a word: the rank ends itself instead of
        # waiting for a Shutdown that cannot reach a rank whose Hello never came.
        time.sleep(hold_s)
        os._exit(0)
