"""verl's rollout over an omni-core stage: the methods of verl's `BaseRollout`
(`verl/workers/rollout/base.py`: `resume(tags)`, `update_weights(weights, **kwargs)`,
`release()`, `generate_sequences(prompts)`) that its colocated trainer calls around each step:
release the rollout's memory, train, resume the weights, push them, resume the KV cache,
generate. The pushed tensors go to the stage in `WeightSender`'s buckets (CUDA IPC with typed
handles on a GPU, shared memory on the host), not over verl's ZMQ socket of pickles. Nothing
here imports verl."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any

import torch

from omni_core.engine import Engine, LifecycleReport
from omni_core.integrations.extension import ExtensionRefusedError
from omni_core.weights_sender import DEFAULT_BUCKET_BYTES, WeightSender

# verl's update_weights keyword arguments taken, each at the value that asks nothing more.
IGNORED_WHEN = {"peft_config": None, "base_sync_done": True}


class OmniRollout:
    """verl's `BaseRollout` on one stage of an `Engine`. `release` sleeps the stage at
    `sleep_level` (1: the weights wait in host memory; 2: discarded, the next push brings
    them); `update_weights` commits the stage's next weights version, or `version`."""

    def __init__(
        self, engine: Engine, stage: str, *, sleep_level: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        self.engine, self.stage, self.sleep_level = engine, stage, sleep_level
        self.sender = WeightSender(bucket_bytes=bucket_bytes)

    async def resume(self, tags: list[str]) -> LifecycleReport:
        """Bring the tags back (verl: "weights" before a push, "kv_cache" before generating);
        a tag already resident is ALREADY."""
        return await asyncio.to_thread(self.engine.wake, self.stage, tags)

    async def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], **kwargs: Any) -> LifecycleReport:
        """Take every (name, tensor) the generator yields as one update. The buckets stay
        shared for the next push, which refills them (the ranks read them through the mappings
        they hold); `close()` releases them."""
        version = kwargs.pop("version", None)
        refused = sorted(k for k, v in kwargs.items() if k not in IGNORED_WHEN or v != IGNORED_WHEN[k])
        if refused:
            raise ExtensionRefusedError(
                f"update_weights keyword arguments {refused} are not served (LoRA adapters load through the "
                "stage's adapter routes); send only the weights, and optionally version=. Nothing was sent"
            )
        source = self.sender.share(dict(weights))
        if version is None:
            version = (await asyncio.to_thread(self.engine.status))[self.stage]["weights_version"] + 1
        return await asyncio.to_thread(self.engine.update_weights, self.stage, source, version=version)

    async def release(self) -> LifecycleReport:
        """Free the stage's device memory for training: every tag sleeps."""
        return await asyncio.to_thread(self.engine.sleep, self.stage, self.sleep_level)

    def generate_sequences(self, prompts: Any) -> Any:
        """One request on the stage with the runner's payload (verl's DataProto is verl's own)."""
        return self.engine.execute(self.stage, prompts)

    def close(self) -> None:
        self.sender.close()
