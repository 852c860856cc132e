"""Who may reach the control plane from a browser: Host, Origin and content-type checks, and
the security headers of every answer.

A server on loopback without a key is open to every page the user's browser opens: a page of
another origin can send `fetch(url, {mode: "no-cors", method: "POST"})` (the answer is opaque,
the effect is not), and a page whose DNS name is rebound to 127.0.0.1 is, to the browser, the
same origin as the server. So, unless the operator configures otherwise:

- the Host header must name this server: a loopback name or address, the bind address, any
  IP address when bound to a wildcard address, or a name in `allowed_hosts` (a rebinding
  attack needs a DNS name of the attacker's, which is none of these);
- a state-changing request (any method but GET, HEAD, OPTIONS) whose Origin header is present
  must come from this server's own origin or one in `allowed_origins` (browsers send Origin
  on every such request, `null` included, which is refused);
- a state-changing request must carry its body as `application/json`, or have no body and
  no Content-Type (vLLM's `POST /sleep?level=1`): the content types a page may send without
  a CORS preflight (text/plain, multipart/form-data, application/x-www-form-urlencoded) are
  refused with 415, and so is a body without a type.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})
JSON_TYPES = ("application/json",)
ANY = "*"
# Answers that are data, not documents: nothing to run, frame or sniff.
DEFAULT_CSP = "default-src 'none'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'"
SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cross-origin-resource-policy", b"same-origin"),
)


def _normal_host(name: str) -> str:
    return name.strip().strip("[]").rstrip(".").lower()


def split_host_port(value: str) -> tuple[str, int | None]:
    """'[::1]:8000' -> ('::1', 8000); 'example.com' -> ('example.com', None). A malformed
    port gives -1, which matches nothing."""
    value = value.strip()
    if value.startswith("["):
        host, _, rest = value[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        host, _, port_text = value.partition(":")
    else:  # a bare IPv6 address or a plain name
        host, port_text = value, ""
    if not port_text:
        return _normal_host(host), None
    return _normal_host(host), int(port_text) if port_text.isdigit() and len(port_text) <= 5 else -1


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback_ip(name: str) -> bool:
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Refusal:
    status: int
    reason: str  # the metrics label: host, origin, content_type
    kind: str
    message: str


class BrowserPolicy:
    """The checks, apart from ASGI so they can be read and tested as plain functions."""

    def __init__(self, bind_host: str, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()) -> None:
        hosts = {_normal_host(h) for h in allowed_hosts}
        self.any_host = ANY in hosts
        self.bind_host = _normal_host(bind_host)
        self.wildcard_bind = self.bind_host in WILDCARD_HOSTS
        self.hosts = frozenset(hosts | LOOPBACK_NAMES | ({self.bind_host} - WILDCARD_HOSTS))
        origins = {o.strip().rstrip("/").lower() for o in allowed_origins}
        self.any_origin = ANY in origins
        self.origins = frozenset(origins)

    def host_ok(self, name: str) -> bool:
        if self.any_host or name in self.hosts or _is_loopback_ip(name):
            return True
        return self.wildcard_bind and _is_ip(name)

    def check(self, method: str, headers: dict[bytes, bytes]) -> Refusal | None:
        host_header = headers.get(b"host", b"").decode("latin-1")
        host, port = split_host_port(host_header)
        if host_header and not self.host_ok(host):
            return Refusal(
                403,
                "host",
                "ForeignHost",
                (
                    f"Host {host_header[:100]!r} does not name this server (it answers to {sorted(self.hosts)}"
                    f"{' and any IP address' if self.wildcard_bind else ''}): a page whose DNS name points here (DNS "
                    "rebinding) is refused. If you reach the server under this name, add it to [server] allowed_hosts "
                    "or pass --allowed-host"
                ),
            )
        if method in SAFE_METHODS:
            return None
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1").strip().rstrip("/").lower()
            if not (self.any_origin or text in self.origins or self._same_origin(text, host, port)):
                return Refusal(
                    403,
                    "origin",
                    "CrossOriginRefused",
                    (
                        f"Origin {text[:100]!r} is not this server's: a {method[:10]} from another site's page is "
                        "refused. To allow a page of that origin to change stages, add it to [server] allowed_origins "
                        "or pass --allowed-origin"
                    ),
                )
        content_type = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if content_type:
            if content_type in JSON_TYPES or content_type.endswith("+json"):
                return None
            return Refusal(
                415,
                "content_type",
                "UnsupportedMediaType",
                (
                    f"Content-Type {content_type[:100]!r} is refused on {method[:10]} routes: "
                    "they take application/json "
                    "(a page of another site can send text/plain, forms and multipart without asking). Send "
                    "'Content-Type: application/json', or no body and no Content-Type"
                ),
            )
        if _has_body(headers):
            return Refusal(
                415,
                "content_type",
                "UnsupportedMediaType",
                (
                    f"a {method[:10]} with a body needs 'Content-Type: application/json' (a body without a type is "
                    "what a page of another site can send); send the header, or no body"
                ),
            )
        return None

    @staticmethod
    def _same_origin(origin: str, host: str, port: int | None) -> bool:
        if origin == "null":
            return False
        try:
            parts = urlsplit(origin)
            origin_port = parts.port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        default = 443 if parts.scheme == "https" else 80
        return _normal_host(parts.hostname) == host and (origin_port or default) == (port or default)


def _has_body(headers: dict[bytes, bytes]) -> bool:
    if b"transfer-encoding" in headers:
        return True
    length = headers.get(b"content-length", b"0").strip()
    return not (length.isdigit() and int(length) == 0)


class BrowserGuard:
    """ASGI middleware: refuses what `BrowserPolicy` refuses (JSON error naming the setting
    to change) and puts the security headers on every answer."""

    def __init__(self, app: ASGIApp, policy: BrowserPolicy, on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.policy = policy
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                names = {name.lower() for name, _ in headers}
                headers += [(k, v) for k, v in SECURITY_HEADERS if k not in names]
                if b"content-security-policy" not in names:
                    headers.append((b"content-security-policy", DEFAULT_CSP.encode()))
                message = {**message, "headers": headers}
            await send(message)

        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers") or []:
            headers.setdefault(name.lower(), value)
        refusal = self.policy.check(scope["method"], headers)
        if refusal is None:
            await self.app(scope, receive, send_with_headers)
            return
        if self.on_refused is not None:
            self.on_refused(refusal.reason)
        error = {"code": refusal.status, "type": refusal.kind, "message": refusal.message}
        body = json.dumps({"error": error}).encode()
        await send_with_headers(
            {
                "type": "http.response.start",
                "status": refusal.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send_with_headers({"type": "http.response.body", "body": body})
