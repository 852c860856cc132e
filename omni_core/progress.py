"""A one-line progress indicator for long work on the command line (`omni-core models make`,
the real demo's first run): `qwen2 large: 41% (0.63 of 1.54 G params)`, redrawn in place on
stderr. Silent unless stderr is a terminal, so logs and pipes get only the final summary;
`--quiet` silences it on a terminal too. Standard library only."""

from __future__ import annotations

import sys
import time
from typing import TextIO

REDRAW_S = 0.2  # at most five redraws a second: a terminal over ssh stays responsive


class Progress:
    """Counts `done` towards `total` (set or raised with `add_total`) and redraws one line."""

    def __init__(
        self,
        label: str,
        *,
        unit: str = "",
        scale: float = 1.0,
        stream: TextIO | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.label = label
        self.unit = unit
        self.scale = scale  # shown values are divided by it (1e9 with unit "G params")
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_terminal(self.stream) if enabled is None else enabled
        self.total = 0
        self.done = 0
        self._drawn_at = float("-inf")
        self._width = 0

    def add_total(self, amount: int) -> None:
        self.total += amount
        self._draw(force=True)

    def advance(self, amount: int) -> None:
        self.done += amount
        self._draw(force=self.done >= self.total)

    def note(self, what: str) -> None:
        """A phase with no count (writing files): shown after the count."""
        self._draw(force=True, suffix=f", {what}")

    def close(self) -> None:
        """Clear the line, so the caller's summary starts on a clean one."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        self._width = 0

    def line(self, suffix: str = "") -> str:
        if self.total <= 0:
            return f"{self.label}: starting{suffix}"
        percent = min(100, int(100 * self.done / self.total))
        if self.scale == 1:  # a count of things (cases, files): whole numbers
            shown = f"{self.done} of {self.total}"
        else:
            shown = f"{self.done / self.scale:.2f} of {self.total / self.scale:.2f}"
        shown += f" {self.unit}" if self.unit else ""
        return f"{self.label}: {percent:3d}% ({shown}){suffix}"

    def _draw(self, *, force: bool = False, suffix: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._drawn_at < REDRAW_S:
            return
        self._drawn_at = now
        text = self.line(suffix)
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = max(self._width, len(text))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed, or no real file
        return False
