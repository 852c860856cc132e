"""The few CUDA runtime calls the fast path makes (ctypes on the libcudart torch loaded):
asynchronous copies on dedicated streams, host registration, and the relays' peer calls."""

from __future__ import annotations

import ctypes
import os
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_STREAMS = 2
# cudaMemcpyKind and cudaHostRegister flags (driver_types.h)
_H2D, _D2H, _DEFAULT = 1, 2, 4
_PEER_ACCESS_ALREADY_ENABLED = 704  # cudaErrorPeerAccessAlreadyEnabled
_HOST_REGISTER_PORTABLE = 1  # usable from every context: the arena may be prepared on another thread


def _find_cudart() -> str:
    """The libcudart torch loaded (vLLM's cumem module finds it the same way)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if "/" in line else ""
            if "libcudart" in os.path.basename(path):
                return path
    raise RuntimeError(
        "libcudart is not loaded in this process (torch links it statically?); "
        "the fast backend needs cudaMemcpyAsync and cudaHostRegister from it"
    )


class CudaOps:
    """The few CUDA runtime calls the fast path makes, on `device`'s dedicated streams."""

    def __init__(self, device: torch.device, streams: int = DEFAULT_STREAMS) -> None:
        torch.cuda.init()
        self.device = torch.device(device)
        rt = ctypes.CDLL(_find_cudart())
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        rt.cudaMemcpyAsync.argtypes = [vp, vp, sz, ctypes.c_int, vp]
        rt.cudaHostRegister.argtypes = [vp, sz, ctypes.c_uint]
        rt.cudaHostUnregister.argtypes = [vp]
        rt.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), sz, ctypes.c_uint]
        rt.cudaFreeHost.argtypes = [vp]
        rt.cudaGetErrorString.argtypes = [ctypes.c_int]
        rt.cudaGetErrorString.restype = ctypes.c_char_p
        rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), sz]
        rt.cudaFree.argtypes = [vp]
        rt.cudaDeviceEnablePeerAccess.argtypes = [ctypes.c_int, ctypes.c_uint]
        for fn in (
            rt.cudaMemcpyAsync,
            rt.cudaHostRegister,
            rt.cudaHostUnregister,
            rt.cudaHostAlloc,
            rt.cudaFreeHost,
            rt.cudaMalloc,
            rt.cudaFree,
            rt.cudaDeviceEnablePeerAccess,
        ):
            fn.restype = ctypes.c_int
        self._rt = rt
        self._stream_count = max(1, streams)
        self._streams: list[torch.cuda.Stream] | None = None
        self._peer_streams: dict[int, torch.cuda.Stream] = {}
        self._hop_streams: dict[int, torch.cuda.Stream] = {}
        self._staging: dict[int, int] = {}  # peer index -> its staging buffer (cudaMalloc on the peer)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA error {rc} ({self._rt.cudaGetErrorString(rc).decode()})")

    @property
    def streams(self) -> list[Any]:
        if self._streams is None:
            self._streams = [torch.cuda.Stream(device=self.device) for _ in range(self._stream_count)]
        return self._streams

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool, stream: Any) -> None:
        rc = self._rt.cudaMemcpyAsync(dst, src, nbytes, _H2D if to_device else _D2H, stream.cuda_stream)
        self._check(rc, f"cudaMemcpyAsync of {nbytes} bytes")

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # -- relays through a peer GPU (lanes.RelayLane)

    def peer_stream(self, peer: int) -> Any:
        if peer not in self._peer_streams:
            self._peer_streams[peer] = torch.cuda.Stream(device=torch.device("cuda", peer))
        return self._peer_streams[peer]

    def hop_stream(self, peer: int) -> Any:
        if peer not in self._hop_streams:
            self._hop_streams[peer] = torch.cuda.Stream(device=self.device)
        return self._hop_streams[peer]

    def _enable_peer_access(self, peer: int) -> None:
        own = self.device.index if self.device.index is not None else torch.cuda.current_device()
        if not torch.cuda.can_device_access_peer(own, peer):
            raise RuntimeError(
                f"cuda:{own} cannot access cuda:{peer} peer to peer (no NVLink or P2P between "
                "them): plan this copy on the direct link alone"
            )
        for here, there in ((own, peer), (peer, own)):
            with torch.cuda.device(here):
                rc = self._rt.cudaDeviceEnablePeerAccess(there, 0)
                if rc == _PEER_ACCESS_ALREADY_ENABLED:
                    self._rt.cudaGetLastError()  # the runtime keeps the code as its last error: clear it
                else:
                    self._check(rc, f"cudaDeviceEnablePeerAccess(cuda:{here} -> cuda:{there})")

    def staging(self, peer: int, nbytes: int) -> int:
        """`nbytes` of device memory on `peer`, held until release_staging(peer)."""
        self.release_staging(peer)
        self._enable_peer_access(peer)
        ptr = ctypes.c_void_p()
        with torch.cuda.device(peer):
            rc = self._rt.cudaMalloc(ctypes.byref(ptr), nbytes)
            self._check(rc, f"cudaMalloc of {nbytes} staging bytes on cuda:{peer}")
        self._staging[peer] = int(ptr.value or 0)
        return self._staging[peer]

    def release_staging(self, peer: int) -> None:
        ptr = self._staging.pop(peer, None)
        if ptr is not None:
            with torch.cuda.device(peer):
                self._check(self._rt.cudaFree(ptr), f"cudaFree of the staging buffer on cuda:{peer}")

    def copy_any(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        """A copy between any two addresses of the unified address space (host, this device, a peer)."""
        rc = self._rt.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT, stream.cuda_stream)
        self._check(rc, f"cudaMemcpyAsync of {nbytes} bytes through a peer")

    def stream_wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def after_current(self, stream: Any) -> None:
        stream.wait_stream(torch.cuda.current_stream(self.device))

    def wait(self, event: Any) -> None:
        event.synchronize()

    def streams_after_current(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            s.wait_stream(current)

    def current_after_streams(self) -> None:
        current = torch.cuda.current_stream(self.device)
        for s in self.streams:
            current.wait_stream(s)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def warm_up(self, device_ptr: int, host_ptr: int) -> None:
        for stream in self.streams:  # one byte each way on every stream (the slot is rewritten at sleep)
            self.copy(host_ptr, device_ptr, 1, False, stream)
            self.copy(device_ptr, host_ptr, 1, True, stream)
            self.wait(self.record(stream))

    def register(self, ptr: int, nbytes: int) -> None:
        self._check(
            self._rt.cudaHostRegister(ptr, nbytes, _HOST_REGISTER_PORTABLE), f"cudaHostRegister of {nbytes} bytes"
        )

    def unregister(self, ptr: int) -> None:
        self._check(self._rt.cudaHostUnregister(ptr), "cudaHostUnregister")

    def host_alloc(self, nbytes: int) -> int:
        ptr = ctypes.c_void_p()
        self._check(
            self._rt.cudaHostAlloc(ctypes.byref(ptr), nbytes, _HOST_REGISTER_PORTABLE),
            f"cudaHostAlloc of {nbytes} bytes",
        )
        return int(ptr.value or 0)

    def host_free(self, ptr: int) -> None:
        self._check(self._rt.cudaFreeHost(ptr), "cudaFreeHost")


_peer_runtime: Any = None


def _peer_copy_async(dst: torch.Tensor, src: torch.Tensor, stream: Any) -> None:
    """cudaMemcpyPeerAsync of all of `src` into `dst` (on another GPU) on `stream`; no wait."""
    global _peer_runtime
    if _peer_runtime is None:
        rt = ctypes.CDLL(_find_cudart())
        vp = ctypes.c_void_p
        rt.cudaMemcpyPeerAsync.argtypes = [vp, ctypes.c_int, vp, ctypes.c_int, ctypes.c_size_t, vp]
        rt.cudaMemcpyPeerAsync.restype = ctypes.c_int
        _peer_runtime = rt
    nbytes = src.numel() * src.element_size()
    if dst.numel() * dst.element_size() < nbytes:
        raise ValueError(f"peer copy of {nbytes} bytes into a tensor of {dst.numel() * dst.element_size()}")
    rc = _peer_runtime.cudaMemcpyPeerAsync(
        dst.data_ptr(), dst.device.index, src.data_ptr(), src.device.index, nbytes, stream.cuda_stream
    )
    if rc != 0:
        raise RuntimeError(
            f"cudaMemcpyPeerAsync of {nbytes} bytes from cuda:{src.device.index} to "
            f"cuda:{dst.device.index} failed: CUDA error {rc}"
        )


def peer_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (on one GPU, memory of this process or opened over CUDA IPC) into `dst` (on
    another) with cudaMemcpyPeerAsync on dst's current stream, then wait for it."""
    stream = torch.cuda.current_stream(dst.device)
    _peer_copy_async(dst, src, stream)
    stream.synchronize()


def peer_staged(device: torch.device, views: list[torch.Tensor], lookahead: int) -> Iterator[torch.Tensor]:
    """Each of `views` on `device`: those on a peer GPU (memory opened over CUDA IPC included)
    copied over with cudaMemcpyPeerAsync on a side stream, up to `lookahead` buckets ahead of
    the one being yielded, so the peer link runs while the caller copies the previous bucket.

    The caller's work on the current stream is ordered after each bucket's copy by an event
    (no host wait). The host waits only to bound memory: at most `lookahead` + 1 staged
    buckets are issued and not yet handed out, and bucket k - `lookahead` must have been
    consumed on the device before bucket k + 1 is handed out. A staged bucket is a fresh
    tensor, so a caller that keeps one keeps its bytes; the caller must have issued all its
    work on a bucket before asking for the next."""
    lookahead = max(1, lookahead)
    consumer = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    issued: deque[tuple[torch.Tensor, Any]] = deque()
    consumed: deque[Any] = deque()

    def issue(view: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if view.device == device:
            return view, None
        staged = torch.empty(view.numel() * view.element_size(), dtype=torch.uint8, device=device)
        side.wait_stream(consumer)  # the block may have served the consumer's earlier work
        _peer_copy_async(staged, view, side)
        staged.record_stream(side)
        ready = torch.cuda.Event()
        ready.record(side)
        return staged, ready

    ahead = 0
    for k in range(len(views)):
        while ahead < len(views) and ahead <= k + lookahead:
            issued.append(issue(views[ahead]))
            ahead += 1
        tensor, ready = issued.popleft()
        if ready is not None:
            consumer.wait_event(ready)
        yield tensor
        del tensor
        done = torch.cuda.Event()
        done.record(consumer)
        consumed.append(done)
        if len(consumed) > lookahead:
            consumed.popleft().synchronize()
