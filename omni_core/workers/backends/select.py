"""Choosing a memory backend: by name, by import path, or `auto`.

Selection runs at worker start-up and fails there, with the reason and what to install,
rather than at the first sleep: a worker that says Hello can sleep.
"""

from __future__ import annotations

import torch

from omni_core.runners.base import import_object
from omni_core.workers.backends.base import BackendUnavailable, MemoryBackend
from omni_core.workers.backends.cumem import CumemBackend, cumem_unavailable_reason
from omni_core.workers.backends.host_room import read_host_memory
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.config import BUILTIN_BACKENDS


def _auto(device: torch.device) -> MemoryBackend:
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


def select_backend(name: str, device: torch.device | str) -> MemoryBackend:
    """`auto` | `cumem` | `portable` | `fast` | `package.module:Class` (a MemoryBackend
    subclass taking the device, e.g. a test double or a user's own backend)."""
    device = torch.device(device)
    if name == "auto":
        return _auto(device)
    if name == "cumem":
        return CumemBackend(device)  # raises BackendUnavailable naming the missing piece
    if name == "portable":
        return PortableBackend(device)
    if name == "fast":
        from omni_core.workers.backends.fast import FastBackend

        try:
            return FastBackend(device)
        except BackendUnavailable as exc:  # same needs as cumem: say so under this name
            raise BackendUnavailable(str(exc).replace("backend 'cumem'", "backend 'fast'", 1)) from None
    if ":" in name:
        cls = import_object(name)
        if not (isinstance(cls, type) and issubclass(cls, MemoryBackend)):
            raise TypeError(
                f"backend {name!r} resolves to {cls!r}, which is not a subclass of "
                "omni_core.workers.backends.MemoryBackend"
            )
        return cls(device)
    raise BackendUnavailable(
        f"unknown backend {name!r}; choose one of {list(BUILTIN_BACKENDS)} "
        "or give an import path 'package.module:Class'"
    )
