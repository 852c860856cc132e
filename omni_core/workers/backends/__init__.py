"""Memory backends: tagged pools that sleep (offload or discard) and wake."""

from omni_core.workers.backends.base import BackendStateError, BackendUnavailable, MemoryBackend
from omni_core.workers.backends.cumem import CumemBackend, cumem_unavailable_reason
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.backends.select import select_backend

__all__ = [
    "BackendStateError",
    "BackendUnavailable",
    "CumemBackend",
    "MemoryBackend",
    "PortableBackend",
    "cumem_unavailable_reason",
    "select_backend",
]
