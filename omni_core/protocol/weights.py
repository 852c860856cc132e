"""Wire types of a versioned weight update (P-17): where the new tensors come from.

An `UpdateWeights` command names a caller-chosen `version` and one source:

- `DiskSource`: a safetensors checkpoint directory, read like `ReloadWeights`;
- `ShmSource`: buckets of host shared memory a sender process filled (the CPU twin of CUDA IPC);
- `IpcSource`: the same buckets as CUDA IPC handles of the sender's device memory;
- `CollectiveSource`: a broadcast from root 0 of the weight group `InitWeightGroup` set up.

Every size is bounded on decode: bucket count, tensors per update, name length, dimensions,
bytes. A bucket's tensors must lie inside it, and a name may appear once per update; a message
that breaks either is refused as BAD_MESSAGE before any worker code sees it. Pure types: no
torch, no IO. The sender (`omni_core.weights_sender`) and the worker's receiver agree on the
byte layout: each tensor a contiguous run of `nbytes` at `offset_bytes` in its bucket.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

MAX_UPDATE_BUCKETS = 4096  # one bucket per handle; a 16 GB update in 256 MiB buckets is 64
MAX_UPDATE_TENSORS = 16384  # every tensor of the largest models this serves, with room
MAX_TENSOR_NAME_CHARS = 256
MAX_TENSOR_DIMS = 8
MAX_DIM = 1 << 40
MAX_BUCKET_BYTES = 1 << 40
MAX_HANDLE_CHARS = 4096  # a shared-memory path, or a base64 CUDA IPC handle with its metadata
MAX_HOST_CHARS = 253  # a DNS name
MAX_WEIGHTS_VERSION = (1 << 63) - 1

# dtype names as torch prints them without "torch."; the receiver maps them to torch dtypes.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

WeightsVersion = Annotated[int, msgspec.Meta(ge=0, le=MAX_WEIGHTS_VERSION)]
NewWeightsVersion = Annotated[int, msgspec.Meta(ge=1, le=MAX_WEIGHTS_VERSION)]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TENSOR_NAME_CHARS)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=MAX_DIM)]
ByteCount = Annotated[int, msgspec.Meta(ge=0, le=MAX_BUCKET_BYTES)]
Handle = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDLE_CHARS)]
DType = Literal[
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
    "float8_e5m2",
]


class _Strict(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    pass


class TensorSpec(_Strict):
    """One full (unsharded) tensor: its name in the runner's state_dict, dtype and shape. In a
    bucket, `offset_bytes` is where its contiguous bytes start."""

    name: TensorName
    dtype: DType
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_TENSOR_DIMS)]
    offset_bytes: ByteCount = 0

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * DTYPE_BYTES[self.dtype]


class Bucket(_Strict):
    """One shared region of `nbytes` holding `tensors`. `handle` opens it: a path under the
    host's shared-memory directory (shm), or a serialised CUDA IPC handle (ipc). `sender_pid`
    names the process that keeps it alive, so a dead sender is refused by name."""

    handle: Handle
    nbytes: ByteCount
    sender_pid: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(min_length=1, max_length=MAX_UPDATE_TENSORS)]

    def __post_init__(self) -> None:
        for spec in self.tensors:
            if spec.offset_bytes + spec.nbytes > self.nbytes:
                raise ValueError(
                    f"tensor {spec.name!r} ({spec.nbytes} bytes at offset {spec.offset_bytes}) "
                    f"ends past its bucket of {self.nbytes} bytes"
                )


Buckets = Annotated[tuple[Bucket, ...], msgspec.Meta(min_length=1, max_length=MAX_UPDATE_BUCKETS)]


def _unique_names(groups: tuple[tuple[TensorSpec, ...], ...]) -> None:
    seen: set[str] = set()
    count = 0
    for specs in groups:
        count += len(specs)
        for spec in specs:
            if spec.name in seen:
                raise ValueError(f"tensor {spec.name!r} appears twice in one update; send each tensor once")
            seen.add(spec.name)
    if count > MAX_UPDATE_TENSORS:
        raise ValueError(
            f"{count} tensors in one update, over the limit of {MAX_UPDATE_TENSORS}; "
            "split it into several versions or fewer, larger tensors"
        )


class DiskSource(_Strict, tag="disk"):
    """A safetensors checkpoint directory on the rank's host (as `ReloadWeights` reads)."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDLE_CHARS)]


class ShmSource(_Strict, tag="shm"):
    """Host shared memory: each bucket a file under the shared-memory directory."""

    buckets: Buckets

    def __post_init__(self) -> None:
        _unique_names(tuple(b.tensors for b in self.buckets))


class IpcSource(_Strict, tag="ipc"):
    """CUDA IPC handles of the sender's device buckets (same node); refused on a CPU rank."""

    buckets: Buckets

    def __post_init__(self) -> None:
        _unique_names(tuple(b.tensors for b in self.buckets))


class CollectiveSource(_Strict, tag="collective"):
    """Root 0 of the weight group broadcasts `tensors`, in this order, each whole."""

    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(min_length=1, max_length=MAX_UPDATE_TENSORS)]

    def __post_init__(self) -> None:
        _unique_names((self.tensors,))


WeightSource = Union[DiskSource, ShmSource, IpcSource, CollectiveSource]  # noqa: UP007
SOURCE_KINDS: tuple[str, ...] = ("disk", "shm", "ipc", "collective")


def source_kind(source: WeightSource) -> str:
    return source.__struct_config__.tag  # type: ignore[return-value]


def source_tensors(source: WeightSource) -> tuple[TensorSpec, ...]:
    """Every tensor the source carries (none for disk: the checkpoint's header says)."""
    if isinstance(source, (ShmSource, IpcSource)):
        return tuple(t for b in source.buckets for t in b.tensors)
    if isinstance(source, CollectiveSource):
        return source.tensors
    return ()


def source_bytes(source: WeightSource) -> int:
    return sum(t.nbytes for t in source_tensors(source))
