"""Where the orchestrator's ROUTER listens and whether it speaks CURVE: a private Unix socket
by default, tcp where the ranks run on other hosts, and CURVE wherever traffic can leave the
host (loopback and ipc rely on the per-rank Hello proof alone: specs/protocol.md, threat
model). No IO."""

from __future__ import annotations

from dataclasses import dataclass

from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.launch import RankLauncher
from omni_core.transport import is_loopback

LOOPBACK_HOST = "127.0.0.1"


@dataclass(frozen=True)
class Binding:
    transport: str  # "ipc" or "tcp"
    host: str
    curve: bool

    def endpoint(self, directory: str) -> str:
        """The address to bind: a socket file in `directory` (ipc), any free port on the host (tcp)."""
        return f"ipc://{directory}/router.sock" if self.transport == "ipc" else f"tcp://{self.host}:*"


def choose_binding(launcher: RankLauncher, transport: str | None, host: str | None, curve: bool | None) -> Binding:
    """The binding the Engine's arguments ask for; InvalidArgumentError, naming the argument to
    change, for a combination that would leave the host unprotected or cannot work."""
    if launcher.remote:
        # Ranks elsewhere reach us over tcp on the interface the cluster knows this node
        # by, always with CURVE: the network between hosts is not ours.
        if transport not in (None, "tcp") or curve is False:
            raise InvalidArgumentError(
                f"the {launcher.name} launcher runs ranks on other hosts: transport must be 'tcp' and curve not False"
            )
        transport, curve = "tcp", True
        host = host if host is not None else launcher.bind_host()
    transport = transport if transport is not None else "ipc"
    host = host if host is not None else LOOPBACK_HOST
    if transport not in ("ipc", "tcp"):
        raise InvalidArgumentError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
    if transport == "ipc" and (host != LOOPBACK_HOST or curve):
        raise InvalidArgumentError("host and curve apply to transport='tcp'; ipc never leaves the host")
    use_curve = curve if curve is not None else transport == "tcp" and not is_loopback(host)
    if transport == "tcp" and not is_loopback(host) and not use_curve:
        raise InvalidArgumentError(f"tcp on {host!r} leaves the host; it needs curve=True (the default there)")
    return Binding(transport, host, use_curve)
