"""One log line per event, as text or as JSON: the formats of `omni-core serve`'s log, which
its rank processes use too (they inherit `LOG_FORMAT_ENV`), so one reader parses all of it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

LOG_FORMAT_ENV = "OMNI_CORE_LOG_FORMAT"  # "text" or "json": rank processes inherit it and log alike
EVENT_ATTR = "omni_event"  # a record's structured fields: `log.info(msg, extra={EVENT_ATTR: {...}})`


def _one_line(text: str) -> str:
    # A traceback or a message quoting a rank's stderr must not split one event over lines.
    return text.replace("\r", "").replace("\n", " | ")


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """`2026-11-26T09:30:00.123Z WARNING omni_core.serve: message`, always one line."""

    def format(self, record: logging.LogRecord) -> str:
        text = f"{_utc(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            text += " | " + self.formatException(record.exc_info)
        return _one_line(text)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the event's fields."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _utc(record),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        event = getattr(record, EVENT_ATTR, None)
        if isinstance(event, dict):
            line.update({k: v for k, v in event.items() if k not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        # default=str: an event field that is no JSON type must not lose the whole line
        return json.dumps(line, default=str, separators=(",", ":"))


def formatter_for(name: str | None) -> logging.Formatter | None:
    """The formatter a rank process uses under `serve` (`OMNI_CORE_LOG_FORMAT`); None elsewhere."""
    kind = {"json": JsonFormatter, "text": TextFormatter}.get(name or "")
    return kind() if kind is not None else None
