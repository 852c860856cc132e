"""A synthetic runner that counts the batches its rank hands it (`counters`: shown in the
stage's status), for the engine tests of many requests in flight. Named by import path
(`tests.engine.batch_runner:BatchCountingRunner`); the rank imports it from the repository root."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omni_core.runners.synthetic import SyntheticRunner


class BatchCountingRunner(SyntheticRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches = self.requests = self.largest = 0

    def execute_batch(self, payloads: Sequence[Any]) -> list[Any]:
        self.batches += 1
        self.requests += len(payloads)
        self.largest = max(self.largest, len(payloads))
        return super().execute_batch(payloads)

    def counters(self) -> Mapping[str, int]:
        return {"batches": self.batches, "batched_requests": self.requests, "largest_batch": self.largest}
