"""A synthetic runner that counts the requests it ran: a runner with counters of its own
(ModelRunner.counters) without a diffusion model's start-up. Named by import path from the serve
tests (`tests.serve.counting_runner:CountingRunner`); the rank imports it from the repository root."""

from __future__ import annotations

from typing import Any

import torch

from omni_core.runners.synthetic import SyntheticRunner


class CountingRunner(SyntheticRunner):
    def __init__(self, device: torch.device, **runner_args: Any) -> None:
        super().__init__(device, **runner_args)
        self.requests_run = 0

    def execute(self, payload: Any) -> dict[str, Any]:
        self.requests_run += 1
        return super().execute(payload)

    def counters(self) -> dict[str, int]:
        return {"requests_run": self.requests_run, "always_zero": 0}
