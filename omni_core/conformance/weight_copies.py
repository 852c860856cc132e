"""Weights the suite sends a worker as an update (P-17), made from what the worker shared.

The suite has no trainer. To tell one version of the weights from another over the wire it
needs weights that differ from the worker's own, of the shapes and dtypes the worker's model
has: it reads the host buckets the worker shared (`ShareWeights`, a `shm` source), reverses the
elements of every tensor (valid values of the same dtype, a different model), and writes them
into host buckets of its own, named after the suite's process, which it keeps alive and
removes afterwards. Plain bytes only: the suite imports no tensor library.
"""

from __future__ import annotations

import array
import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from omni_core.protocol.weights import DTYPE_BYTES, Bucket, ShmSource, TensorSpec

SHM_DIR = Path("/dev/shm")  # where a shm handle's bucket lives (P-17: a file directly under it)
# array typecodes by element size: the elements are moved whole, never interpreted
_TYPECODES = {1: "B", 2: "H", 4: "I", 8: "Q"}
# No process runs under this pid on Linux (pid_max is at most 2**22): a sender that is gone.
GONE_PID = (1 << 31) - 1
_names = itertools.count()


class NotHostBuckets(Exception):
    """The shared weights are not host buckets the suite can read (a GPU worker's IPC handles)."""


def bucket_path(handle: str) -> Path:
    return Path(handle) if handle.startswith("/") else SHM_DIR / handle


def _reversed(data: bytearray, spec: TensorSpec) -> None:
    size = DTYPE_BYTES[spec.dtype]
    elements = array.array(_TYPECODES[size])
    assert elements.itemsize == size, f"array typecode {_TYPECODES[size]!r} is not {size} bytes here"
    start, end = spec.offset_bytes, spec.offset_bytes + spec.nbytes
    elements.frombytes(bytes(data[start:end]))
    elements.reverse()
    data[start:end] = elements.tobytes()


def _write(data: bytes) -> Path:
    path = SHM_DIR / f"omni-conformance-{os.getpid()}-{next(_names)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return path


@contextmanager
def reversed_weights(shared: object) -> Iterator[ShmSource]:
    """An shm source holding `shared`'s tensors with their elements reversed, sent by this
    process; its files are removed when the block ends."""
    if not isinstance(shared, ShmSource):
        raise NotHostBuckets(
            f"the worker shared its weights as {type(shared).__name__}, not host buckets (shm) the suite can read"
        )
    written: list[Path] = []
    try:
        buckets = []
        for bucket in shared.buckets:
            data = bytearray(bucket_path(bucket.handle).read_bytes()[: bucket.nbytes])
            for spec in bucket.tensors:
                _reversed(data, spec)
            path = _write(bytes(data))
            written.append(path)
            buckets.append(msgspec.structs.replace(bucket, handle=path.name, sender_pid=os.getpid()))
        yield ShmSource(buckets=tuple(buckets))
    finally:
        for path in written:
            path.unlink(missing_ok=True)


def with_tensor(source: ShmSource, **changes: object) -> tuple[ShmSource, TensorSpec]:
    """`source` with its first tensor changed (`name`, `shape` or `dtype`), and that tensor."""
    first = source.buckets[0]
    spec = msgspec.structs.replace(first.tensors[0], **changes)
    bucket = msgspec.structs.replace(first, tensors=(spec, *first.tensors[1:]))
    return ShmSource(buckets=(bucket, *source.buckets[1:])), spec


def other_dtype(dtype: str) -> str:
    """A dtype of the same element size as `dtype` (so the tensor still fits its bucket)."""
    return next(d for d, n in DTYPE_BYTES.items() if n == DTYPE_BYTES[dtype] and d != dtype)


def from_gone_sender(source: ShmSource) -> ShmSource:
    """`source` with its first bucket claimed by a process that does not run."""
    first: Bucket = source.buckets[0]
    return ShmSource(buckets=(msgspec.structs.replace(first, sender_pid=GONE_PID), *source.buckets[1:]))


@contextmanager
def zero_buckets(specs: tuple[TensorSpec, ...]) -> Iterator[ShmSource]:
    """One host bucket of zeros holding `specs` back to back, sent by this process; its file is
    removed when the block ends."""
    placed, offset = [], 0
    for spec in specs:
        placed.append(msgspec.structs.replace(spec, offset_bytes=offset))
        offset += spec.nbytes
    path = _write(bytes(offset))
    try:
        yield ShmSource(
            buckets=(Bucket(handle=path.name, nbytes=offset, sender_pid=os.getpid(), tensors=tuple(placed)),)
        )
    finally:
        path.unlink(missing_ok=True)
