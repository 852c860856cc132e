"""The rank's side of a weight update (P-17): open the sender's buckets, check, then write.

Everything that can be refused is refused before the first byte is written
(`RunnerArgumentError`, which the worker answers with NACK INVALID_ARGUMENT, state and
version unchanged): a name the model does not have, a shape or dtype other than the model's,
a bucket file that is gone or shorter than announced, a sender process that no longer runs,
CUDA IPC on a rank without CUDA, a broadcast with no weight group joined. A failure after
that (a sender that vanishes mid-broadcast, a copy that raises) propagates: the rank is then
NEEDS_RELOAD at its old version (NACK UPDATE_FAILED).

Shared-memory buckets are files directly under `SHM_DIR` named by the sender; a handle
naming anything else (another directory, '..') is refused. A bucket is opened exactly once,
read-only, never created and never through a symlink (`weight_buckets.open_in`); the
descriptor is fstat-checked (a regular file of one name, owned by the user its sender runs
as, at least `nbytes` long: the sender being a live process other than init) and that same
descriptor is mapped read-only and private, then closed. CUDA IPC buckets are typed
descriptions (`CudaIpcHandle`) checked against this rank's devices and the sender's identity
before torch's `rebuild_cuda_tensor` opens them. Opened buckets are kept for the next update
(`BucketCache`): released when their file or sender is gone, bounded by bytes.
docs/security.md lists the attacks these checks answer.
"""

from __future__ import annotations

import ctypes
import errno
import ipaddress
import mmap
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from omni_core.protocol import AddAdapter, InitWeightGroup
from omni_core.protocol.weights import (
    Bucket,
    CollectiveSource,
    CudaIpcHandle,
    DiskSource,
    IpcBucket,
    IpcSource,
    ShmSource,
    TensorSpec,
    WeightSource,
    source_tensors,
)
from omni_core.runners.base import ModelRunner, RunnerArgumentError
from omni_core.weight_buckets import (
    REF_COUNTER_FILE_BYTES,
    SHM_DIR,
    BucketRefused,
    check_cuda_ipc,
    check_owned_file,
    dtype_name,
    is_expandable_segment,
    lstat_in,
    open_in,
    process_uid,
    rebuild_cuda_ipc,
    ref_counter_name,
    sender_uid,
)
from omni_core.weight_group import WeightGroup
from omni_core.workers.bucket_cache import MAX_RETAINED_BUCKET_BYTES, BucketCache, CachedBucket

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
# Peer buckets copied ahead of the one the runner writes: 2 keep the peer link busy while the
# runner copies, holding at most 2 x (2 + 1) buckets of staging memory.
PEER_LOOKAHEAD = 2
# How long a join whose connections were shut down is waited for: short, as the refusal is
# due within the stage's deadline; a thread that takes longer ends by itself, its result unread.
JOIN_UNBLOCK_S = 0.5
_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}


def shm_name(handle: str, directory: Path = SHM_DIR) -> str:
    """The name of the bucket file a shm handle names; anything but a plain name directly under
    `directory` (another directory, '..', a path through it) is refused."""
    name = handle.removeprefix(str(directory) + "/")
    if not _SHM_NAME.match(name) or name in (".", ".."):
        raise RunnerArgumentError(
            f"shm handle {handle[:120]!r} is not a file directly under {directory}; "
            "share buckets with omni_core.weights_sender"
        )
    return name


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_readonly(fd: int, nbytes: int) -> torch.Tensor:
    """`nbytes` of the file open at `fd`, mapped read-only and private (a write through the
    mapping faults; nothing the rank does reaches the file), as a flat uint8 tensor. Mapped
    with mmap(2) itself: Python's mmap keeps a duplicate of the descriptor open for as long as
    the mapping lives, and the rank keeps no descriptor of a bucket. The mapping goes when the
    last tensor over it does."""
    addr = _libc.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, f"mmap: {os.strerror(code)}")

    class Mapping(ctypes.c_uint8 * nbytes):  # type: ignore[misc, valid-type]
        def __del__(self) -> None:
            _libc.munmap(ctypes.addressof(self), nbytes)

    return torch.frombuffer(Mapping.from_address(addr), dtype=torch.uint8)


