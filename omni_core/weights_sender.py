"""The trainer's side of a weight update (P-17), for a process omni-core did not start.

    sender = WeightSender()
    source = sender.share(model.state_dict())           # shm buckets (CPU) or CUDA IPC (GPU)
    engine.update_weights("rollout", source, version=step)
    sender.release()                                      # or keep: the next share reuses them

`share` packs the tensors into buckets of at most `bucket_bytes` (a tensor larger than that
gets a bucket of its own) and returns the `ShmSource` / `IpcSource` to send. The buckets stay
alive until `release()` (or `close()`): keep them until the engine has acknowledged the
update. Sharing the same names, shapes and dtypes again refills the same buckets, so the
ranks read them through mappings they already hold.

For a broadcast (`CollectiveSource`), the trainer is rank 0 of a weight group:

    sender.init_group(address, port, world_size)        # while engine.init_weight_group(...) runs
    source = sender.collective_source(tensors)
    thread = sender.broadcast_in_thread(tensors)         # while engine.update_weights(...) runs
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
import threading
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import torch

from omni_core.protocol.weights import (
    MAX_BUCKET_BYTES,
    MAX_UPDATE_BUCKETS,
    MAX_UPDATE_TENSORS,
    Bucket,
    CollectiveSource,
    DType,
    IpcBucket,
    IpcSource,
    ShmSource,
    TensorSpec,
)
from omni_core.weight_buckets import SHM_DIR, describe_cuda_ipc, dtype_name, sender_alive
from omni_core.weight_group import WeightGroup

DEFAULT_BUCKET_BYTES = 256 << 20
_BUCKET_FILE = re.compile(r"^omni-weights-(\d+)-[0-9a-f]{8}-\d+$")
_ALIGN_BYTES = 64  # every tensor starts on a 64-byte boundary: any dtype's view is aligned
# The dtypes the wire names: a struct is validated on decode only, so the sender checks its own.
_WIRE_DTYPES: dict[str, DType] = {name: name for name in get_args(DType)}


class WeightSenderError(ValueError):
    """The tensors cannot be shared as asked (too many, a dtype the wire has no name for)."""


def sweep_stale(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove the bucket files of senders that no longer run (a process killed before its
    release() leaves them in host memory); returns their names. A live pid's are kept."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        match = _BUCKET_FILE.match(name)
        if match and int(match.group(1)) != os.getpid() and not sender_alive(int(match.group(1))):
            with contextlib.suppress(FileNotFoundError):
                (shm_dir / name).unlink()
                removed.append(name)
    return removed


def _map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """The sender's bucket file, mapped shared and writable, as a flat uint8 tensor (which keeps
    the mapping alive)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(
        mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE), dtype=torch.uint8
    )


