"""Choosing a memory backend: by registered name (omni_core.plugins), by import path, or `auto`.

Selection runs at worker start-up and fails there, with the reason and what to install,
rather than at the first sleep: a worker that says Hello can sleep.
"""

from __future__ import annotations

import torch

from omni_core.plugins import BACKENDS, BUILTIN, name_problem, resolve
from omni_core.workers.backends.base import BackendUnavailable, MemoryBackend
from omni_core.workers.backends.cumem import CumemBackend, cumem_unavailable_reason
from omni_core.workers.backends.host_room import read_host_memory
from omni_core.workers.backends.portable import PortableBackend


def auto_backend(device: torch.device) -> MemoryBackend:
    """`fast` where vLLM's allocator works and the host can hold the pinned weight arena
    (decided at load, when the weights' size is known: `FastBackend(host_memory=...)` runs as
    `cumem` otherwise); `portable` where the allocator cannot work. Either way the backend's
    `choice_reason` says why, and the Hello carries it."""
    unavailable = cumem_unavailable_reason(device)
    if unavailable is not None:
        backend: MemoryBackend = PortableBackend(device)
        backend.choice_reason = f"auto chose 'portable' (addresses not kept): {unavailable}"
        return backend
    from omni_core.workers.backends.fast import FastBackend

    try:
        return FastBackend(device, host_memory=read_host_memory)
    except RuntimeError as exc:  # BackendUnavailable, or no CUDA runtime library to call
        backend = CumemBackend(device)
        backend.choice_reason = f"auto chose 'cumem': the fast path cannot run here ({exc})"
        return backend


def fast_backend(device: torch.device) -> MemoryBackend:
    """The fast path, refused under its own name where it cannot run (it needs what cumem does)."""
    from omni_core.workers.backends.fast import FastBackend

    try:
        return FastBackend(device)
    except BackendUnavailable as exc:
        raise BackendUnavailable(str(exc).replace("backend 'cumem'", "backend 'fast'", 1)) from None


def select_backend(name: str, device: torch.device | str) -> MemoryBackend:
    """A backend by name (omni_core.plugins: `auto`, `cumem`, `portable`, `fast`, or one an
    installed package registers) or import path `package.module:Class` (a MemoryBackend
    subclass taking the device, e.g. a test double or a user's own backend). A builtin that
    cannot run here raises BackendUnavailable naming the missing piece."""
    problem = name_problem(BACKENDS, name)
    if problem:
        raise BackendUnavailable(problem)
    make = resolve(BACKENDS, name)
    if name not in BUILTIN[BACKENDS] and not (isinstance(make, type) and issubclass(make, MemoryBackend)):
        raise TypeError(
            f"backend {name!r} resolves to {make!r}, which is not a subclass of "
            "omni_core.workers.backends.MemoryBackend"
        )
    return make(torch.device(device))
