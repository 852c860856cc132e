"""vLLM's GPU worker with omni-core's memory: the `worker_cls` the vllm runner gives `LLM`.

Imported by vLLM (by class path) in the rank process, never by omni-core's own code paths,
because importing it imports vLLM. Two overrides, nothing else:

- `_maybe_get_memory_pool_context(tag)`: where vLLM allocates weights and KV cache, the
  omni-core backend's `pool(tag)` (vLLM's own would assert it is the allocator's only user,
  and the backend must know every pool it will sleep);
- `determine_available_memory()`: with a `gpu_memory_fraction`, the KV cache gets the
  stage's share of the device minus what this process holds after vLLM's profiling run
  (NVML per PID), not vLLM's device-wide measurement, so co-located stages can start at the
  same time without counting each other's memory (vLLM-Omni's `OmniGPUWorkerBase`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from vllm.v1.worker.gpu_worker import Worker

from omni_core.runners.vllm_runner import current_binding, kv_cache_bytes


class OmniVllmWorker(Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        current_binding().worker = self

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager[None]:
        return current_binding().open_pool(tag)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        binding = current_binding()
        if binding.budget is None:  # no fraction: vLLM's own (device-wide) profiling
            binding.kv_cache_bytes = int(super().determine_available_memory())
            return binding.kv_cache_bytes
        self.model_runner.profile_run()
        torch.cuda.synchronize()
        binding.kv_cache_bytes = kv_cache_bytes(binding.budget, torch.cuda.memory_stats())
        return binding.kv_cache_bytes
