"""Per-frame isolation, the rule both IO loops (the orchestrator's and a rank's) keep: nothing
raised while handling one frame (decode, authentication, dispatch to the core, the effect,
encoding, sending) may end the loop. The loop catches it around that one frame, counts it here
by cause, logs it at most once per cause per interval, and drops the frame or answers a NACK.
Only `InvariantViolation` (omni_core.fsm: a core in a state its invariants forbid) ends a loop,
loudly. specs/protocol.md, "Threat model", states the rule for other implementations.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

# The labels a failure is counted under: its class name when it is one of these, else
# "other". A closed set, so no peer can grow the counters (or a metric built from them).
CAUSES = frozenset(
    {
        "ProtocolError",
        "DecodeError",
        "ValidationError",
        "EncodeError",
        "TypeError",
        "ValueError",
        "KeyError",
        "IndexError",
        "AttributeError",
        "UnicodeError",
        "UnicodeDecodeError",
        "UnicodeEncodeError",
        "RecursionError",
        "OverflowError",
        "MemoryError",
        "ZMQError",
        "Again",
        "OSError",
        "RuntimeError",
        "AssertionError",
        "StageCommandError",
    }
)
OTHER = "other"
# The words every such log line holds: a fuzzer reading a rank's log finds them there.
LOG_MARK = "raised while handling"
# One log line per cause at most this often: a peer that sends a million bad frames writes
# a handful of lines, each with the count so far.
LOG_INTERVAL_S = 60.0


def cause_of(exc: BaseException) -> str:
    name = type(exc).__name__
    return name if name in CAUSES else OTHER


class FrameErrors:
    """What one loop caught while handling frames: counts by cause, rate-limited logging."""

    def __init__(
        self,
        loop: str,
        logger: logging.Logger,
        *,
        log_interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.loop = loop
        self.counts: dict[str, int] = {}
        self._log = logger
        self._interval_s = log_interval_s
        self._clock = clock
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def record(self, exc: BaseException, handling: str) -> str:
        """Count `exc` (raised while handling `handling`, e.g. "a frame from a rank") and log it
        unless its cause was logged within the interval. Returns its cause label."""
        cause = cause_of(exc)
        self.counts[cause] = self.counts.get(cause, 0) + 1
        now = self._clock()
        last_at = self._logged_at.get(cause)
        if last_at is not None and now - last_at < self._interval_s:
            self._unlogged[cause] = self._unlogged.get(cause, 0) + 1
            return cause
        self._logged_at[cause] = now
        unlogged = self._unlogged.pop(cause, 0)
        self._log.error(
            "%s: %s " + LOG_MARK + " %s; the frame was dropped and the loop serves on (%d of this cause so "
            "far, %d since the last line; at most one line per cause every %.0f s). If a peer of yours sent it, "
            "check that peer; otherwise this is a bug in omni-core: please report it with this line",
            self.loop,
            cause,
            handling,
            self.counts[cause],
            unlogged,
            self._interval_s,
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        return cause

    def as_counters(self, prefix: str = "frame_errors") -> dict[str, int]:
        """Flat counters for a status page: the total, and one per cause seen."""
        return {prefix: self.total, **{f"{prefix}_{cause}": n for cause, n in sorted(self.counts.items())}}
