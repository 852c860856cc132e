"""The rank's side of a weight update (P-17): open the sender's buckets, check, then write.

Everything that can be refused is refused before the first byte is written
(`RunnerArgumentError`, which the worker answers with NACK INVALID_ARGUMENT, state and
version unchanged): a name the model does not have, a shape or dtype other than the model's,
a bucket file that is gone or shorter than announced, a sender process that no longer runs,
CUDA IPC on a rank without CUDA, a broadcast with no weight group joined. A failure after
that (a sender that vanishes mid-broadcast, a copy that raises) propagates: the rank is then
NEEDS_RELOAD at its old version (NACK UPDATE_FAILED).

Shared-memory buckets are files directly under `SHM_DIR` named by the sender; a handle
naming anything else (another directory, '..') is refused. Opened buckets are kept, bounded,
keyed by (path, inode, size): a sender that refills the same buckets for the next version is
read through the mapping already open, never reopened.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from omni_core.protocol import InitWeightGroup
from omni_core.protocol.weights import (
    Bucket,
    CollectiveSource,
    DiskSource,
    IpcSource,
    ShmSource,
    TensorSpec,
    WeightSource,
    source_tensors,
)
from omni_core.runners.base import ModelRunner, RunnerArgumentError
from omni_core.weight_buckets import SHM_DIR, IpcArgs, dtype_name, sender_alive

_SHM_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")
MAX_OPEN_BUCKETS = 256  # mappings kept for the next update of the same buckets
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


def shm_path(handle: str) -> Path:
    """The bucket file a shm handle names; anything but a plain name under SHM_DIR is refused."""
    name = handle.removeprefix(str(SHM_DIR) + "/")
    if not _SHM_NAME.match(name) or name in (".", ".."):
        raise RunnerArgumentError(
            f"shm handle {handle[:120]!r} is not a file directly under {SHM_DIR}; "
            "share buckets with omni_core.weights_sender"
        )
    return SHM_DIR / name


def bounded_join(join: Callable[[], Any], join_s: float, address: str, port: int) -> Any:
    """`join()`'s result within `join_s`, else TimeoutError. torch's TCPStore client waits
    without a bound for the first answer of a peer that accepted its connection and never
    speaks (seen on 2.13: forever, whatever its timeout), so the join runs on a thread of its
    own and, past its time, this rank's connections to address:port are shut down, which ends
    that wait; the thread is then given a moment to leave."""
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
        left = "" if not thread.is_alive() else "; its thread is still blocked and was left behind"
        raise TimeoutError(f"no complete answer within {join_s:.3g} s ({cut} connection(s) shut down{left})")
    if "error" in done:
        raise done["error"]
    return done["group"]


def shut_connections_to(address: str, port: int) -> int:
    """Shut down this process's TCP connections to address:port; how many there were."""
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    try:
        wanted = {_plain_ip(info[4][0]) for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)}
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
    expected = runner.weight_specs()
    for spec in specs:
        if spec.name not in expected:
            close = sorted(n for n in expected if n.rsplit(".", 1)[-1] == spec.name.rsplit(".", 1)[-1])[:3]
            hint = f"; similar names: {close}" if close else ""
            raise RunnerArgumentError(f"tensor {spec.name!r} is not a weight of this model{hint}; nothing was written")
        shape, dtype = expected[spec.name]
        if tuple(spec.shape) != tuple(shape) or spec.dtype != dtype_name(dtype):
            raise RunnerArgumentError(
                f"tensor {spec.name!r} is {spec.dtype} {list(spec.shape)}, the model's is "
                f"{dtype_name(dtype)} {list(shape)}; nothing was written"
            )


