"""The runner's own counters on the rank's replies (a prompt cache's hits and misses).

The runner names them once, at load: the Hello declares that set, and every later Ack and
Result carries the values of exactly those names, so the stage's status and metrics show them
with labels from a closed set. The runner is the user's code: what it returns is checked here,
before it reaches the wire, and a runner whose counters are broken loses its counters (logged
once), never a reply.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec

from omni_core.protocol import Ack, Message, Result
from omni_core.protocol.messages import RunnerCounters
from omni_core.runners.base import ModelRunner

log = logging.getLogger(__name__)


class CounterStamp:
    """Reads a runner's counters and puts them on the replies that carry them."""

    def __init__(self, runner: ModelRunner | None, what: str) -> None:
        self.runner = runner
        self.what = what  # "worker stage/rank", for the log
        self.broken = ""  # why the counters are no longer sent ("": they are)
        self.names: frozenset[str] | None = None  # the set the Hello declares, once read
        self.declared: dict[str, int] = self._read()
        self.names = frozenset(self.declared)

    def _read(self) -> dict[str, int]:
        if self.broken or self.runner is None:
            return {}
        try:
            raw = self.runner.counters()
            if not isinstance(raw, Mapping):
                raise TypeError(f"counters() returned a {type(raw).__name__}, not a mapping of name to int")
            values = msgspec.convert(dict(raw), RunnerCounters)
        except Exception as exc:  # the user's runner: any error ends its counters, not the rank
            return self._stop(f"{type(exc).__name__}: {exc}")
        if self.names is not None and frozenset(values) != self.names:
            return self._stop(f"it named {sorted(values)} after declaring {sorted(self.names)} at load")
        return values

    def _stop(self, why: str) -> dict[str, int]:
        self.broken = why
        log.error(
            "%s: the runner's counters are not sent from now on: %s; ModelRunner.counters must return the "
            "same names every time (at most 16 of [a-z0-9_], starting with a letter), each an int in 0..2**63-1",
            self.what,
            why,
        )
        return {}

    def stamp(self, message: Message) -> Message:
        """`message` with the runner's counters now, where it is a reply that carries them."""
        if not self.names or not isinstance(message, (Ack, Result)):
            return message
        values = self._read()
        return msgspec.structs.replace(message, runner_counters=values) if values else message
