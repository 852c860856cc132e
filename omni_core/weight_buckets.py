"""What both sides of a weight update agree on, below either of them: where shared-memory
buckets live, how a CUDA IPC handle is written and read back, how a dtype is named, and how a
rank tells that the sender of its buckets still runs.

The trainer's side (`omni_core.weights_sender`) and the rank's (`omni_core.workers`) both
import this; neither imports the other's module for it.
"""

from __future__ import annotations

import base64
import os
import pickle
from pathlib import Path
from typing import Any, ClassVar

import torch

SHM_DIR = Path("/dev/shm")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sender_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


class IpcArgs:
    """The wire form of a CUDA IPC handle: base64 of a pickle of plain values only."""

    @staticmethod
    def dumps(args: tuple[Any, ...]) -> str:
        return base64.b64encode(pickle.dumps(args)).decode("ascii")

    @staticmethod
    def loads(handle: str) -> tuple[Any, ...]:
        return _RestrictedUnpickler.loads(base64.b64decode(handle, validate=True))


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles the arguments of rebuild_cuda_tensor only: plain values, torch dtypes and
    storage classes; any other global (a hostile handle's os.system) is refused."""

    # reduce_tensor names the storage class it shared: TypedStorage for a CUDA tensor (seen on
    # torch 2.11 with an H100), UntypedStorage on other builds.
    _ALLOWED: ClassVar[set[tuple[str, str]]] = {
        ("torch", "Tensor"),
        ("torch", "Size"),
        ("torch", "UntypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch.storage", "TypedStorage"),
        ("torch", "TypedStorage"),
        ("torch", "device"),
    }

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and hasattr(torch, name) and isinstance(getattr(torch, name), torch.dtype):
            return getattr(torch, name)
        if (module, name) in self._ALLOWED:
            return getattr(__import__(module, fromlist=[name]), name)
        raise pickle.UnpicklingError(f"a CUDA IPC handle may not name {module}.{name}")

    @classmethod
    def loads(cls, data: bytes) -> tuple[Any, ...]:
        import io

        value = cls(io.BytesIO(data)).load()
        if not isinstance(value, tuple):
            raise pickle.UnpicklingError("a CUDA IPC handle is a tuple of rebuild arguments")
        return value
