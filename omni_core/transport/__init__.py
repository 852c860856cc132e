"""Sockets between the orchestrator and its workers (pyzmq). Thin: framing only, no protocol."""

from omni_core.transport.zmq_socket import (
    DEFAULT_HWM,
    ipc_address,
    make_dealer,
    make_router,
)

__all__ = ["DEFAULT_HWM", "ipc_address", "make_dealer", "make_router"]