class CudaIpcOps:
    """What the receiver asks of CUDA for an IPC bucket; the seam tests replace to show that a
    refused description never reaches `rebuild`."""

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def device_bytes(self, index: int) -> int | None:
        return int(torch.cuda.get_device_properties(index).total_memory)

    def rebuild(self, desc: CudaIpcHandle) -> torch.Tensor:
        return rebuild_cuda_ipc(desc)

    def allocation_problem(self, view: torch.Tensor, desc: CudaIpcHandle) -> str | None:
        """Whether the opened range lies inside the allocation the handle opened, as the driver
        (cuMemGetAddressRange) tells it from the handle's base: a storage offset or size past
        it would make the rank's copies read device memory the handle never shared (its own,
        or nothing: a fault that ends the rank's CUDA context). An expandable segment's extent
        was checked against its handle's header (check_cuda_ipc) instead."""
        if is_expandable_segment(desc.handle):
            return None
        ptr = view.data_ptr()
        base_ptr = ptr - desc.offset - desc.storage_offset  # where rebuild_cuda_tensor mapped the handle
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:  # pragma: no cover - a CUDA rank has its driver
            return "the CUDA driver (libcuda.so.1) cannot be loaded to check the opened range"
        get_range = driver.cuMemGetAddressRange_v2
        get_range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        with torch.cuda.device(view.device):
            status = get_range(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(base_ptr))
        if status != 0:
            return f"the driver knows no allocation at the handle's base (CUresult {status})"
        end = ptr + view.numel()
        if ptr < base.value or end > base.value + size.value:
            return (
                f"the opened range [{ptr:#x}, {end:#x}) lies outside its allocation "
                f"[{base.value:#x}, {base.value + size.value:#x})"
            )
        return None


def bounded_join(
    join: Callable[[], Any], join_s: float, address: str, port: int, left_behind: list[threading.Thread]
) -> Any:
    """`join()`'s result within `join_s`, else TimeoutError. torch's TCPStore client waits
    without a bound for the first answer of a peer that accepted its connection and never
    speaks (seen on 2.13: forever, whatever its timeout), so the join runs on a thread of its
    own and, past its time, this rank's connections to address:port are shut down, which ends
    that wait; the thread is then given a moment to leave. A thread still inside torch after
    that is appended to `left_behind`: the process must not finalize under it (C++ aborts
    with "terminate called without an active exception"), see `WeightReceiver.blocked_joins`."""
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["group"] = join()
        except BaseException as exc:  # handed to the caller below
            done["error"] = exc

    thread = threading.Thread(target=run, name="omni-core-weight-group-join", daemon=True)
    thread.start()
    thread.join(join_s)
    if thread.is_alive():
        cut = shut_connections_to(address, port)
        thread.join(JOIN_UNBLOCK_S)
        left = ""
        if thread.is_alive():
            left_behind.append(thread)
            left = "; its thread is still blocked and was left behind"
        raise TimeoutError(f"no complete answer within {join_s:.3g} s ({cut} connection(s) shut down{left})")
    if "error" in done:
        raise done["error"]
    return done["group"]


def shut_connections_to(address: str, port: int) -> int:
    """Shut down this process's TCP connections to address:port; how many there were."""
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        wanted = {_plain_ip(str(info[4][0])) for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)}
    except (OSError, UnicodeError):
        return 0
    cut = 0
    for name in os.listdir(fd_dir):
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue  # not a socket, or gone meanwhile
        try:
            peer = sock.getpeername() if sock.family in (socket.AF_INET, socket.AF_INET6) else None
            if peer is not None and peer[1] == port and _plain_ip(peer[0]) in wanted:
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass  # not connected
        finally:
            sock.close()  # the duplicate only
    return cut


def _plain_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as compared: an IPv4-mapped IPv6 peer (::ffff:a.b.c.d) is its IPv4 address."""
    ip = ipaddress.ip_address(text.split("%", 1)[0])
    return ip.ipv4_mapped or ip if isinstance(ip, ipaddress.IPv6Address) else ip


def check_specs(runner: ModelRunner, specs: tuple[TensorSpec, ...]) -> None:
    """Every tensor of the update must be one of the model's, with its shape and dtype."""
    check_against(runner.weight_specs(), specs, "a weight of this model")