class WeightReceiver:
    """One rank's receiver: its weight group (if joined) and the buckets it has open."""

    def __init__(self, device: torch.device, rank: int) -> None:
        self.device = device
        self.rank = rank
        self.group: Any = None  # a torch ProcessGroup with the trainer as rank 0
        self.group_rank = -1
        self._open: OrderedDict[tuple[str, int, int], torch.Tensor] = OrderedDict()
        self.reopened = 0  # buckets opened afresh (a reused one is not counted)

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
            prefixed = dist.PrefixStore(f"omni-weights/{command.group}", store)
            if command.backend == "gloo":
                group = dist.ProcessGroupGloo(prefixed, self.group_rank, command.world_size, timeout)
            else:
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                group = dist.ProcessGroupNCCL(prefixed, self.group_rank, command.world_size, options)
            store.set_timeout(timeout)  # NCCL exchanges its id through the store at the first broadcast
            return group

        try:
            self.group = bounded_join(rendezvous, join_s, command.address, command.port)
        except Exception as exc:
            self.group, self.group_rank = None, -1  # nothing half-joined is kept
            raise RunnerArgumentError(
                f"the rendezvous at {command.address}:{command.port} did not complete within {join_s:.3g} s "
                f"({type(exc).__name__}: {str(exc)[:200]}); start the trainer's side "
                "(WeightSender.init_group) while the stage joins, and check the address, port and world_size"
            ) from None

    # ------------------------------------------------------------------ update

    def apply(self, source: WeightSource, runner: ModelRunner) -> None:
        if isinstance(source, DiskSource):
            runner.reload_weights(source.path)  # the runner checks every header before writing
            return
        if not runner.supports_weight_update:
            raise RunnerArgumentError(f"runner {type(runner).__name__} takes updates from disk only")
        check_specs(runner, source_tensors(source))
        if isinstance(source, ShmSource):
            views = [self._open_shm(bucket) for bucket in source.buckets]  # every handle before any write
            runner.update_weights(self._tensors(source.buckets, views))
        elif isinstance(source, IpcSource):
            if self.device.type != "cuda":
                raise RunnerArgumentError(
                    f"an ipc update carries CUDA IPC handles; this rank is on {self.device}: "
                    "share host buckets (shm) or broadcast (collective) instead"
                )
            opened = [self._open_ipc(bucket) for bucket in source.buckets]
            # A bucket on the trainer's GPU, a peer of ours, is staged here first.
            local = self._staged(opened) if any(v.device != self.device for v in opened) else opened
            runner.update_weights(self._tensors(source.buckets, local))
        elif isinstance(source, CollectiveSource):
            if self.group is None:
                raise RunnerArgumentError("a collective update needs a weight group: send InitWeightGroup first")
            runner.update_weights(self._broadcast(source.tensors))
        else:  # pragma: no cover - the wire type admits only these
            raise RunnerArgumentError(f"unknown weight source {source!r}")

    def _staged(self, views: list[torch.Tensor]) -> Iterator[torch.Tensor]:
        """Buckets on a peer GPU brought to this rank's GPU with cudaMemcpyPeerAsync (a plain
        copy_ of IPC-opened memory on another device fails with 'invalid argument' on torch
        2.11: seen on 2 x H100), pipelined on a side stream PEER_LOOKAHEAD buckets ahead of the
        runner's copies, so the peer link and the runner's writes overlap."""
        from omni_core.workers.backends.cuda_ops import peer_staged

        return peer_staged(self.device, views, PEER_LOOKAHEAD)

    @staticmethod
    def _tensors(buckets: tuple[Bucket, ...], views: Iterable[torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket, flat in zip(buckets, views, strict=True):
            for spec in bucket.tensors:
                raw = flat[spec.offset_bytes : spec.offset_bytes + spec.nbytes]
                yield spec.name, raw.view(_DTYPES[spec.dtype]).view(spec.shape)

    def _open_shm(self, bucket: Bucket) -> torch.Tensor:
        path = shm_path(bucket.handle)
        if not sender_alive(bucket.sender_pid):
            raise RunnerArgumentError(
                f"sender pid {bucket.sender_pid} of bucket {path.name} no longer runs; "
                "its buckets are not trusted; nothing was written"
            )
        try:
            stat = path.stat()
        except OSError as exc:
            raise RunnerArgumentError(
                f"bucket {path.name} of sender pid {bucket.sender_pid} cannot be opened "
                f"({exc.strerror}); the sender released it or never made it"
            ) from None
        if stat.st_size < bucket.nbytes:
            raise RunnerArgumentError(
                f"bucket {path.name} of sender pid {bucket.sender_pid} holds {stat.st_size} "
                f"bytes, the update announces {bucket.nbytes}"
            )
        key = (str(path), stat.st_ino, bucket.nbytes)
        view = self._open.get(key)
        if view is None:
            if bucket.nbytes == 0:
                view = torch.empty(0, dtype=torch.uint8)
            else:
                view = torch.from_file(str(path), shared=True, size=bucket.nbytes, dtype=torch.uint8)
            self.reopened += 1
            self._open[key] = view
            while len(self._open) > MAX_OPEN_BUCKETS:
                self._open.popitem(last=False)
        self._open.move_to_end(key)
        return view

    def _open_ipc(self, bucket: Bucket) -> torch.Tensor:
        """A CUDA IPC handle: base64 of the pickled (rebuild function args) that
        torch.multiprocessing.reductions.reduce_tensor gives for the sender's flat uint8 bucket."""
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if not sender_alive(bucket.sender_pid):
            raise RunnerArgumentError(
                f"sender pid {bucket.sender_pid} of an ipc bucket no longer runs; nothing was written"
            )
        key = (bucket.handle, bucket.sender_pid, bucket.nbytes)
        view = self._open.get(key)
        if view is None:
            try:
                args = IpcArgs.loads(bucket.handle)
                view = rebuild_cuda_tensor(*args)
            except Exception as exc:
                raise RunnerArgumentError(
                    f"CUDA IPC handle of sender pid {bucket.sender_pid} cannot be opened: {type(exc).__name__}: {exc}"
                ) from None
            if view.numel() * view.element_size() < bucket.nbytes:
                raise RunnerArgumentError(
                    f"ipc bucket of sender pid {bucket.sender_pid} holds "
                    f"{view.numel() * view.element_size()} bytes, the update announces "
                    f"{bucket.nbytes}"
                )
            self.reopened += 1
            self._open[key] = view
            while len(self._open) > MAX_OPEN_BUCKETS:
                self._open.popitem(last=False)
        self._open.move_to_end(key)
        return view.view(torch.uint8).reshape(-1)

    def _broadcast(self, specs: tuple[TensorSpec, ...]) -> Iterator[tuple[str, torch.Tensor]]:
        """Receive each tensor from group rank 0 into a temporary of its own (one at a time:
        the runner copies it in, so at most one extra tensor is alive)."""
        import torch.distributed as dist

        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        for spec in specs:
            buffer = torch.empty(spec.shape, dtype=_DTYPES[spec.dtype], device=device)
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self.group.broadcast([buffer], options).wait()
            yield spec.name, buffer

    def close(self) -> None:
        self._open.clear()
        self.group = None
