"""pyzmq socket helpers shared by the engine and the worker process.

Every socket gets a bounded high-water mark (a slow peer must not grow a queue without
limit) and linger 0 (closing must never block a process exit on a peer that is gone).
The orchestrator binds one ROUTER; each worker connects one DEALER whose identity names
its stage and rank, so ROUTER frames are `[identity, payload]` and DEALER frames are
`[payload]`.
"""

from __future__ import annotations

import ipaddress
import os
import tempfile
from dataclasses import dataclass

import zmq

from omni_core.protocol import DEFAULT_MAX_FRAME_BYTES

DEFAULT_HWM = 1024
# An engine's ROUTER (and the conformance harness, which stands in for an engine): messages
# queued per peer before a send fails. Above StageSpec's max_in_flight bound plus the lifecycle
# commands, so a full queue means an overloaded engine, never a normal burst.
ENGINE_SOCKET_HWM = 10_000
CURVE_CLIENT_KEYS_ENV = "OMNI_CORE_CURVE_CLIENT_KEYS"  # "public,secret", Z85, set by the engine
_KEY_SEPARATOR = ","  # not in the Z85 alphabet (":" is: it once split a key in two)
# Linux sun_path is 108 bytes including the NUL; zmq refuses longer ipc:// paths.
MAX_IPC_PATH_CHARS = 107


# Frames are refused by the socket itself (the peer is disconnected) a little above the
# codec's limit, so the codec, which answers with a NACK, sees every frame it can explain.
SOCKET_FRAME_SLACK_BYTES = 64 << 10


@dataclass(frozen=True)
class CurveKeys:
    """ZeroMQ CURVE keys of one engine (Z85 text): the ROUTER's pair and one client pair that
    its ranks share. Made fresh per engine; the secrets never touch disk or a command line."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE support; install pyzmq wheels (they bundle libsodium)")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, client_public, client_secret)

    def client_env(self) -> dict[str, str]:
        """What a rank needs, for its environment."""
        return {CURVE_CLIENT_KEYS_ENV: f"{self.client_public.decode()}{_KEY_SEPARATOR}{self.client_secret.decode()}"}


@dataclass(frozen=True)
class CurveClient:
    server_public: bytes
    client_public: bytes
    client_secret: bytes


def curve_client_keys(server_key: str | None) -> CurveClient | None:
    """The rank side: the server key from its config, its own pair from the environment
    (removed from it, so nothing the rank spawns inherits the secret)."""
    pair = os.environ.pop(CURVE_CLIENT_KEYS_ENV, None)
    if server_key is None:
        return None
    public, sep, secret = (pair or "").partition(_KEY_SEPARATOR)
    if not sep or len(public) != 40 or len(secret) != 40:
        raise RuntimeError(
            f"the engine uses CURVE but {CURVE_CLIENT_KEYS_ENV} is missing or malformed; "
            "ranks of a CURVE engine must be started by it (or given its client keys)"
        )
    return CurveClient(server_key.encode(), public.encode(), secret.encode())


def is_loopback(host: str) -> bool:
    """True for addresses that never leave the host (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: assume it may leave the host


def _configure(sock: zmq.Socket, hwm: int) -> None:
    if hwm <= 0:
        raise ValueError(f"high-water mark must be > 0 (got {hwm}); an unbounded queue hides overload")
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.LINGER, 0)


def make_dealer(
    ctx: zmq.Context,
    address: str,
    *,
    identity: bytes | None = None,
    hwm: int = DEFAULT_HWM,
    curve: CurveClient | None = None,
) -> zmq.Socket:
    """A DEALER connected to `address` (the worker side); with `curve`, encrypted and
    checking that the server holds the engine's key.

    No ZMQ_MAXMSGSIZE here: its only peer is the engine, which bounds what it sends, and
    libzmq treats an oversized frame as a protocol error after which a connecting socket
    never reconnects (the fuzzer left a worker alive but deaf). The worker's codec refuses
    frames over its `max_frame_bytes` (NACK BAD_MESSAGE) and it keeps serving."""
    sock = ctx.socket(zmq.DEALER)
    _configure(sock, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if curve is not None:
        sock.curve_serverkey = curve.server_public
        sock.curve_publickey = curve.client_public
        sock.curve_secretkey = curve.client_secret
    sock.connect(address)
    return sock


def make_router(
    ctx: zmq.Context,
    address: str,
    *,
    hwm: int = DEFAULT_HWM,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    curve: CurveKeys | None = None,
) -> zmq.Socket:
    """A ROUTER bound to `address` (the orchestrator side).

    ROUTER_MANDATORY makes a send to an identity that is not connected raise
    `zmq.ZMQError(EHOSTUNREACH)` instead of being dropped silently: a command to a dead
    worker must be noticed by its sender, not discovered at the deadline only. With
    `curve` the socket is a CURVE server; who may connect is decided by a ZAP handler the
    caller runs (see `omni_core.transport.curve_auth`).
    """
    if max_frame_bytes <= 0:
        raise ValueError(f"max_frame_bytes must be > 0 (got {max_frame_bytes})")
    sock = ctx.socket(zmq.ROUTER)
    _configure(sock, hwm)
    # Strangers reach this socket: a frame over the limit (plus room for the envelope) is
    # dropped with its connection by libzmq before it is read into memory.
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes + SOCKET_FRAME_SLACK_BYTES)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if curve is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve.server_secret
        sock.curve_publickey = curve.server_public
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
