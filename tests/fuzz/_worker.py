"""A real worker process behind a ROUTER, for sending it exact bytes (regression tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

import msgspec
import zmq

from omni_core.conformance.targets import REFERENCE_RUNNER_ARGS
from omni_core.protocol import Hello, Message, decode
from omni_core.transport import ipc_address, make_router

START_TIMEOUT_S = 120.0


class RawWorker:
    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="omni-fzt-", dir="/tmp")
        self.ctx = zmq.Context()
        self.sock = make_router(self.ctx, ipc_address(self.directory))
        address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        config = {
            "address": address,
            "rank": 0,
            "stage": "regress",
            "runner": "synthetic",
            "runner_args": REFERENCE_RUNNER_ARGS,
            "backend": "portable",
            "device": "cpu",
            "parent_check_interval_s": 0.5,
            "parent_pid": os.getpid(),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_core.workers", "--config", msgspec.json.encode(config).decode()],
            stdin=subprocess.DEVNULL,
        )
        hello = self.next_message(START_TIMEOUT_S)
        assert isinstance(hello, Hello), hello
        self.hello = hello

    def next_message(self, timeout_s: float = 30.0) -> Message:
        deadline_at = time.monotonic() + timeout_s
        while time.monotonic() < deadline_at:
            if self.sock.poll(200):
                frames = self.sock.recv_multipart()
                self.identity = frames[0]
                return decode(frames[-1])
            if self.proc.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.proc.returncode}")
        raise TimeoutError(f"no message from the worker in {timeout_s} s")

    def send(self, data: bytes) -> None:
        self.sock.send_multipart([self.identity, data])

    def request(self, data: bytes, timeout_s: float = 30.0) -> Message:
        self.send(data)
        return self.next_message(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.directory, ignore_errors=True)
