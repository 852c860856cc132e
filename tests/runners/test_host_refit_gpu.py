"""Refit into a sleeping rank on a GPU, on the cumem path (HOST_REFIT): the transformers runner's
weights in vLLM's CuMemAllocator pools, asleep at level 1; a reload and an update written into
the allocator's host copies (its `cpu_backup_tensor`s) while nothing is mapped, the device's
free memory unchanged by the write; the wake brings back exactly a runner started on the new
weights. Skips without CUDA or a usable cumem allocator.

    source .device/setup.sh && python3 -m pytest -m gpu tests/runners/test_host_refit_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from omni_core.fsm.tags import plan_sleep
from omni_core.runners.transformers_runner import TransformersRunner
from omni_core.workers.backends import cumem_unavailable_reason
from omni_core.workers.backends.base import MemoryBackend
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.host_refit import host_refit_ready, weights_on_host

from .test_transformers_runner import GREEDY

MiB = 1 << 20
TAGS = ("weights", "kv_cache")


def _problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return cumem_unavailable_reason(torch.device("cuda"))


_PROBLEM = _problem()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_PROBLEM is not None, reason=f"cumem unusable: {_PROBLEM}")]


def _loaded(backend: MemoryBackend, directory: object) -> TransformersRunner:
    runner = TransformersRunner(backend.device, model=str(directory), max_seq_len=64)
    for tag in TAGS:
        with backend.pool(tag):
            runner.allocate(tag)
        backend.track(tag, runner.tensors(tag))
    return runner


def _sleep(backend: MemoryBackend, runner: TransformersRunner) -> None:
    plan = plan_sleep(1, frozenset(TAGS))
    runner.before_sleep(plan.offload, plan.discard)
    backend.sleep(plan.offload, plan.discard, buffers=runner.buffers_to_save())


@pytest.mark.parametrize("backend_name", ["cumem", "fast"])
def test_a_refit_into_the_host_copies_never_maps_and_wakes_to_the_new_weights(checkpoints, backend_name) -> None:
    from omni_core.workers.backends.cumem import CumemBackend
    from omni_core.workers.backends.fast import FastBackend

    device = torch.device("cuda", torch.cuda.current_device())
    reference = _loaded(PortableBackend(device), checkpoints["qwen2-seed1"])
    expected = reference.execute(GREEDY)
    del reference
    torch.cuda.empty_cache()

    # fast: the host copies are slots of its registered arena, written by the CPU here.
    backend = CumemBackend(device) if backend_name == "cumem" else FastBackend(device)
    runner = _loaded(backend, checkpoints["qwen2"])
    assert host_refit_ready(backend, runner, TAGS)
    assert runner.execute(GREEDY) != expected
    _sleep(backend, runner)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info(device)[0]
    with weights_on_host(backend, runner.host_refit_tensors()) as nbytes:
        runner.reload_weights(str(checkpoints["qwen2-seed1"]))
        torch.cuda.synchronize()
        free_during = torch.cuda.mem_get_info(device)[0]
    assert nbytes > 0 and backend.usage()["weights"] == 0
    assert abs(free_before - free_during) < 64 * MiB, (free_before, free_during)  # nothing mapped
    backend.wake(set(TAGS))
    assert runner.execute(GREEDY) == expected
