"""A consumer runner that can leave what landed for its request untouched: `{"peek": true}`
answers how many landings its rank holds (its own included: it never takes it), `{"fail":
true}` raises before taking anything; as a middle stage it exports from its own rows, leaving
what landed to its release. Named by import path from the pipeline tests
(`tests.engine.peek_runner:PeekRunner`); the rank imports it from the repository root."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from omni_core.runners.synthetic import SyntheticRunner


class PeekRunner(SyntheticRunner):
    def execute(self, payload: Any) -> dict[str, Any]:
        if isinstance(payload, dict) and payload.get("fail"):
            raise RuntimeError("this request fails before it takes its landing")
        if isinstance(payload, dict) and payload.get("peek"):
            return {"held": len(self.inbox)}
        return super().execute(payload)

    def export_tensors(self, payload: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
        rest = {k: v for k, v in payload.items() if k != "transfer"} if isinstance(payload, dict) else payload
        return super().export_tensors(rest, names)
