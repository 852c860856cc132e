"""Connections that cannot starve the server: read deadlines, connection limits, quiet logs.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but has no deadline for a
request that is still arriving: a client that sends part of a request line, or nothing at
all, holds its socket and descriptor forever (slowloris), and 1,100 of them at `ulimit -n
1024` left no descriptor for authenticated callers. So each connection here, while its
request is incomplete (from the connection's opening, or from the first byte of a request on
a kept-alive connection), has `read_timeout_s` to deliver the whole request, headers and
body; and the server holds at most `max_connections` connections, below the descriptor
limit.

A connection that is not busy with a request (waiting for its request, or idle between
requests on keep-alive) can be closed to make room, oldest first, those that never presented
the server's API key before those that did: 64 idle keep-alive connections of a caller
without a key (`/health` is public) would otherwise hold every slot for as long as they
renew their keep-alive, and lock the operator out. One peer address holds at most
`max_connections_per_client` connections: at that cap, its newcomer makes room among its own
connections only, never another client's. A newcomer is refused (503) only when every
connection it could replace is busy with a request.

Logs caused by peers are rate limited: each kind of message at most once per
`LOG_INTERVAL_S`, with the count of those left out, so a flood cannot become a log storm.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("omni_core.serve")

LOG_INTERVAL_S = 10.0
LOG_KINDS_KEPT = 256  # distinct messages remembered by the rate limiter
# Descriptors kept for everything but HTTP: the ranks' sockets and pipes, logs, the engine's
# own sockets, imports that open files.
RESERVED_FDS = 128
FDS_PER_RANK = 8
MAX_CONNECTIONS_CAP = 10_000
MIN_CONNECTIONS = 16
REFUSED_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s"
)
REFUSED_BODY = (
    b'{"error":{"code":503,"type":"TooManyConnections","message":"every connection this one could replace '
    b"is busy with a request (the server holds max_connections, or this client "
    b'max_connections_per_client); retry in a second, or raise that [server] setting"}}'
)


def connection_limit(configured: int, ranks: int) -> int:
    """`configured` (0: automatic) kept below the process's descriptor limit, with room for
    the ranks' descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = MAX_CONNECTIONS_CAP if soft == resource.RLIM_INFINITY else soft - RESERVED_FDS - FDS_PER_RANK * ranks
    ceiling = max(MIN_CONNECTIONS, min(MAX_CONNECTIONS_CAP, room))
    if configured == 0:
        return ceiling
    if configured > ceiling:
        log.warning(
            "max_connections %d is above what the descriptor limit (ulimit -n %d) leaves for HTTP; using "
            "%d. Raise `ulimit -n` to allow more",
            configured,
            soft,
            ceiling,
        )
        return ceiling
    return configured


