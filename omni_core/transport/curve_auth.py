"""Who may connect to a CURVE ROUTER: only clients holding this engine's client key.

ZeroMQ asks a ZAP handler about every CURVE handshake; pyzmq runs one on a thread. A peer
with any other key never completes the handshake, so none of its frames reach the loop.
"""

from __future__ import annotations

import hmac

import zmq
from zmq.auth.thread import ThreadAuthenticator

from omni_core.transport.zmq_socket import CurveKeys


class _OnlyOurClients:
    def __init__(self, client_public: bytes) -> None:
        self.allowed = client_public  # pyzmq hands the callback Z85 keys, as CurveKeys holds them
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = hmac.compare_digest(key, self.allowed)
        if not ok:
            self.refused += 1
        return ok


class CurveGate:
    """Runs the ZAP handler for one engine's context; `refused` counts strangers turned away."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._policy = _OnlyOurClients(keys.client_public)
        self._auth = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve_callback(domain="*", credentials_provider=self._policy)

    @property
    def refused(self) -> int:
        return self._policy.refused

    def stop(self) -> None:
        self._auth.stop()
