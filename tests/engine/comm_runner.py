"""A test double for a runner that holds a tag itself (`comm`, as the vllm runner holds vLLM's
NCCL communicators): the synthetic runner with a buffer of COMM_BYTES it frees in
before_sleep and allocates again in after_wake, outside every backend pool. A request checks
that the buffer is there, so a wake that forgot it fails the request."""

from __future__ import annotations

from typing import Any

import torch

from omni_core.fsm.tags import COMM_TAG
from omni_core.runners.synthetic import SyntheticRunner

COMM_BYTES = 1 << 16


class CommRunner(SyntheticRunner):
    comm: torch.Tensor | None = None

    def allocate(self, tag: str) -> None:
        if tag == COMM_TAG:
            self.comm = torch.zeros(COMM_BYTES, dtype=torch.uint8, device=self.device)
        else:
            super().allocate(tag)

    def tensors(self, tag: str) -> list[torch.Tensor]:
        return [] if tag == COMM_TAG else super().tensors(tag)

    def runner_tags(self) -> frozenset[str]:
        return frozenset({COMM_TAG})

    def held_bytes(self, tag: str) -> int:
        return self.comm.numel() if tag == COMM_TAG and self.comm is not None else 0

    def before_sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None:
        super().before_sleep(offload, discard)
        if COMM_TAG in offload | discard:
            self.comm = None

    def after_wake(self, tags: frozenset[str]) -> None:
        super().after_wake(tags)
        if COMM_TAG in tags:
            self.allocate(COMM_TAG)

    def execute(self, payload: Any) -> Any:
        if self.comm is None:
            raise RuntimeError("the communicators are released: a wake did not restore them")
        return super().execute(payload)
