"""Sockets between the orchestrator and its workers (pyzmq). Thin: framing only, no protocol."""

from omni_core.transport.zmq_socket import (
    CURVE_CLIENT_KEYS_ENV,
    DEFAULT_HWM,
    ENGINE_SOCKET_HWM,
    CurveClient,
    CurveKeys,
    curve_client_keys,
    ipc_address,
    is_loopback,
    make_dealer,
    make_router,
)

__all__ = [
    "CURVE_CLIENT_KEYS_ENV",
    "DEFAULT_HWM",
    "ENGINE_SOCKET_HWM",
    "CurveClient",
    "CurveKeys",
    "curve_client_keys",
    "ipc_address",
    "is_loopback",
    "make_dealer",
    "make_router",
]
