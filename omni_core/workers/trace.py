"""JSON-lines trace of a worker: one line per processed message and per state change.

Lines carry `seq` (per process, from 0), `t` (unix time, seconds), `node` (stage/rank),
`event`, `task_id`, `epoch` and `state`, plus optional extras. The formal tooling checks
such traces against the TLA+ spec. Disabled (the default) it costs one `None` test per
message: the worker holds `None` instead of a writer.
"""

from __future__ import annotations

import json
import time
from typing import IO, Any


class TraceWriter:
    def __init__(self, path: str, node: str) -> None:
        # Line-buffered append: a crash loses at most the line being written, and several
        # processes may share one file (each line is one write).
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
        self.node = node
        self.seq = 0

    def write(self, event: str, *, task_id: str | None, epoch: int | None, state: str,
              **extra: Any) -> None:  # fmt: skip
        record = {"seq": self.seq, "t": time.time(), "node": self.node, "event": event,
                  "task_id": task_id, "epoch": epoch, "state": state, **extra}  # fmt: skip
        self.seq += 1
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")

    def close(self) -> None:
        self._file.close()


def open_trace(path: str | None, node: str) -> TraceWriter | None:
    return TraceWriter(path, node) if path else None