def check_against(expected: Mapping[str, tuple[Any, torch.dtype]], specs: tuple[TensorSpec, ...], what: str) -> None:
    """Every tensor of `specs` must be one of `expected` (named `what`), with its shape and dtype."""
    for spec in specs:
        if spec.name not in expected:
            close = sorted(n for n in expected if n.rsplit(".", 1)[-1] == spec.name.rsplit(".", 1)[-1])[:3]
            hint = f"; similar names: {close}" if close else ""
            raise RunnerArgumentError(f"tensor {spec.name!r} is not {what}{hint}; nothing was written")
        shape, dtype = expected[spec.name]
        if tuple(spec.shape) != tuple(shape) or spec.dtype != dtype_name(dtype):
            raise RunnerArgumentError(
                f"tensor {spec.name!r} is {spec.dtype} {list(spec.shape)}, the model's is "
                f"{dtype_name(dtype)} {list(shape)}; nothing was written"
            )


def check_adapter_specs(runner: ModelRunner, command: AddAdapter, specs: tuple[TensorSpec, ...]) -> None:
    """An adapter's tensors: each one of those an adapter of its rank on its modules has, and
    every one of them sent (a refit is whole: a tensor left out would keep the old version's)."""
    expected = runner.adapter_specs(command)
    check_against(
        expected, specs, f"a tensor of adapter {command.name!r} (rank {command.rank} on {list(command.target_modules)})"
    )
    missing = sorted(set(expected) - {spec.name for spec in specs})
    if missing:
        raise RunnerArgumentError(
            f"adapter {command.name!r}: {len(missing)} of its {len(expected)} tensors are not sent "
            f"(first {missing[:3]}); send every lora_A and lora_B, by PEFT's names; nothing was written"
        )


