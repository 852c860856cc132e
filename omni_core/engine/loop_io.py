"""The orchestrator's IO resources: the zmq context, the ROUTER the ranks connect to (with
its CURVE gate where traffic can leave the host), the pipe that wakes the loop when a call
is queued, the poller over both and over the ranks' process sentinels, and the directory of
the ipc socket. Made on the caller's thread; polled and closed by the loop thread."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Any

import zmq

from omni_core.engine.binding import Binding
from omni_core.transport import ENGINE_SOCKET_HWM, CurveKeys, make_router

WAKE_READ_BYTES = 4096


class LoopIO:
    def __init__(self, binding: Binding, max_frame_bytes: int) -> None:
        self.ctx = zmq.Context()
        self.curve = CurveKeys.generate() if binding.curve else None
        self.curve_gate = None
        if self.curve is not None:
            from omni_core.transport.curve_auth import CurveGate  # a thread: only where CURVE is used

            self.curve_gate = CurveGate(self.ctx, self.curve)
        self.directory = tempfile.mkdtemp(prefix="omni-core-")
        self.router = make_router(
            self.ctx,
            binding.endpoint(self.directory),
            hwm=ENGINE_SOCKET_HWM,
            max_frame_bytes=max_frame_bytes,
            curve=self.curve,
        )
        self.address: str = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(self.router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        """What is ready (the router, sentinels) after at most `timeout_ms`; a wake-up is consumed."""
        ready = dict(self._poller.poll(timeout_ms))
        if self._wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, WAKE_READ_BYTES)
        return ready

    def wake(self) -> None:
        """End the loop's current poll (a call was queued); callable from any thread."""
        with contextlib.suppress(OSError):  # closed: the loop is gone, the caller is answered anyway
            os.write(self._wake_w, b"x")

    def watch(self, fd: int) -> None:
        self._poller.register(fd, zmq.POLLIN)

    def unwatch(self, fd: int) -> None:
        self._poller.unregister(fd)

    def close(self) -> None:
        self.router.close(0)
        if self.curve_gate is not None:
            self.curve_gate.stop()
        self.ctx.term()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        shutil.rmtree(self.directory, ignore_errors=True)
