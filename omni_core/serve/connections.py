"""Connections that cannot starve the server: read deadlines, a connection limit, quiet logs.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but has no deadline for a
request that is still arriving: a client that sends part of a request line, or nothing at
all, holds its socket and descriptor forever (slowloris), and 1,100 of them at `ulimit -n
1024` left no descriptor for authenticated callers. So each connection here, while its
request is incomplete (from the connection's opening, or from the first byte of a request on
a kept-alive connection), has `read_timeout_s` to deliver the whole request, headers and
body; and the server holds at most `max_connections` connections, below the descriptor
limit. When full, the connection that has waited longest for its request is closed to make
room (a real client sends its request at once, so it is never the oldest waiting for long);
only when none is waiting is the newcomer refused, with a 503.

Logs caused by peers are rate limited: each kind of message at most once per
`LOG_INTERVAL_S`, with the count of those left out, so a flood cannot become a log storm.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import OrderedDict
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
    b'{"error":{"code":503,"type":"TooManyConnections","message":"the server holds max_connections '
    b'connections, each busy with a request; retry in a second, or raise [server] max_connections"}}'
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
    """What the protocol instances of one server share: the open connections, those waiting
    for their request (oldest first), the limits and the counters."""

    def __init__(
        self,
        read_timeout_s: float,
        max_connections: int,
        on_closed: Callable[[str], None] | None = None,
        on_count: Callable[[int], None] | None = None,
    ) -> None:
        self.read_timeout_s = read_timeout_s
        self.max_connections = max_connections
        self.on_closed = on_closed  # metrics: a connection closed by the guard, by reason
        self.on_count = on_count  # metrics: open connections
        self.open: set[Any] = set()
        self.waiting: OrderedDict[Any, float] = OrderedDict()

    def closed_by_guard(self, reason: str) -> None:
        if self.on_closed is not None:
            self.on_closed(reason)

    def count_changed(self) -> None:
        if self.on_count is not None:
            self.on_count(len(self.open))

    def make_room(self) -> bool:
        """Close the connection that has waited longest for its request; False if none waits."""
        while self.waiting:
            oldest, _ = self.waiting.popitem(last=False)
            if oldest.transport is not None and not oldest.transport.is_closing():
                oldest.drop(
                    "limit_evicted",
                    f"closed a connection that had waited longest for its request: the "
                    f"server holds max_connections ({self.max_connections})",
                )
                return True
        return False


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with the guard's read deadline and connection limit."""

    class GuardedH11Protocol(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(guard.open) >= guard.max_connections and not guard.make_room():
                guard.closed_by_guard("limit_refused")
                log.warning(
                    "refused a connection: the server holds max_connections (%d) connections, each busy "
                    "with a request; raise [server] max_connections (and ulimit -n) if this is load",
                    guard.max_connections,
                )
                transport.write(REFUSED_ANSWER % (len(REFUSED_BODY), REFUSED_BODY))
                transport.close()
                return
            guard.open.add(self)
            guard.count_changed()
            self._watch_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_watch()
            if self in guard.open:
                guard.open.discard(self)
                guard.count_changed()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_request()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch_request()

        def _waiting_for_request(self) -> bool:
            # IDLE: no complete request line and headers yet; SEND_BODY: its body is arriving.
            if self.transport is None or self.transport.is_closing():
                return False
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                return True
            if state is not h11.IDLE:
                return False
            # An idle kept-alive connection with nothing buffered is uvicorn's (keep_alive_s);
            # a fresh one, or one holding part of a request, is ours.
            return self.cycle is None or bool(self.conn.trailing_data[0])

        def _watch_request(self) -> None:
            if not self._waiting_for_request():
                self._stop_watch()
                return
            if self._read_timer is None:  # the deadline runs from the first byte: trickling does not extend it
                self._read_timer = self.loop.call_later(guard.read_timeout_s, self._read_timed_out)
                guard.waiting[self] = time.monotonic()

        def _stop_watch(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None
            guard.waiting.pop(self, None)

        def _read_timed_out(self) -> None:
            self._read_timer = None
            guard.waiting.pop(self, None)
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
            self.transport.close()

    return GuardedH11Protocol