class WeightReceiver:
    """One rank's receiver: its weight group (if joined) and the buckets it has open."""

    def __init__(
        self,
        device: torch.device,
        rank: int,
        *,
        shm_dir: Path = SHM_DIR,
        retained_bytes: int = MAX_RETAINED_BUCKET_BYTES,
        uid_of: Any = process_uid,
        cuda: CudaIpcOps | None = None,
    ) -> None:
        self.device = device
        self.rank = rank
        self.group: WeightGroup | None = None  # the trainer is its rank 0
        self.group_rank = -1
        self.shm_dir = shm_dir
        self.uid_of = uid_of  # pid -> uid, None when not running: the seam for another user's sender
        self.cuda = cuda if cuda is not None else CudaIpcOps()
        self.buckets = BucketCache(retained_bytes)
        self.reopened = 0  # buckets opened afresh (a reused one is not counted)
        self._joins_left_behind: list[threading.Thread] = []

    @property
    def blocked_joins(self) -> int:
        """Rendezvous threads still blocked inside torch; while any is, the rank leaves by
        `os._exit` (nothing of torch may be finalized under them)."""
        self._joins_left_behind = [thread for thread in self._joins_left_behind if thread.is_alive()]
        return len(self._joins_left_behind)

    # ------------------------------------------------------------------ group

    def join(self, command: InitWeightGroup) -> None:
        """Rendezvous with the trainer (group rank 0, serving the store) as rank_offset + rank."""
        import torch.distributed as dist

        self.group_rank = command.rank_offset + self.rank
        if self.group_rank >= command.world_size:
            raise RunnerArgumentError(
                f"group rank {self.group_rank} (rank_offset {command.rank_offset} + rank "
                f"{self.rank}) is outside world_size {command.world_size}"
            )
        if command.backend == "nccl" and self.device.type != "cuda":
            raise RunnerArgumentError(f"an nccl weight group needs a CUDA rank; this rank is on {self.device}")
        timeout = timedelta(seconds=command.timeout_s)
        join_s = command.join_timeout_s or command.timeout_s

        def rendezvous() -> Any:
            # The store's timeout bounds its connection attempts and the rendezvous through it.
            store = dist.TCPStore(
                command.address, command.port, command.world_size, is_master=False, timeout=timedelta(seconds=join_s)
            )
            # SGLang's layout (weight_group.py), so its trainers' init_custom_process_group joins.
            group = WeightGroup(
                store, command.group, self.group_rank, command.world_size, command.backend, command.timeout_s
            )
            store.set_timeout(timeout)  # NCCL exchanges its id through the store at the first broadcast
            return group

        try:
            self.group = bounded_join(rendezvous, join_s, command.address, command.port, self._joins_left_behind)
        except Exception as exc:
            self.group, self.group_rank = None, -1  # nothing half-joined is kept
            raise RunnerArgumentError(
                f"the rendezvous at {command.address}:{command.port} did not complete within {join_s:.3g} s "
                f"({type(exc).__name__}: {str(exc)[:200]}); start the trainer's side "
                "(WeightSender.init_group) while the stage joins, and check the address, port and world_size"
            ) from None

    # ------------------------------------------------------------------ update

    def apply(self, source: WeightSource, runner: ModelRunner) -> None:
        self.buckets.sweep()  # mappings of buckets whose file or sender is gone pin nothing more
        if isinstance(source, DiskSource):
            runner.reload_weights(source.path)  # the runner checks every header before writing
            return
        if not runner.supports_weight_update:
            raise RunnerArgumentError(f"runner {type(runner).__name__} takes updates from disk only")
        check_specs(runner, source_tensors(source))
        runner.update_weights(self._opened(source)())

    def open_adapter(
        self, command: AddAdapter, runner: ModelRunner
    ) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
        """An adapter's tensors (AddAdapter.tensors) through the same planes and the same
        checks as a weight update: every name, shape and dtype checked and every bucket opened
        before this returns; the tensors come when the result is called (the writing)."""
        assert command.tensors is not None
        self.buckets.sweep()
        if not runner.supports_adapter_tensors:
            raise RunnerArgumentError(f"runner {type(runner).__name__} takes adapters from a directory only")
        check_adapter_specs(runner, command, source_tensors(command.tensors))
        return self._opened(command.tensors)

    def _opened(self, source: WeightSource) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
        """Every handle of `source` opened (or its group checked), before any write; the
        named tensors come when the result is called."""
        if isinstance(source, ShmSource):
            in_use: set[Any] = set()
            try:
                views = [self._open_shm(bucket, in_use) for bucket in source.buckets]  # every handle before any write
            finally:
                self.buckets.trim(in_use)
            return lambda: self._tensors(source.buckets, views)
        if isinstance(source, IpcSource):
            if self.device.type != "cuda":
                raise RunnerArgumentError(
                    f"an ipc update carries CUDA IPC handles; this rank is on {self.device}: "
                    "share host buckets (shm) or broadcast (collective) instead"
                )
            in_use = set()
            try:
                opened = [self._open_ipc(bucket, in_use) for bucket in source.buckets]
            finally:
                self.buckets.trim(in_use)
            # A bucket on the trainer's GPU, a peer of ours, is staged here first.
            peer = any(v.device != self.device for v in opened)
            return lambda: self._tensors(source.buckets, self._staged(opened) if peer else opened)
        if isinstance(source, CollectiveSource):
            if self.group is None:
                raise RunnerArgumentError("a collective update needs a weight group: send InitWeightGroup first")
            return lambda: self._broadcast(source.tensors)
        raise RunnerArgumentError(f"unknown weight source {source!r}")  # pragma: no cover - the wire admits these

    def open_tensors(self, source: ShmSource | IpcSource) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of `source` as (name, view), each handle opened and checked now, before
        the first view is read (a refusal: RunnerArgumentError, nothing read); the views live
        in the sender's memory, so copy them, never keep them. A weight update's path
        (`_opened`), taken by a stage-to-stage transfer's landing (P-22)."""
        return self._opened(source)()

    def _staged(self, views: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Buckets on a peer GPU brought to this rank's GPU with cudaMemcpyPeerAsync (a plain
        copy_ of IPC-opened memory on another device fails with 'invalid argument' on torch
        2.11: seen on 2 x H100), pipelined on a side stream PEER_LOOKAHEAD buckets ahead of the
        runner's copies, so the peer link and the runner's writes overlap."""
        from omni_core.workers.backends.cuda_ops import peer_staged

        return peer_staged(self.device, views, PEER_LOOKAHEAD)

    @staticmethod
    def _tensors(
        buckets: Sequence[Bucket | IpcBucket], views: Iterable[torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, flat in zip(buckets, views, strict=True):
            for spec in bucket.tensors:
                raw = flat[spec.offset_bytes : spec.offset_bytes + spec.nbytes]
                yield spec.name, raw.view(_DTYPES[spec.dtype]).view(spec.shape)

    def _open_shm(self, bucket: Bucket, in_use: set[Any]) -> torch.Tensor:
        """Open one bucket file exactly once (no symlink, no create, read-only), check the
        descriptor and map it; a bucket already mapped is reused once its file checks out."""
        name = shm_name(bucket.handle, self.shm_dir)
        what = f"bucket {name}"
        try:
            owner = sender_uid(bucket.sender_pid, what, self.uid_of)
            try:
                fd = open_in(self.shm_dir, name)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise BucketRefused(
                        f"{what} of sender pid {bucket.sender_pid} is a symbolic link (or lies under one); "
                        "a bucket is a file of its own, never followed; nothing was written"
                    ) from None
                raise BucketRefused(
                    f"{what} of sender pid {bucket.sender_pid} cannot be opened "
                    f"({exc.strerror}); the sender released it or never made it"
                ) from None
            try:
                st = os.fstat(fd)
                check_owned_file(st, what, owner, bucket.sender_pid, bucket.nbytes)
                key = ("shm", st.st_dev, st.st_ino, bucket.nbytes)
                in_use.add(key)
                view = self.buckets.get(key)
                if view is None:
                    try:
                        view = self._map(fd, name, st, bucket.nbytes, key)
                    except OSError as exc:
                        raise BucketRefused(f"{what} cannot be mapped ({exc.strerror}); nothing was written") from None
            finally:
                os.close(fd)
        except BucketRefused as exc:
            raise RunnerArgumentError(str(exc)) from None
        return view

    def _map(self, fd: int, name: str, st: os.stat_result, nbytes: int, key: Any) -> torch.Tensor:
        view = torch.empty(0, dtype=torch.uint8) if nbytes == 0 else _map_readonly(fd, nbytes)
        identity = (st.st_dev, st.st_ino)
        directory = self.shm_dir

        def gone() -> bool:  # unlinked, or another file under the name: the mapping pins a dead file
            now = lstat_in(directory, name)
            return now is None or (now.st_dev, now.st_ino) != identity

        self.buckets.put(key, CachedBucket(view, nbytes, gone))
        self.reopened += 1
        return view

    def _open_ipc(self, bucket: IpcBucket, in_use: set[Any]) -> torch.Tensor:
        """A typed CUDA IPC description, checked (sender, bounds, ref counter file), then opened
        by torch's rebuild_cuda_tensor; a description already open is reused."""
        desc = bucket.ipc
        assert desc is not None  # IpcBucket refuses a bucket without one on decode
        pid = bucket.sender_pid
        what = f"the CUDA IPC bucket of sender pid {pid}"
        key = ("ipc", pid, desc)
        in_use.add(key)
        try:
            owner = sender_uid(pid, what, self.uid_of)
            view = self.buckets.get(key)
            if view is None:
                check_cuda_ipc(
                    desc, pid, device_count=self.cuda.device_count(), device_bytes=self.cuda.device_bytes(desc.device)
                )
                self._check_ref_counter(desc, owner, pid, what)
                try:
                    view = self.cuda.rebuild(desc)
                except Exception as exc:
                    raise BucketRefused(f"{what} cannot be opened: {type(exc).__name__}: {str(exc)[:300]}") from None
                problem = self.cuda.allocation_problem(view, desc)
                if problem is not None:
                    del view
                    raise BucketRefused(f"{what}: {problem}; nothing was written")
                self.buckets.put(key, CachedBucket(view, bucket.nbytes, lambda: self.uid_of(pid) != owner))
                self.reopened += 1
        except BucketRefused as exc:
            raise RunnerArgumentError(str(exc)) from None
        return view.view(torch.uint8).reshape(-1)[: bucket.nbytes]

    def _check_ref_counter(self, desc: CudaIpcHandle, owner: int, pid: int, what: str) -> None:
        """torch opens the ref counter by name, extending a short file and writing a counter in
        it when the rank lets the bucket go: it must be the sender's own, full-sized file."""
        name = ref_counter_name(desc)
        try:
            fd = open_in(SHM_DIR, name)
        except OSError as exc:
            raise BucketRefused(f"{what}: its ref counter {name!r} cannot be opened ({exc.strerror})") from None
        try:
            check_owned_file(os.fstat(fd), f"{what}: its ref counter {name!r}", owner, pid, REF_COUNTER_FILE_BYTES)
        finally:
            os.close(fd)

    def _broadcast(self, specs: tuple[TensorSpec, ...]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive each tensor from group rank 0 into a temporary of its own (one at a time:
        the runner copies it in, so at most one extra tensor is alive)."""
        group, device = self.group, self.device if self.device.type == "cuda" else torch.device("cpu")
        assert group is not None  # apply() refused a collective update without one
        for spec in specs:
            buffer = torch.empty(spec.shape, dtype=_DTYPES[spec.dtype], device=device)
            group.broadcast(buffer, root=0)
            yield spec.name, buffer

    def close(self) -> None:
        self.buckets.clear()
        self.group = None
