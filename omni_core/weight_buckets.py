"""What both sides of a weight update agree on, below either of them: where shared-memory
buckets live and how a rank opens one without trusting its name, who may send a bucket, how a
CUDA IPC handle is described (typed fields, never a pickle) and rebuilt, how a dtype is named.

The trainer's side (`omni_core.weights_sender`) and the rank's (`omni_core.workers`) both
import this; neither imports the other's module for it. docs/security.md says which attack
each check here answers.
"""

from __future__ import annotations

import os
import re
import stat
import struct
from pathlib import Path

import torch

from omni_core.protocol.weights import (
    CUDA_IPC_HANDLE_BYTES,
    CUDA_IPC_REF_COUNTER_SLOTS,
    MAX_IPC_HANDLE_BYTES,
    CudaIpcHandle,
)

SHM_DIR = Path("/dev/shm")
INIT_PID = 1

# Opening a file a caller named: never a symlink (O_NOFOLLOW), never created (no O_CREAT),
# read-only, not inherited, and not blocking on a FIFO planted under the name (O_NONBLOCK: a
# FIFO's open would wait for a writer forever; it is refused as not a regular file).
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class BucketRefused(ValueError):
    """A bucket (file, sender or CUDA IPC handle) the rank will not open; the text says why."""


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


def process_uid(pid: int) -> int | None:
    """The uid a process runs as (the owner of /proc/<pid>: its effective uid), None when no
    such process runs."""
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except (FileNotFoundError, ProcessLookupError):
        return None


def sender_uid(pid: int, what: str, uid_of=process_uid) -> int:  # type: ignore[no-untyped-def]
    """The uid of the sender a handle names, once it is known to be a live process that can be
    a sender: pid 1 (init, always alive, root's) never is; a pid no longer running is not
    trusted. `uid_of` is the seam tests fake another user through."""
    if pid == INIT_PID:
        raise BucketRefused(
            f"sender pid {pid} of {what} is init, which sends no weights: name the process that made "
            "the bucket (WeightSender does); nothing was written"
        )
    uid = uid_of(pid) if sender_alive(pid) else None
    if uid is None:
        raise BucketRefused(
            f"sender pid {pid} of {what} no longer runs; its buckets are not trusted; nothing was written"
        )
    return uid


