"""OpenRLHF's vLLM actor over an omni-core stage: the calls its trainer makes on the actor
(`openrlhf/trainer/ray/vllm_engine.py`'s `LLMRayActor`: `init_process_group`, `update_weight`,
`update_weight_cuda_ipc`, `reset_prefix_cache`, `sleep`, `wake_up`) and the `collective_rpc`
its worker extension (`vllm_worker_wrap.py`'s `WorkerWrap`) is reached by, each mapped onto
the stage's typed commands by `StageExtension`. Wrap it in a Ray actor as OpenRLHF does with
its own; nothing here imports OpenRLHF or Ray."""

from __future__ import annotations

from typing import Any

from omni_core.integrations.extension import StageExtension


class OpenRLHFActor(StageExtension):
    """OpenRLHF's `LLMRayActor` calls on one stage. The weight-update methods are the worker
    extension's, called on every rank at once (omni-core's command reaches each); OpenRLHF's
    trainer broadcasts from group rank 0 with `torch.distributed.broadcast(src=0)` while
    `update_weight` runs, over the group `init_process_group` joined."""

    def generate(self, payload: Any) -> Any:
        """One request on the stage (the runner's payload): rank 0's output."""
        return self.engine.execute(self.stage, payload)
