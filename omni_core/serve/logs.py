"""The operator's log of `omni-core serve`: one line per event, as text or as JSON.

Every lifecycle call through the server, every failure (a call that failed, a stage that
became FAILED or STOPPED, the engine no longer answering) and every rank process that is gone
is one record of the `omni_core.serve` logger; uvicorn's own messages go to the same handler,
so `--log-json` gives one JSON object per line for all of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import IO, Any

LOGGERS = ("omni_core", "uvicorn")  # uvicorn.error propagates to uvicorn; the access log is off
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


@contextlib.contextmanager
def configured(*, json_lines: bool = False, level: str = "info", stream: IO[str] | None = None) -> Iterator[None]:
    """omni-core's and uvicorn's loggers sent to one handler on `stream` (stderr) at `level`,
    and put back as they were afterwards (serve may run inside a test or another program)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if json_lines else TextFormatter())
    saved = []
    env_before = os.environ.get(LOG_FORMAT_ENV)
    os.environ[LOG_FORMAT_ENV] = "json" if json_lines else "text"
    for name in LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level, logger.propagate))
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False
    try:
        yield
    finally:
        for logger, old_level, old_propagate in saved:
            logger.removeHandler(handler)
            logger.setLevel(old_level)
            logger.propagate = old_propagate
        if env_before is None:
            os.environ.pop(LOG_FORMAT_ENV, None)
        else:
            os.environ[LOG_FORMAT_ENV] = env_before
