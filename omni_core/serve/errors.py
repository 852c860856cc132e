"""How the engine's exceptions become HTTP answers: one table, one JSON shape.

The engine raises a handful of exception types whose message already says what went wrong
and what to do; the HTTP answer keeps that text unchanged (`error.message`) and adds a
status code a client can branch on without parsing it. Some types cover several causes
(`InvalidArgumentError` is a bad argument, an unknown stage or a state conflict), so the
cause is told apart by the engine's own wording; `tests/serve/test_errors.py` provokes each
cause on a real engine, so a reworded message fails a test instead of changing a code.

- 400: a bad argument (level, tags, timeout); a body that is not JSON; a reload or update
  source every rank refused (nothing written, the version unchanged), or one no file path
  can hold (NUL); a request payload the runner raised on (EXECUTE_ERROR)
- 401: no or wrong API key (when the server has one)
- 403: a reload `source` outside the config's `allowed_reload_sources`; a foreign Host or
  Origin header (cross-site request, DNS rebinding)
- 404: unknown stage, or a stage id out of range
- 409: state conflict: the stage's state forbids the command, another task is in flight,
  a weights version not above the stage's (both named), an Idempotency-Key reused for
  another request, a request refused by admission `reject`
  or by NEEDS_RELOAD, a request aborted by a sleep with `abort_in_flight` / `mode=abort`
- 413: request body larger than `max_body_bytes`; a request that encodes over the stage's
  `max_frame_bytes`
- 415: a state-changing request whose body is not `application/json`
- 422: a field of the wrong JSON type (nothing is converted), unknown, missing, or holding a
  value the protocol cannot carry (an integer beyond 64 bits, a lone surrogate, deep nesting)
- 429: queue full (`queue_limit`): retry later (`Retry-After`)
- 503: stage FAILED (restart it), including a lifecycle command whose ranks stayed silent
  past its deadline; engine shut down; engine overloaded (socket queue full); too little free
  device memory for a wake in time (`NoMemoryError`: the stage is where it was, `refusals`
  names who holds the device; retry once that memory is freed); a weight update every rank
  failed once writing began (`WeightUpdateFailedError`: `state` NEEDS_RELOAD at
  `weights_version`, the version it held; `failures` per rank; update again or reload)
- a swap that did not complete (`SwapFailedError`): the code of the half that failed (the
  incoming one's when both did), the body carries both halves (`outgoing`, `incoming`), each
  its report or its error, so both stages' states are in the answer
- 504: a deadline passed: in-flight requests did not drain before a sleep's deadline
  (nothing was sent; the stage stays RUNNING), a request got no result in time, a queued
  request waited until its deadline, the orchestrator did not answer
- 500: anything else: a bug; the message says so
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omni_core.engine import LifecycleReport
from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    NoMemoryError,
    OmniCoreError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    SwapFailedError,
    TaskAbandonedError,
    WeightUpdateFailedError,
)
from omni_core.serve.reports import report_json

RETRY_AFTER_S = 1  # what a 429 or an overloaded 503 tells the client to wait


class ApiError(Exception):
    """An error the HTTP layer raises itself (auth, body size, idempotency, access)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "ApiError",
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
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
        if "max_frame_bytes" in message:  # the request is too large for the wire: nothing was sent
            return 413
        if "is FAILED" in message:  # a lifecycle command to a failed stage: restart it first
            return 503
        if "refused the reload" in message or "refused the update" in message:
            return 400  # every rank said INVALID_ARGUMENT: nothing was written
        if "SaveWeights refused by ranks" in message:
            return 400  # the directory exists, is not usable, or the runner cannot save: nothing written
        if any(
            needle in message
            for needle in (
                "must be",
                "unknown tag",
                "is not one of",
                "tags must",
                "needs two stages",
                "is not in allowed_weight_group_hosts",
            )
        ):
            return 400
        return 409  # the state forbids it, a task is in flight, a task_id reused for another command
    if isinstance(exc, RequestRejectedError):
        if "queue is full" in message or "queue_limit" in message:
            return 429
        if "until its deadline" in message:
            return 504
        if "is NEEDS_RELOAD" in message:  # the caller's to fix (reload, update), even naming a restart
            return 409
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
    if isinstance(exc, WeightUpdateFailedError):  # NEEDS_RELOAD at its old version: update again or reload
        return 503
    if isinstance(exc, NoMemoryError):  # the memory is someone else's for now; nothing changed here
        return 503
    if isinstance(exc, SwapFailedError):
        return _status_for(_failed_half(exc))
    if isinstance(exc, TaskAbandonedError):
        return 504 if "within" in message else 409
    if isinstance(exc, EngineClosedError):
        return 503
    if isinstance(exc, OmniCoreError):  # the API's own wait ran out: the orchestrator is stuck
        return 504
    return 500


def _failed_half(exc: SwapFailedError) -> BaseException:
    """The half whose error a failed swap answers with: the incoming one's when both failed
    (a swap is for the incoming stage), else whichever failed."""
    for half in (exc.incoming, exc.outgoing):
        if isinstance(half, BaseException):
            return half
    return OmniCoreError(str(exc))  # both reported, yet failed: our own bug, answered as such (504)


def _half_json(stage: str, half: object) -> dict[str, Any] | None:
    if isinstance(half, LifecycleReport):
        return {"stage": stage, "report": report_json(half)}
    if isinstance(half, BaseException):
        return {"stage": stage, "error": to_http(half, stage=stage).body["error"]}
    return None  # that half never started


def to_http(exc: BaseException, *, stage: str | None = None) -> HttpError:
    """The status, JSON body and headers for an exception; the message text is the engine's."""
    status = _status_for(exc)
    kind = exc.kind if isinstance(exc, ApiError) else type(exc).__name__
    message = (
        str(exc)
        if status != 500
        else (f"internal error ({type(exc).__name__}: {exc}); this is a bug in omni-core serve, please report it")
    )
    error: dict[str, Any] = {"code": status, "type": kind, "message": message}
    if stage is not None:
        error["stage"] = stage
    if isinstance(exc, StageFailedError):
        error["stage"] = exc.stage
        error["failures"] = {str(rank): why for rank, why in exc.failures.items()}
    if isinstance(exc, WeightUpdateFailedError):
        error.update(
            stage=exc.stage,
            state="NEEDS_RELOAD",
            weights_version=exc.version,
            failures={str(rank): why for rank, why in exc.failures.items()},
        )
    if isinstance(exc, NoMemoryError):
        error["stage"] = exc.stage
        error["refusals"] = {str(rank): why for rank, why in exc.refusals.items()}
    if isinstance(exc, SwapFailedError):
        error.pop("stage", None)  # two stages: each half names its own
        error["outgoing"] = _half_json(exc.out_stage, exc.outgoing)
        error["incoming"] = _half_json(exc.in_stage, exc.incoming)
    headers: dict[str, str] = {}
    if isinstance(exc, ApiError):
        error.update(exc.extra)
        headers.update(exc.headers)
    if status == 429 or (status == 503 and "overloaded" in message):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return HttpError(status, {"error": error}, headers)


def outcome_label(status: int) -> str:
    """The `outcome` label of request and lifecycle metrics for an HTTP status."""
    return {
        200: "ok",
        400: "invalid",
        403: "forbidden",
        404: "unknown_stage",
        409: "conflict",
        429: "rejected",
        503: "failed",
        504: "deadline",
    }.get(status, "error")
