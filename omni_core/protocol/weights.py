"""Wire types of a versioned weight update (P-17): where the new tensors come from.

An `UpdateWeights` command names a caller-chosen `version` and one source:

- `DiskSource`: a safetensors checkpoint directory, read like `ReloadWeights`;
- `ShmSource`: buckets of host shared memory a sender process filled (the CPU twin of CUDA IPC);
- `IpcSource`: the same buckets in the sender's device memory, each described by a
  `CudaIpcHandle` (typed fields, no pickle: the rank rebuilds it with torch's own functions);
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
MAX_HANDLE_CHARS = 4096  # a shared-memory path
MAX_HOST_CHARS = 253  # a DNS name
MAX_WEIGHTS_VERSION = (1 << 63) - 1
MIN_NEW_WEIGHTS_VERSION = 1  # 0 is a runner's own weights: no update stands for them
# CUDA IPC (CudaIpcHandle): what torch's reduce_tensor gives for a CUDA storage.
CUDA_IPC_HANDLE_BYTES = 64  # cudaIpcMemHandle_t and cudaIpcEventHandle_t
# torch's shareable handle: 64 bytes (older torch), 66 (a cudaMalloc block), or 26 and 4 (a
# POSIX fd) or 64 (a fabric handle) per piece of an expandable segment (30 bytes for one).
MIN_IPC_HANDLE_BYTES = 2
MAX_IPC_HANDLE_BYTES = 1 << 16
MAX_CUDA_DEVICE_INDEX = 63
CUDA_IPC_REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters a file
MAX_REF_COUNTER_NAME_BYTES = 128  # "/torch_<pid>_<random>_<counter>"

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
NewWeightsVersion = Annotated[int, msgspec.Meta(ge=MIN_NEW_WEIGHTS_VERSION, le=MAX_WEIGHTS_VERSION)]


def new_version_problem(version: object) -> str | None:
    """What is wrong with `version` as the version of new weights (P-17), or None: the one
    rule the engine, the stage core and the HTTP body hold an update's version to, the bounds
    of `NewWeightsVersion` on the wire. True is no version, though True == 1."""
    if type(version) is int and MIN_NEW_WEIGHTS_VERSION <= version <= MAX_WEIGHTS_VERSION:
        return None
    return (
        f"weights version must be an int in {MIN_NEW_WEIGHTS_VERSION}..{MAX_WEIGHTS_VERSION}, got {version!r}; "
        "send the new weights under a higher version"
    )


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


class TensorSpec(_Strict, frozen=True):
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


class Bucket(_Strict, frozen=True):
    """One region of host shared memory of `nbytes` holding `tensors`: `handle` is its file, a
    name directly under the host's shared-memory directory. `sender_pid` names the process that
    made it and keeps it alive: the rank refuses a bucket whose sender no longer runs, or runs
    as another user than the one owning the file."""

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


class DiskSource(_Strict, tag="disk", frozen=True):
    """A safetensors checkpoint directory on the rank's host (as `ReloadWeights` reads)."""

    path: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HANDLE_CHARS)]


class ShmSource(_Strict, tag="shm", frozen=True):
    """Host shared memory: each bucket a file under the shared-memory directory."""

    buckets: Buckets

    def __post_init__(self) -> None:
        _unique_names(tuple(b.tensors for b in self.buckets))