class RateLimitFilter(logging.Filter):
    """Lets each distinct message template through at most once per interval; the next one
    let through says how many were left out."""

    def __init__(self, interval_s: float = LOG_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.interval_s = interval_s
        self.clock = clock
        self._last: OrderedDict[tuple[str, str], list[float | int]] = OrderedDict()  # kind -> [time, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        kind = (record.name, str(record.msg)[:200])
        now = self.clock()
        seen = self._last.get(kind)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        suppressed = int(seen[1]) if seen is not None else 0
        self._last[kind] = [now, 0]
        self._last.move_to_end(kind)
        while len(self._last) > LOG_KINDS_KEPT:
            self._last.popitem(last=False)
        if suppressed:
            record.msg = f"{record.msg} ({suppressed} more like this in the last {self.interval_s:.0f} s not logged)"
        return True


PEER_LOGGERS = ("uvicorn.error", "uvicorn", "asyncio", "omni_core.serve")


def install_log_limits(interval_s: float = LOG_INTERVAL_S) -> None:
    """Rate-limit the loggers that peers can make speak (idempotent)."""
    for name in PEER_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(RateLimitFilter(interval_s))


class ConnectionGuard:
    """What the protocol instances of one server share: the open connections, by peer, those
    that may be closed to make room (oldest first), the limits and the counters."""

    def __init__(
        self,
        read_timeout_s: float,
        max_connections: int,
        on_closed: Callable[[str], None] | None = None,
        on_count: Callable[[int], None] | None = None,
        *,
        max_per_client: int = 0,
        key_accepts: Callable[[str | None], bool] | None = None,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.max_per_client = max_per_client or max_connections
        self.key_accepts = key_accepts  # None: the server has no key, every caller is alike
        self.on_closed = on_closed  # metrics: a connection closed by the guard, by reason
        self.on_count = on_count  # metrics: open connections
        self.open: set[Any] = set()
        self.per_client: Counter[str] = Counter()
        self.evictable: OrderedDict[Any, float] = OrderedDict()  # not busy with a request, oldest first

    def closed_by_guard(self, reason: str) -> None:
        if self.on_closed is not None:
            self.on_closed(reason)

    def add(self, conn: Any) -> None:
        self.open.add(conn)
        self.per_client[conn.peer] += 1
        self.count_changed()

    def forget(self, conn: Any) -> None:
        """`conn` no longer counts (closed, or being closed by the guard)."""
        self.evictable.pop(conn, None)
        if conn in self.open:
            self.open.discard(conn)
            self.per_client[conn.peer] -= 1
            if self.per_client[conn.peer] <= 0:
                del self.per_client[conn.peer]
            self.count_changed()

    def count_changed(self) -> None:
        if self.on_count is not None:
            self.on_count(len(self.open))

    def admit(self, peer: str) -> str | None:
        """Make room for a newcomer from `peer`; None when admitted, else why it is refused."""
        # A cap as high as the server's own is the server's: its evictions are counted as such.
        at_cap = self.max_per_client < self.max_connections and self.per_client[peer] >= self.max_per_client
        if at_cap and not self._evict(lambda conn: conn.peer == peer, "client_evicted"):
            return "client"
        if len(self.open) >= self.max_connections and not self._evict(lambda conn: True, "limit_evicted"):
            return "limit"
        return None

    def _evict(self, eligible: Callable[[Any], bool], reason: str) -> bool:
        """Close the oldest connection not busy with a request that `eligible` allows, one
        without the key first; False if there is none."""
        victim = None
        for conn in self.evictable:  # oldest first: the first without the key ends the search
            if not eligible(conn) or not conn.alive():
                continue
            if not conn.keyed:
                victim = conn
                break
            victim = victim or conn
        if victim is None:
            return False
        limit = (
            f"max_connections_per_client ({self.max_per_client}) for {victim.peer}"
            if reason == "client_evicted"
            else f"max_connections ({self.max_connections})"
        )
        victim.drop(reason, f"closed the oldest connection not busy with a request: the server holds {limit}")
        return True


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the guard's read deadline and connection limits."""

    class GuardedH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None
        peer = "?"
        keyed = False  # a request on it presented the server's API key

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self.peer = str(self.client[0]) if self.client else "?"
            refused = guard.admit(self.peer)
            if refused is not None:
                guard.closed_by_guard(f"{refused}_refused")
                log.warning(
                    "refused a connection from %s: %s; raise [server] %s (and ulimit -n) if this is load",
                    self.peer,
                    "it holds max_connections_per_client connections, each busy with a request"
                    if refused == "client"
                    else "the server holds max_connections connections, each busy with a request",
                    "max_connections_per_client" if refused == "client" else "max_connections",
                )
                transport.write(REFUSED_ANSWER % (len(REFUSED_BODY), REFUSED_BODY))
                transport.close()
                return
            guard.add(self)
            self._watch_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watch()
            guard.forget(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_request()

        def on_response_complete(self) -> None:
            if not self.keyed and guard.key_accepts is not None:
                presented = dict(self.headers).get(b"authorization")
                self.keyed = presented is not None and guard.key_accepts(presented.decode("latin-1"))
            super().on_response_complete()
            self._watch_request()

        def alive(self) -> bool:
            return self.transport is not None and not self.transport.is_closing()

        def _waiting_for_request(self) -> bool:
            # IDLE: no complete request line and headers yet; SEND_BODY: its body is arriving.
            if not self.alive():
                return False
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                return True
            if state is not h11.IDLE:
                return False
            # An idle kept-alive connection with nothing buffered is uvicorn's (keep_alive_s);
            # a fresh one, or one holding part of a request, is ours.
            return self.cycle is None or bool(self.conn.trailing_data[0])

        def _idle(self) -> bool:
            """Between requests on keep-alive: the last response sent, nothing of the next."""
            return (
                self.alive()
                and self.cycle is not None
                and self.cycle.response_complete
                and self.conn.their_state in (h11.IDLE, h11.DONE)
                and not self.conn.trailing_data[0]
            )

        def _watch_request(self) -> None:
            waiting = self._waiting_for_request()
            if waiting or self._idle():
                guard.evictable.setdefault(self, time.monotonic())
            else:
                guard.evictable.pop(self, None)
            if not waiting:
                self._stop_read_timer()
                return
            if self._read_timer is None:  # the deadline runs from the first byte: trickling does not extend it
                self._read_timer = self.loop.call_later(guard.read_timeout_s, self._read_timed_out)

        def _stop_read_timer(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _stop_watch(self) -> None:
            self._stop_read_timer()
            guard.evictable.pop(self, None)

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self._waiting_for_request():
                self.drop(
                    "read_timeout",
                    f"closed a connection whose request did not arrive within read_timeout_s "
                    f"({guard.read_timeout_s} s); a client that needs longer can raise "
                    "[server] read_timeout_s",
                )

        def drop(self, reason: str, why: str) -> None:
            guard.closed_by_guard(reason)
            log.warning(why)
            self._stop_watch()
            guard.forget(self)  # at once: the room it leaves is the newcomer's
            self.transport.close()

    return GuardedH11Protocol
