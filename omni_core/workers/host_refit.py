"""Refit into a sleeping rank (Capability.HOST_REFIT): an update written into the backend's
host copy of the weights while they sleep at level 1, the device untouched.

For the length of the write, every tensor the runner writes through (`host_refit_tensors`) is
pointed at its bytes in the host copy (`MemoryBackend.host_view`): its `.data` is swapped, the
Python object kept, so the runner's own in-place write (a reload from a directory, an update
from shared memory, a trainer's CUDA IPC buckets copied device to host) lands there. Then
every tensor gets its device storage back, still released; the next wake maps the host copy,
now the new version, back. The old and the new weights are never on the device together.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

from omni_core.fsm.effects import UpdateEffect
from omni_core.fsm.tags import WEIGHTS_TAG
from omni_core.runners.base import ModelRunner, RunnerArgumentError, drop_derived_caches, refuse_kept_caches
from omni_core.workers.backends.base import BackendStateError, MemoryBackend
from omni_core.workers.weight_receiver import WeightReceiver


def host_refit_ready(backend: MemoryBackend | None, runner: ModelRunner, tags: Iterable[str]) -> bool:
    """Whether the rank may declare HOST_REFIT: a weights pool, a backend that reaches its host
    copy, and a runner whose every weights write goes through the tensors it names."""
    return backend is not None and backend.supports_host_refit and runner.supports_host_refit and WEIGHTS_TAG in tags


@contextmanager
def weights_on_host(backend: MemoryBackend, tensors: Iterable[torch.Tensor]) -> Iterator[int]:
    """Point each of `tensors` at its host copy while the block runs (yields the bytes they
    span); every one is pointed back at its device storage after, whatever happened. A tensor
    without a host copy refuses the whole write before anything is written."""
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    try:
        views = [(tensor, backend.host_view(WEIGHTS_TAG, tensor)) for tensor in tensors]
    except BackendStateError as exc:
        raise RunnerArgumentError(f"this rank cannot write the update into its host copy: {exc}") from None
    try:
        for tensor, view in views:
            swapped.append((tensor, tensor.data))
            tensor.data = view
        yield sum(view.numel() * view.element_size() for _, view in views)
    finally:
        for tensor, data in reversed(swapped):
            tensor.data = data


def refit_into_host(
    backend: MemoryBackend, runner: ModelRunner, receiver: WeightReceiver, effect: UpdateEffect
) -> tuple[str, ...]:
    """Perform `effect` (into_host) on a rank whose weights sleep at level 1: checked and
    written as an update on the device is, into the host copy. Returns the derived caches dropped."""
    if not effect.flush_cache:
        refuse_kept_caches(runner)  # before anything is written: INVALID_ARGUMENT
    with weights_on_host(backend, runner.host_refit_tensors()):
        receiver.apply(effect.source, runner)
    return drop_derived_caches(runner, flush=effect.flush_cache)