def _named(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(tensors.state_dict()) if isinstance(tensors, torch.nn.Module) else dict(tensors)
    if not named:
        raise WeightSenderError("no tensors to share")
    if len(named) > MAX_UPDATE_TENSORS:
        raise WeightSenderError(f"{len(named)} tensors, over the {MAX_UPDATE_TENSORS} one update may carry")
    return named


def _spec(name: str, tensor: torch.Tensor, offset_bytes: int = 0) -> TensorSpec:
    dtype = _WIRE_DTYPES.get(dtype_name(tensor.dtype))
    if dtype is None:
        raise WeightSenderError(
            f"tensor {name!r} is {dtype_name(tensor.dtype)}, a dtype the wire has no name for; "
            f"convert it to one of {sorted(_WIRE_DTYPES)}"
        )
    try:
        return TensorSpec(
            name=name,
            dtype=dtype,
            shape=tuple(tensor.shape),  # type: ignore[arg-type]
            offset_bytes=offset_bytes,
        )
    except Exception as exc:  # pragma: no cover - msgspec validates on decode, not here
        raise WeightSenderError(f"tensor {name!r}: {exc}") from None


def _layout(named: dict[str, torch.Tensor], bucket_bytes: int) -> list[tuple[int, list[tuple[str, int]]]]:
    """Buckets as (nbytes, [(name, offset)]) in name order, each at most bucket_bytes unless one
    tensor alone is larger."""
    buckets: list[tuple[int, list[tuple[str, int]]]] = []
    size = 0
    members: list[tuple[str, int]] = []
    for name, tensor in named.items():
        nbytes = tensor.numel() * tensor.element_size()
        offset = -(-size // _ALIGN_BYTES) * _ALIGN_BYTES
        if members and offset + nbytes > bucket_bytes:
            buckets.append((size, members))
            size, members, offset = 0, [], 0
        members.append((name, offset))
        size = offset + nbytes
    buckets.append((size, members))
    if len(buckets) > MAX_UPDATE_BUCKETS:
        raise WeightSenderError(
            f"{len(buckets)} buckets, over the {MAX_UPDATE_BUCKETS} one update may carry; raise bucket_bytes"
        )
    return buckets


class WeightSender:
    """Shares a trainer's tensors with a stage's ranks on the same node. Not thread-safe."""

    def __init__(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, shm_dir: Path = SHM_DIR) -> None:
        if not 0 < bucket_bytes <= MAX_BUCKET_BYTES:
            raise WeightSenderError(f"bucket_bytes must be in 1..{MAX_BUCKET_BYTES}, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.shm_dir = shm_dir
        self.prefix = f"omni-weights-{os.getpid()}-{secrets.token_hex(4)}"
        self.swept = sweep_stale(shm_dir)  # what killed senders before this one left behind
        self._signature: tuple[Any, ...] | None = None
        self._buckets: list[torch.Tensor] = []  # flat uint8 bucket tensors (shm-mapped or on the device)
        self._paths: list[Path] = []
        self._source: ShmSource | IpcSource | None = None
        self._counter = 0
        self.group: WeightGroup | None = None
        self._store: Any = None
        self.reused = 0  # shares that refilled the buckets of the previous one

    # ------------------------------------------------------------------ shared buckets

    def share(self, tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> ShmSource | IpcSource:
        """Copy `tensors` into shared buckets and return the source naming them."""
        named = _named(tensors)
        devices = {t.device.type for t in named.values()}
        if len(devices) != 1:
            raise WeightSenderError(f"tensors on several device types {sorted(devices)}; share one kind at a time")
        cuda = devices == {"cuda"}
        signature = (cuda, tuple((n, tuple(t.shape), t.dtype, t.device) for n, t in named.items()))
        if signature != self._signature:
            self.release()
            self._allocate(named, cuda)
            self._signature = signature
        else:
            self.reused += 1
        assert self._source is not None
        with torch.no_grad():
            buckets: tuple[Bucket | IpcBucket, ...] = self._source.buckets
            for bucket, flat in zip(buckets, self._buckets, strict=True):
                for spec in bucket.tensors:
                    src = named[spec.name].detach().contiguous().view(-1).view(torch.uint8)
                    flat[spec.offset_bytes : spec.offset_bytes + spec.nbytes].copy_(src)
        if cuda:
            torch.cuda.synchronize()  # the ranks read the buckets as soon as the update arrives
        return self._source

    def _allocate(self, named: dict[str, torch.Tensor], cuda: bool) -> None:
        pid = os.getpid()
        buckets: list[Bucket] = []
        ipc_buckets: list[IpcBucket] = []
        for nbytes, members in _layout(named, self.bucket_bytes):
            specs = tuple(_spec(name, named[name], offset) for name, offset in members)
            if cuda:
                # At least one byte: an empty storage has no IPC handle to describe.
                device = named[members[0][0]].device
                flat = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
                ipc = describe_cuda_ipc(flat)  # typed fields, through torch's reduce_tensor
                self._buckets.append(flat)
                ipc_buckets.append(IpcBucket(nbytes=nbytes, sender_pid=pid, tensors=specs, ipc=ipc))
                continue
            self._counter += 1
            path = self.shm_dir / f"{self.prefix}-{self._counter}"
            # Made here (O_EXCL: never another's file) and mapped through this descriptor.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                self._paths.append(path)
                os.ftruncate(fd, max(nbytes, 1))
                self._buckets.append(_map_shared(fd, nbytes))
            finally:
                os.close(fd)
            buckets.append(Bucket(handle=str(path), nbytes=nbytes, sender_pid=pid, tensors=specs))
        self._source = IpcSource(buckets=tuple(ipc_buckets)) if cuda else ShmSource(buckets=tuple(buckets))

    def release(self) -> None:
        """Drop the buckets (after the engine acknowledged the update that named them)."""
        self._buckets.clear()
        for path in self._paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        self._paths.clear()
        self._source = None
        self._signature = None

    # ------------------------------------------------------------------ broadcast

    def init_group(
        self,
        address: str,
        port: int,
        world_size: int,
        *,
        backend: str = "gloo",
        group: str = "weights",
        timeout_s: float = 300.0,
    ) -> None:
        """Serve the rendezvous at address:port and join as group rank 0; returns once every rank
        joined (call it while `Engine.init_weight_group` runs, e.g. in a thread)."""
        import torch.distributed as dist

        if backend not in ("gloo", "nccl"):
            raise WeightSenderError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout)
        # SGLang's layout (weight_group.py): an SGLang server's ranks join this group too.
        self.group = WeightGroup(self._store, group, 0, world_size, backend, timeout_s)

    @staticmethod
    def collective_source(tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> CollectiveSource:
        named = _named(tensors)
        return CollectiveSource(tensors=tuple(_spec(n, t) for n, t in named.items()))

    def broadcast(self, tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> None:
        """Send every tensor, in the order `collective_source` listed them, from group rank 0."""
        if self.group is None:
            raise WeightSenderError("no weight group: call init_group first")
        for tensor in _named(tensors).values():
            self.group.broadcast(tensor.detach().contiguous(), root=0)

    def broadcast_in_thread(self, tensors: Mapping[str, torch.Tensor] | torch.nn.Module) -> threading.Thread:
        """`broadcast` on a thread of its own, so the caller can send the update meanwhile;
        join it after `Engine.update_weights` returns."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.broadcast(tensors)
            except BaseException as exc:  # reported on join through .errors
                errors.append(exc)

        thread = threading.Thread(target=run, name="omni-weights-broadcast", daemon=True)
        thread.errors = errors  # type: ignore[attr-defined]
        thread.start()
        return thread

    def close(self) -> None:
        self.release()
        self.group = None
        self._store = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
