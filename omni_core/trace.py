"""Append-only JSON-lines trace of processed messages and state changes.

Every line: `seq` (per node, from 0), `time` (unix seconds), `node` (e.g. "engine/talker",
"talker/rank1"), `event`, `task_id`, `epoch`, `state`, plus event-specific fields. The
engine and every worker may append to the same file: each line is one `os.write` on an
O_APPEND descriptor, which keeps lines whole. Disabled tracing is the `NULL_TRACE` object,
whose `enabled` is False so hot paths skip building the record at all.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

MAX_TRACE_LINE_BYTES = 64 * 1024


class TraceWriter:
    enabled = True

    def __init__(self, path: str | os.PathLike[str], node: str) -> None:
        self.path = os.fspath(path)
        self.node = node
        self._seq = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def event(self, event: str, *, task_id: str = "", epoch: int = 0, state: str = "",
              **fields: Any) -> None:  # fmt: skip
        record = {"seq": self._seq, "time": time.time(), "node": self.node, "event": event,
                  "task_id": task_id, "epoch": epoch, "state": state, **fields}  # fmt: skip
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        if len(line) > MAX_TRACE_LINE_BYTES:
            record = {k: record[k] for k in ("seq", "time", "node", "event", "task_id", "epoch", "state")}
            record["truncated"] = True
            line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
        os.write(self._fd, line)
        self._seq += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _NullTrace:
    enabled = False
    node = ""

    def event(self, event: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


NULL_TRACE = _NullTrace()


def open_trace(path: str | os.PathLike[str] | None, node: str) -> TraceWriter | _NullTrace:
    return TraceWriter(path, node) if path else NULL_TRACE


def read_trace(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