def _directory_fd(directory: Path) -> int:
    """A descriptor of `directory` reached without following a symlink at any component."""
    fd = os.open("/", _DIR_FLAGS)
    try:
        for part in directory.parts[1:]:
            next_fd = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = next_fd
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_in(directory: Path, name: str) -> int:
    """Open `name`, a plain name directly in `directory`, exactly once and read-only, with no
    symlink anywhere on the way (O_NOFOLLOW at every component) and never creating it. The
    caller fstats and uses this descriptor; the name is never opened again."""
    if "/" in name or name in ("", ".", ".."):
        raise BucketRefused(f"{name[:120]!r} is not a plain file name")
    dir_fd = _directory_fd(directory)
    try:
        return os.open(name, OPEN_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def lstat_in(directory: Path, name: str) -> os.stat_result | None:
    """What `name` in `directory` is now (a symlink not followed), None when it is gone."""
    try:
        dir_fd = _directory_fd(directory)
    except OSError:
        return None
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(dir_fd)


def check_owned_file(st: os.stat_result, what: str, owner_uid: int, sender_pid: int, min_bytes: int) -> None:
    """A bucket file is a regular file of one name, owned by the user its sender runs as, and at
    least `min_bytes` long; anything else is refused (BucketRefused) before it is mapped."""
    if not stat.S_ISREG(st.st_mode):
        raise BucketRefused(f"{what} is not a regular file (mode {stat.filemode(st.st_mode)}); nothing was written")
    if st.st_nlink != 1:
        raise BucketRefused(
            f"{what} has {st.st_nlink} names (hard links); a bucket has exactly one; nothing was written"
        )
    if st.st_uid != owner_uid:
        raise BucketRefused(
            f"{what} is owned by uid {st.st_uid}, but its sender pid {sender_pid} runs as uid {owner_uid}: "
            "a bucket must belong to the process that names it; nothing was written"
        )
    if st.st_size < min_bytes:
        raise BucketRefused(
            f"{what} of sender pid {sender_pid} holds {st.st_size} bytes, the update announces {min_bytes}"
        )


# ---------------------------------------------------------------------- CUDA IPC

# torch's shareable handle (c10/cuda/CUDACachingAllocator.cpp): a bare cudaIpcMemHandle_t (64
# bytes, older torch), or [version][type][payload] with type 'c' (a cudaMalloc block: a
# cudaIpcMemHandle_t) or 'e' (an expandable segment: a header {pid_t pid (padded to 8), size_t
# segment_size, size_t num_handles}, then one POSIX fd (4 bytes) or fabric handle (64) a piece).
_KNOWN_HANDLE_VERSIONS = (1, 2)
_MALLOC, _EXPANDABLE = ord("c"), ord("e")
_SEGMENT_HEADER = struct.Struct("=i4xQQ")
MAX_SEGMENT_PIECES = (MAX_IPC_HANDLE_BYTES - 2 - _SEGMENT_HEADER.size) // 4
# torch's ref counter files: at::NewProcessWideShmHandle(), made by the sharing process.
_REF_COUNTER_NAME = re.compile(rb"^/torch_(\d{1,10})_\d{1,20}_\d{1,20}$")
# RefcountedMapAllocator maps its int64 counters after a 64-byte header of its own.
REF_COUNTER_FILE_BYTES = 8 * CUDA_IPC_REF_COUNTER_SLOTS + 64


def describe_cuda_ipc(flat: torch.Tensor) -> CudaIpcHandle:
    """The typed description of a flat uint8 CUDA tensor, through torch's own reduce_tensor
    (which also registers the sharing with torch's IPC ref counting)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

    if flat.device.type != "cuda" or flat.dtype != torch.uint8 or flat.dim() != 1 or flat.stride() != (1,):
        raise ValueError(
            f"a CUDA IPC bucket is a flat uint8 CUDA tensor, got {flat.dtype} {list(flat.shape)} on {flat.device}"
        )
    rebuild, args = reduce_tensor(flat)
    if rebuild is not rebuild_cuda_tensor:  # pragma: no cover - torch reduces CUDA tensors so
        raise ValueError(f"torch reduced a CUDA tensor with {rebuild!r}, not rebuild_cuda_tensor")
    (
        _,
        size,
        _,
        offset,
        _,
        _,
        device,
        handle,
        storage_size,
        storage_offset,
        _,
        counter,
        counter_offset,
        event,
        sync,
    ) = args
    return CudaIpcHandle(
        device=int(device),
        handle=bytes(handle),
        storage_offset=int(storage_offset),
        storage_size=int(storage_size),
        offset=int(offset),  # elements of uint8: bytes
        size=int(size[0]),
        ref_counter_handle=bytes(counter),
        ref_counter_offset=int(counter_offset),
        event_handle=bytes(event) if sync and event is not None else b"",
        event_sync_required=bool(sync),
    )


def is_expandable_segment(handle: bytes) -> bool:
    return len(handle) != CUDA_IPC_HANDLE_BYTES and handle[1] == _EXPANDABLE


def check_cuda_ipc(desc: CudaIpcHandle, sender_pid: int, *, device_count: int, device_bytes: int | None) -> None:
    """Every bound a CUDA IPC description must meet before torch sees it: a device this rank
    has, a storage no larger than that device, a handle of a format torch makes (an expandable
    segment's naming the sender's own pid, whose descriptors torch would fetch), and a ref
    counter that is the sender's own file (torch opens it by name and writes the counter at
    `ref_counter_offset` when the rank lets go). Raises BucketRefused naming the first."""
    what = f"the CUDA IPC bucket of sender pid {sender_pid}"
    if desc.device >= device_count:
        raise BucketRefused(f"{what} names cuda:{desc.device}; this rank has {device_count} CUDA device(s)")
    if device_bytes is not None and desc.storage_size > device_bytes:
        raise BucketRefused(
            f"{what} claims a storage of {desc.storage_size} bytes, more than cuda:{desc.device} holds "
            f"({device_bytes}); nothing was opened"
        )
    handle = desc.handle
    if len(handle) != CUDA_IPC_HANDLE_BYTES:  # the versioned form
        version, kind = handle[0], handle[1]
        if version not in _KNOWN_HANDLE_VERSIONS:
            raise BucketRefused(f"{what}: a handle of version {version}, which this rank does not know")
        if kind == _MALLOC:
            if len(handle) != 2 + CUDA_IPC_HANDLE_BYTES:
                raise BucketRefused(
                    f"{what}: a cudaMalloc handle of {len(handle)} bytes, not {2 + CUDA_IPC_HANDLE_BYTES}"
                )
        elif kind == _EXPANDABLE:
            if len(handle) < 2 + _SEGMENT_HEADER.size:
                raise BucketRefused(f"{what}: an expandable-segment handle of {len(handle)} bytes has no header")
            pid, segment_size, pieces = _SEGMENT_HEADER.unpack_from(handle, 2)
            if pid != sender_pid:
                raise BucketRefused(
                    f"{what}: its expandable-segment handle names pid {pid}, whose descriptors the rank "
                    "would fetch; a sender shares its own memory only"
                )
            rest = len(handle) - 2 - _SEGMENT_HEADER.size
            if not 0 < pieces <= MAX_SEGMENT_PIECES or rest not in (4 * pieces, CUDA_IPC_HANDLE_BYTES * pieces):
                raise BucketRefused(f"{what}: an expandable-segment handle of {pieces} pieces in {rest} bytes")
            if segment_size <= 0 or desc.storage_offset + desc.storage_size > segment_size * pieces:
                raise BucketRefused(f"{what}: its storage ends past the {pieces} segment(s) its handle shares")
        else:
            raise BucketRefused(f"{what}: a handle of unknown type {kind!r}")
    match = _REF_COUNTER_NAME.match(desc.ref_counter_handle)
    if match is None or int(match.group(1)) != sender_pid:
        raise BucketRefused(
            f"{what}: ref_counter_handle {desc.ref_counter_handle[:64]!r} is not the sender's torch ref "
            f"counter (/torch_{sender_pid}_<n>_<n>)"
        )


def ref_counter_name(desc: CudaIpcHandle) -> str:
    return desc.ref_counter_handle.decode("ascii").removeprefix("/")


def rebuild_cuda_ipc(desc: CudaIpcHandle) -> torch.Tensor:
    """The flat uint8 tensor a checked description opens, through torch's rebuild_cuda_tensor;
    the tensor and storage classes, dtype, stride and requires_grad are the rank's own."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size((desc.size,)),
        (1,),
        desc.offset,
        torch.storage.TypedStorage,
        torch.uint8,
        desc.device,
        desc.handle,
        desc.storage_size,
        desc.storage_offset,
        False,
        desc.ref_counter_handle,
        desc.ref_counter_offset,
        desc.event_handle if desc.event_sync_required else None,
        desc.event_sync_required,
    )
