"""Choosing a memory backend: by name, by import path, or `auto`.

Selection runs at worker start-up and fails there, with the reason and what to install,
rather than at the first sleep: a worker that says Hello can sleep.
"""

from __future__ import annotations

import torch

from omni_core.runners.base import import_object
from omni_core.workers.backends.base import BackendUnavailable, MemoryBackend
from omni_core.workers.backends.cumem import CumemBackend, cumem_unavailable_reason
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.config import BUILTIN_BACKENDS


def select_backend(name: str, device: torch.device | str) -> MemoryBackend:
    """`auto` | `cumem` | `portable` | `fast` | `package.module:Class` (a MemoryBackend
    subclass taking the device, e.g. a test double or a user's own backend)."""
    device = torch.device(device)
    if name == "auto":
        # cumem whenever it can work: it keeps addresses (CUDA graphs stay valid), portable
        # does not. The reason it was passed over is in the Hello's backend name only.
        return CumemBackend(device) if cumem_unavailable_reason(device) is None else PortableBackend(device)
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
            raise TypeError(f"backend {name!r} resolves to {cls!r}, which is not a subclass of "
                            "omni_core.workers.backends.MemoryBackend")  # fmt: skip
        return cls(device)
    raise BackendUnavailable(f"unknown backend {name!r}; choose one of {list(BUILTIN_BACKENDS)} "
                             "or give an import path 'package.module:Class'")  # fmt: skip
