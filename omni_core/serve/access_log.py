"""The access log of `omni-core serve` (`[server] access_log`, `--access-log`): one line per
HTTP answer on the `omni_core.serve.access` logger: method, path, route template, status,
duration, client. A peer decides how many requests it sends, so the lines have a budget (a
token bucket: `ACCESS_LINES_PER_S` a second, bursts of `ACCESS_BURST`); past it requests are
counted, and the next line let through says how many were left out."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from omni_core.serve.logs import EVENT_ATTR

log = logging.getLogger("omni_core.serve.access")

ACCESS_LINES_PER_S = 50.0
ACCESS_BURST = 200
PATH_CHARS = 200  # a path is the caller's text: cut, and written escaped


class AccessLog:
    def __init__(
        self,
        rate_per_s: float = ACCESS_LINES_PER_S,
        burst: int = ACCESS_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rate_per_s, self.burst, self.clock = rate_per_s, burst, clock
        self._tokens, self._at, self._left_out = float(burst), clock(), 0
        self._lock = threading.Lock()

    def _admit(self) -> int | None:
        """The count left out before this line, or None when this line is over the budget."""
        with self._lock:
            now = self.clock()
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate_per_s)
            self._at = now
            if self._tokens < 1:
                self._left_out += 1
                return None
            self._tokens -= 1
            left_out, self._left_out = self._left_out, 0
            return left_out

    def answered(self, method: str, path: str, route: str, code: int, duration_s: float, client: str) -> None:
        left_out = self._admit()
        if left_out is None:
            return
        shown = path[:PATH_CHARS].encode("unicode_escape").decode("ascii")
        more = (
            f" ({left_out} requests before this one not logged: over {self.rate_per_s:.0f} lines/s)" if left_out else ""
        )
        fields = {
            "event": "access",
            "method": method,
            "path": shown,
            "route": route,
            "code": code,
            "duration_s": round(duration_s, 6),
            "client": client,
        }
        log.info(
            "%s %s -> %d in %.1f ms (%s)%s",
            method,
            shown,
            code,
            duration_s * 1000,
            client,
            more,
            extra={EVENT_ATTR: fields},
        )
