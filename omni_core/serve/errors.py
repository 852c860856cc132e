"""How the engine's exceptions become HTTP answers: one table, one JSON shape.

The engine raises a handful of exception types whose message already says what went wrong
and what to do; the HTTP answer keeps that text unchanged (`error.message`) and adds a
status code a client can branch on without parsing it. Some types cover several causes
(`InvalidArgumentError` is a bad argument, an unknown stage or a state conflict), so the
cause is told apart by the engine's own wording; `tests/serve/test_errors.py` provokes each
cause on a real engine, so a reworded message fails a test instead of changing a code.

- 400: a bad argument (level, tags, timeout, body fields); a reload source every rank
  refused; a request payload the runner raised on (EXECUTE_ERROR)
- 401: no or wrong API key (when the server has one)
- 403: a reload `source` outside the config's `allowed_reload_sources`
- 404: unknown stage, or a stage id out of range
- 409: state conflict: the stage's state forbids the command, another task is in flight,
  an Idempotency-Key reused for another request, a request refused by admission `reject`
  or by NEEDS_RELOAD, a request aborted by a sleep with `abort_in_flight` / `mode=abort`
- 413: request body larger than `max_body_bytes`
- 429: queue full (`queue_limit`): retry later (`Retry-After`)
- 503: stage FAILED (restart it), including a lifecycle command whose ranks stayed silent
  past its deadline; engine shut down; engine overloaded (socket queue full)
- 504: a deadline passed: in-flight requests did not drain before a sleep's deadline
  (nothing was sent; the stage stays RUNNING), a request got no result in time, a queued
  request waited until its deadline, the orchestrator did not answer
- 500: anything else: a bug; the message says so
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    OmniCoreError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    TaskAbandonedError,
)

RETRY_AFTER_S = 1  # what a 429 or an overloaded 503 tells the client to wait


class ApiError(Exception):
    """An error the HTTP layer raises itself (auth, body size, idempotency, access)."""

    def __init__(self, status: int, message: str, *, kind: str = "ApiError", headers: dict[str, str] | None = None,
                 extra: dict[str, Any] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})


@dataclass(frozen=True)
class HttpError:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def _status_for(exc: BaseException) -> int:
    message = str(exc)
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, InvalidArgumentError):
        if "unknown stage" in message:
            return 404
        if "is FAILED" in message:  # a lifecycle command to a failed stage: restart it first
            return 503
        if "refused the reload" in message:  # every rank said INVALID_ARGUMENT: nothing was written
            return 400
        if any(needle in message for needle in ("must be", "unknown tag", "is not one of", "tags must")):
            return 400
        return 409  # the state forbids it, a task is in flight, a task_id reused for another command
    if isinstance(exc, RequestRejectedError):
        if "queue is full" in message or "queue_limit" in message:
            return 429
        if "until its deadline" in message:
            return 504
        if "FAILED" in message or "restart" in message or "STOPPED" in message:
            return 503
        return 409  # admission 'reject', NEEDS_RELOAD
    if isinstance(exc, RequestFailedError):
        if "before its deadline" in message:
            return 504
        if "overloaded" in message:
            return 503
        if "aborted" in message:
            return 409
        if "EXECUTE_ERROR" in message or "INVALID_ARGUMENT" in message:
            return 400
        if "FAILED" in message:
            return 503
        return 409
    if isinstance(exc, StageFailedError):
        return 503
    if isinstance(exc, TaskAbandonedError):
        return 504 if "within" in message else 409
    if isinstance(exc, EngineClosedError):
        return 503
    if isinstance(exc, OmniCoreError):  # the API's own wait ran out: the orchestrator is stuck
        return 504
    return 500


def to_http(exc: BaseException, *, stage: str | None = None) -> HttpError:
    """The status, JSON body and headers for an exception; the message text is the engine's."""
    status = _status_for(exc)
    kind = exc.kind if isinstance(exc, ApiError) else type(exc).__name__
    message = str(exc) if status != 500 else (
        f"internal error ({type(exc).__name__}: {exc}); this is a bug in omni-core serve, please report it")
    error: dict[str, Any] = {"code": status, "type": kind, "message": message}
    if stage is not None:
        error["stage"] = stage
    if isinstance(exc, StageFailedError):
        error["stage"] = exc.stage
        error["failures"] = {str(rank): why for rank, why in exc.failures.items()}
    headers: dict[str, str] = {}
    if isinstance(exc, ApiError):
        error.update(exc.extra)
        headers.update(exc.headers)
    if status == 429 or (status == 503 and "overloaded" in message):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return HttpError(status, {"error": error}, headers)


def outcome_label(status: int) -> str:
    """The `outcome` label of request and lifecycle metrics for an HTTP status."""
    return {200: "ok", 400: "invalid", 403: "forbidden", 404: "unknown_stage", 409: "conflict", 429: "rejected",
            503: "failed", 504: "deadline"}.get(status, "error")  # fmt: skip
