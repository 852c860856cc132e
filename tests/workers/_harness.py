"""A test-side orchestrator: one ROUTER socket, real worker processes, real bytes."""

from __future__ import annotations

import multiprocessing as mp
import shutil
import tempfile
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from omni_core.protocol import Command, Hello, Message, decode, encode
from omni_core.transport import ipc_address, make_router
from omni_core.workers.config import WorkerConfig
from omni_core.workers.process import run_worker

START_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 30.0


@dataclass
class WorkerHandle:
    prefix: bytes  # b"stage/rank/": a worker adds a random suffix to its socket identity
    process: Any  # multiprocessing.Process or subprocess.Popen
    config: WorkerConfig
    hello: Hello | None = None
    inbox: deque[Message] = field(default_factory=deque)
    socket_identity: bytes | None = None  # learnt from its first frame

    @property
    def identity(self) -> bytes:
        if self.socket_identity is None:
            raise AssertionError(f"no frame from {self.prefix!r} yet: wait for its Hello before sending")
        return self.socket_identity

    def is_alive(self) -> bool:
        poll = getattr(self.process, "poll", None)
        return poll() is None if poll is not None else self.process.is_alive()

    def exit_code(self, timeout_s: float) -> int | None:
        if hasattr(self.process, "wait"):
            try:
                return self.process.wait(timeout=timeout_s)
            except Exception:
                return None
        self.process.join(timeout_s)
        return self.process.exitcode


class TestOrchestrator:
    """Binds a ROUTER on ipc:// in a short private directory and drives workers through it."""

    __test__ = False  # not a pytest test class

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="omni-", dir="/tmp")
        self.address = ipc_address(self.directory)
        self.ctx = zmq.Context()
        self.sock = make_router(self.ctx, self.address)
        self.workers: dict[bytes, WorkerHandle] = {}
        self._pending: dict[bytes, deque[Message]] = defaultdict(deque)
        self._mp = mp.get_context("spawn")

    # ------------------------------------------------------------------ workers

    def config(self, rank: int, **overrides: Any) -> WorkerConfig:
        fields: dict[str, Any] = {
            "address": self.address,
            "rank": rank,
            "stage": "test",
            "backend": "portable",
            "device": "cpu",
            "parent_check_interval_s": 0.5,
        }
        fields.update(overrides)
        return WorkerConfig(**fields)

    def spawn(self, rank: int, **overrides: Any) -> WorkerHandle:
        config = self.config(rank, **overrides)
        process = self._mp.Process(target=run_worker, args=(config,), daemon=True)
        process.start()
        return self._register(config, process)

    def adopt(self, config: WorkerConfig, process: Any) -> WorkerHandle:
        """A worker started some other way (e.g. the command line)."""
        return self._register(config, process)

    def _register(self, config: WorkerConfig, process: Any) -> WorkerHandle:
        handle = WorkerHandle(f"{config.stage}/{config.rank}/".encode(), process, config)
        self.workers[handle.prefix] = handle
        return handle

    def _key(self, identity: bytes) -> bytes:
        """The handle a socket identity belongs to (by its stage/rank prefix), bound on first sight."""
        prefix = identity[: identity.rfind(b"/") + 1]
        handle = self.workers.get(prefix)
        if handle is not None and handle.socket_identity is None:
            handle.socket_identity = identity
        return prefix

    def wait_hello(self, worker: WorkerHandle, timeout_s: float = START_TIMEOUT_S) -> Hello:
        reply = self.next_message(worker, timeout_s)
        assert isinstance(reply, Hello), f"expected Hello first, got {reply!r}"
        worker.hello = reply
        return reply

    # ------------------------------------------------------------------ messages

    def send(self, worker: WorkerHandle, command: Command) -> None:
        self.send_raw(worker, encode(command))

    def send_raw(self, worker: WorkerHandle, data: bytes) -> None:
        self.sock.send_multipart([worker.identity, data])

    def next_message(self, worker: WorkerHandle, timeout_s: float = REPLY_TIMEOUT_S) -> Message:
        deadline = time.monotonic() + timeout_s
        while not self._pending[worker.prefix]:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                alive = worker.is_alive()
                raise TimeoutError(f"no message from {worker.prefix!r} in {timeout_s} s (alive: {alive})")
            if self.sock.poll(min(left_ms, 200)):
                identity, data = self.sock.recv_multipart()
                self._pending[self._key(identity)].append(decode(data))
            elif not worker.is_alive():
                raise RuntimeError(f"worker {worker.prefix!r} died, exit code {worker.exit_code(0)}")
        return self._pending[worker.prefix].popleft()

    def request(self, worker: WorkerHandle, command: Command, timeout_s: float = REPLY_TIMEOUT_S) -> Message:
        """Send and return the one terminal reply for this task_id."""
        self.send(worker, command)
        reply = self.next_message(worker, timeout_s)
        assert reply.task_id == command.task_id, f"reply for {reply.task_id!r}, expected {command.task_id!r}"
        return reply

    def close(self) -> None:
        for worker in self.workers.values():
            if worker.is_alive():
                worker.process.kill()
                worker.exit_code(10)
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.directory, ignore_errors=True)
