"""The operator's log of `omni-core serve`: one line per event, as text or as JSON
(the formats are in `omni_core.log_format`, which rank processes use too).

Every lifecycle call through the server, every failure (a call that failed, a stage that
became FAILED or STOPPED, the engine no longer answering) and every rank process that is gone
is one record of the `omni_core.serve` logger; uvicorn's own messages go to the same handler,
so `--log-json` gives one JSON object per line for all of them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import IO

from omni_core.log_format import EVENT_ATTR as EVENT_ATTR  # the serve modules tag their records with it
from omni_core.log_format import LOG_FORMAT_ENV, JsonFormatter, TextFormatter

LOGGERS = ("omni_core", "uvicorn")  # uvicorn.error propagates to uvicorn; the access log is off


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
