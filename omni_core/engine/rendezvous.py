"""Where a stage's ranks may open a weight group's rendezvous: the operator's choice, never
the caller's.

`InitWeightGroup` makes every rank open a TCP connection to the `address:port` a caller
names, and retry it: a caller who may ask for a weight group could otherwise make the ranks
reach any host they can (a cloud's metadata service, an internal port). The engine checks
the destination against `allowed_weight_group_hosts` before anything is sent, on the
caller's thread (a name is resolved here, not in the loop), and the ranks are given the
address it resolved to, so a name cannot resolve elsewhere by the time they connect.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable

from omni_core.engine.errors import InvalidArgumentError

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# Loopback only: a trainer on this host. Hosts beyond it are the operator's to add.
DEFAULT_WEIGHT_GROUP_HOSTS: tuple[str, ...] = ("127.0.0.0/8", "::1")
SETTING = "allowed_weight_group_hosts"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


def parse_allowed_hosts(entries: Iterable[str]) -> tuple[tuple[IpNetwork, ...], frozenset[str]]:
    """An allow list's networks (addresses and CIDR blocks) and host names (matched by name,
    case-insensitively). Raises InvalidArgumentError naming an entry that is neither."""
    networks: list[IpNetwork] = []
    names: set[str] = set()
    for entry in entries:
        if not isinstance(entry, str) or not entry.strip():
            raise InvalidArgumentError(f"{SETTING} entries are addresses, CIDR blocks or host names; got {entry!r}")
        text = entry.strip().strip("[]")
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
        except ValueError:
            if not _HOST_NAME.match(text):
                raise InvalidArgumentError(
                    f"{SETTING} entry {entry!r} is not an address, a CIDR block (10.0.0.0/8) or a host name"
                ) from None
            names.add(text.lower())
    return tuple(networks), frozenset(names)


class RendezvousPolicy:
    """The engine's allow list; `destination` turns a caller's address into the one the ranks
    may connect to, or refuses it."""

    def __init__(self, entries: Iterable[str] = DEFAULT_WEIGHT_GROUP_HOSTS) -> None:
        self.entries = tuple(entries)
        self.networks, self.names = parse_allowed_hosts(self.entries)

    def beyond_loopback(self) -> list[str]:
        """The entries that let ranks reach another host (for the server's start-up check)."""
        wide = [str(n) for n in self.networks if not (n.network_address.is_loopback and n[-1].is_loopback)]
        return wide + sorted(n for n in self.names if n != "localhost")

    def destination(self, address: str, port: int) -> str:
        """The numeric address the ranks connect to for `address`; InvalidArgumentError naming
        the host and the setting when it is not allowed or does not resolve."""
        host = address.strip().strip("[]")
        try:
            resolved = sorted({str(info[4][0]) for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)})
        except (socket.gaierror, UnicodeError, ValueError) as exc:
            raise InvalidArgumentError(
                f"weight group address {address[:100]!r} does not resolve ({exc}); name the trainer's host"
            ) from None
        if not resolved:
            raise InvalidArgumentError(f"weight group address {address[:100]!r} resolves to no address")
        by_name = host.lower() in self.names
        refused = [ip for ip in resolved if not by_name and not self._allowed_ip(ip)]
        if refused:
            shown = address[:100] if [address] == refused else f"{address[:100]} ({', '.join(refused)})"
            raise InvalidArgumentError(
                f"weight group address {shown} is not in {SETTING} {list(self.entries)}: the ranks open no "
                f"connection to it. If the trainer runs there, add the host (or its network) to {SETTING} "
                "([engine] in the config file, or Engine(allowed_weight_group_hosts=...))"
            )
        return resolved[0]

    def _allowed_ip(self, ip: str) -> bool:
        parsed = ipaddress.ip_address(ip.split("%", 1)[0])
        return any(parsed in network for network in self.networks)
