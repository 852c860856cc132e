"""pyzmq socket helpers shared by the engine and the worker process.

Every socket gets a bounded high-water mark (a slow peer must not grow a queue without
limit) and linger 0 (closing must never block a process exit on a peer that is gone).
The orchestrator binds one ROUTER; each worker connects one DEALER whose identity names
its stage and rank, so ROUTER frames are `[identity, payload]` and DEALER frames are
`[payload]`.
"""

from __future__ import annotations

import os
import tempfile

import zmq

DEFAULT_HWM = 1024
# Linux sun_path is 108 bytes including the NUL; zmq refuses longer ipc:// paths.
MAX_IPC_PATH_CHARS = 107


def _configure(sock: zmq.Socket, hwm: int) -> None:
    if hwm <= 0:
        raise ValueError(f"high-water mark must be > 0 (got {hwm}); an unbounded queue hides overload")
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)


def make_dealer(
    ctx: zmq.Context, address: str, *, identity: bytes | None = None, hwm: int = DEFAULT_HWM
) -> zmq.Socket:
    """A DEALER connected to `address` (the worker side)."""
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def make_router(ctx: zmq.Context, address: str, *, hwm: int = DEFAULT_HWM) -> zmq.Socket:
    """A ROUTER bound to `address` (the orchestrator side).

    ROUTER_MANDATORY makes a send to an identity that is not connected raise
    `zmq.ZMQError(EHOSTUNREACH)` instead of being dropped silently: a command to a dead
    worker must be noticed by its sender, not discovered at the deadline only.
    """
    sock = ctx.socket(zmq.ROUTER)
    _configure(sock, hwm)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.bind(address)
    return sock


def ipc_address(directory: str | None = None, name: str = "omni.sock") -> str:
    """An `ipc://` address in a fresh private directory (or in `directory`).

    Raises when the path is longer than a Unix socket path may be, naming the path, rather
    than letting zmq fail with a bare 'Invalid argument'.
    """
    base = directory if directory is not None else tempfile.mkdtemp(prefix="omni-")
    path = os.path.join(base, name)
    if len(path) > MAX_IPC_PATH_CHARS:
        raise ValueError(
            f"ipc socket path {path!r} has {len(path)} characters; Unix sockets allow "
            f"{MAX_IPC_PATH_CHARS}. Use a shorter directory (e.g. tempfile.mkdtemp(dir='/tmp'))"
        )
    return f"ipc://{path}"