class CudaIpcHandle(_Strict, frozen=True):
    """One CUDA IPC handle as typed fields: what `torch.multiprocessing.reductions.reduce_tensor`
    gives for a flat uint8 CUDA tensor, less what the rank fixes itself (the tensor and storage
    classes, dtype uint8, stride 1, requires_grad False). The rank checks every field against
    its bounds and its own devices, then rebuilds it with torch's `rebuild_cuda_tensor`; no
    constructor a caller names ever runs. `omni_core.weight_buckets.describe_cuda_ipc` makes
    one from a tensor.

    `device`: the CUDA device index the memory opens on (in the rank's numbering). `handle`:
    torch's shareable handle of the allocation (`storage._share_cuda_()`'s). `storage_offset`
    and `storage_size`: where the shared storage lies in that allocation, in bytes. `offset`
    and `size`: where the bucket lies in the storage, in bytes. `ref_counter_handle` and
    `ref_counter_offset`: the sender's shared-memory counter that keeps the allocation alive
    while the rank holds it. `event_handle`: the IPC event the rank waits on before reading
    (64 bytes where `event_sync_required`, else empty)."""

    device: Annotated[int, msgspec.Meta(ge=0, le=MAX_CUDA_DEVICE_INDEX)]
    handle: Annotated[bytes, msgspec.Meta(min_length=MIN_IPC_HANDLE_BYTES, max_length=MAX_IPC_HANDLE_BYTES)]
    storage_offset: ByteCount
    storage_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BUCKET_BYTES)]
    offset: ByteCount
    size: ByteCount
    ref_counter_handle: Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_REF_COUNTER_NAME_BYTES)]
    ref_counter_offset: Annotated[int, msgspec.Meta(ge=0, lt=CUDA_IPC_REF_COUNTER_SLOTS)]
    event_handle: Annotated[bytes, msgspec.Meta(max_length=CUDA_IPC_HANDLE_BYTES)] = b""
    event_sync_required: bool = False

    def __post_init__(self) -> None:
        if self.offset + self.size > self.storage_size:
            raise ValueError(
                f"a CUDA IPC bucket of {self.size} bytes at offset {self.offset} ends past its storage "
                f"of {self.storage_size} bytes"
            )
        if self.event_sync_required and len(self.event_handle) != CUDA_IPC_HANDLE_BYTES:
            raise ValueError(
                f"event_sync_required needs a {CUDA_IPC_HANDLE_BYTES}-byte event_handle, got {len(self.event_handle)}"
            )
        if not self.event_sync_required and self.event_handle:
            raise ValueError("an event_handle without event_sync_required: send both or neither")


# What a peer that still sends a pickled CUDA IPC handle (omni-core before the typed handle)
# is told at decode (NACK BAD_MESSAGE, HTTP 422): what to send instead. Short: a NACK's
# detail keeps the first 300 characters of the decode error.
PICKLED_IPC_REFUSAL = (
    "a pickled CUDA IPC handle (`handle`) is no longer taken (unpickling runs code): send `ipc`, "
    "a typed CudaIpcHandle; WeightSender.share or omni_core.weight_buckets.describe_cuda_ipc "
    "makes it (docs/security.md)"
)


class IpcBucket(_Strict, frozen=True):
    """One bucket of the sender's device memory: `ipc` opens it; `nbytes` and `tensors` as in
    a shm `Bucket`. `handle` exists only so that a peer still sending the old pickled form is
    told what to send (PICKLED_IPC_REFUSAL) instead of meeting an unknown field."""

    nbytes: ByteCount
    sender_pid: Annotated[int, msgspec.Meta(ge=1, le=(1 << 31) - 1)]
    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(min_length=1, max_length=MAX_UPDATE_TENSORS)]
    ipc: CudaIpcHandle | None = None
    handle: Annotated[str, msgspec.Meta(max_length=MAX_HANDLE_CHARS)] | None = None

    def __post_init__(self) -> None:
        if self.handle is not None:
            raise ValueError(PICKLED_IPC_REFUSAL)
        if self.ipc is None:
            raise ValueError("an ipc bucket needs `ipc`, its CudaIpcHandle (WeightSender.share makes it)")
        if self.nbytes > self.ipc.size:
            raise ValueError(f"an ipc bucket of {self.nbytes} bytes in a CUDA IPC handle of {self.ipc.size}")
        for spec in self.tensors:
            if spec.offset_bytes + spec.nbytes > self.nbytes:
                raise ValueError(
                    f"tensor {spec.name!r} ({spec.nbytes} bytes at offset {spec.offset_bytes}) "
                    f"ends past its bucket of {self.nbytes} bytes"
                )


class IpcSource(_Strict, tag="ipc", frozen=True):
    """CUDA IPC handles of the sender's device buckets (same node); refused on a CPU rank."""

    buckets: Annotated[tuple[IpcBucket, ...], msgspec.Meta(min_length=1, max_length=MAX_UPDATE_BUCKETS)]

    def __post_init__(self) -> None:
        _unique_names(tuple(b.tensors for b in self.buckets))


class CollectiveSource(_Strict, tag="collective", frozen=True):
    """Root 0 of the weight group broadcasts `tensors`, in this order, each whole."""

    tensors: Annotated[tuple[TensorSpec, ...], msgspec.Meta(min_length=1, max_length=MAX_UPDATE_TENSORS)]

    def __post_init__(self) -> None:
        _unique_names((self.tensors,))


WeightSource = Union[DiskSource, ShmSource, IpcSource, CollectiveSource]  # noqa: UP007
# An adapter's tensors (AddAdapter.tensors): the planes that carry tensors, not a checkpoint.
AdapterTensors = Union[ShmSource, IpcSource, CollectiveSource]  # noqa: UP007
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
