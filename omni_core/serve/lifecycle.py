"""The one path of every lifecycle route: omni-core's own and the anchors' alike.

A route parses its request, then hands `lifecycle_route` the stages it acts on, the command,
the engine call per stage and the shape of its answer. The call runs as a task of its own,
under the request's Idempotency-Key if it has one, on every stage at once; each outcome is
timed, counted and shown in the status feed (`ServeState.lifecycle`); the first error (in
config order) becomes the answer, with every stage's outcome beside it. A client that
disconnects never cancels a sleep halfway: the call runs to its end and a retry with the same
key gets its answer.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from omni_core.engine import LifecycleReport, RestartReport
from omni_core.engine.errors import InvalidArgumentError
from omni_core.serve.errors import ApiError, to_http
from omni_core.serve.feed import dumps
from omni_core.serve.idempotency import Answer, check_key, fingerprint, task_id_for
from omni_core.serve.reports import report_json
from omni_core.serve.state import ServeState

JSON = "application/json"

# (stage, task id or None) -> the blocking engine call for that stage
MakeCall = Callable[[str, str | None], Callable[[], Any]]
# the outcomes per stage (report_json of each report) -> the answer's JSON body
Shape = Callable[[dict[str, Any]], Any]


def answer(status: int, body: Any, headers: Iterable[tuple[str, str]] = ()) -> Answer:
    return Answer(status, dumps(body), tuple(headers))


def error_answer(exc: BaseException, stage: str | None = None) -> Answer:
    err = to_http(exc, stage=stage)
    return answer(err.status, err.body, err.headers.items())


def response(reply: Answer, replayed: bool = False) -> Response:
    headers = dict(reply.headers)
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return Response(reply.body, status_code=reply.status, headers=headers, media_type=JSON)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def route_label(request: Request) -> str:
    """The route's template (`/v1/stages/{name}/sleep`): a metric label from a closed set."""
    path = getattr(request.scope.get("route"), "path", None)
    return path if isinstance(path, str) else "unmatched"


async def run_post(state: ServeState, request: Request, work: Callable[[], Awaitable[Answer]]) -> Response:
    """Run a POST's work as a task of its own, under its Idempotency-Key if it has one, and
    answer it unless the client has gone (then only the metrics hear of it)."""
    key = request.headers.get("idempotency-key")
    if key is None:

        async def once() -> tuple[Answer, bool]:
            return await work(), False

        task: asyncio.Future = asyncio.ensure_future(once())
    else:
        check_key(key)
        body = await request.body()
        fp = fingerprint(request.method, request.url.path, request.url.query, body)
        described = f"{request.method} {request.url.path}" + (f"?{request.url.query}" if request.url.query else "")
        task = asyncio.ensure_future(state.idempotency.run(key, fp, described, work))
    gone = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        state.metrics.http_disconnects.labels(route_label(request)).inc()
        # The work goes on to its end; its outcome is counted and kept under its key.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    error = task.exception()
    if error is not None:
        return response(error_answer(error))
    reply, replayed = task.result()
    if replayed:
        state.metrics.idempotent_replays.inc()
    return response(reply, replayed)


def lifecycle_tid(request: Request) -> str | None:
    """The task id a lifecycle call runs under: derived from the Idempotency-Key, so a retry
    after a lost answer is the same task to the engine."""
    key = request.headers.get("idempotency-key")
    return task_id_for(check_key(key)) if key is not None else None


def timeout_s(value: float | None) -> float | None:
    if value is not None and not (0 < value <= 24 * 3600):
        raise InvalidArgumentError(f"timeout_s must be a positive number of seconds up to 86400, got {value!r}")
    return value


async def on_stages(
    state: ServeState,
    names: list[str],
    command: str,
    call: Callable[[str], Callable[[], Any]],
    level: int | None = None,
    *,
    stages_in_error: bool = True,
) -> tuple[dict[str, Any], Answer | None]:
    """Run one lifecycle command on several stages at once. Returns each stage's outcome
    (its report's JSON, or its error body) and, if any failed, the answer: the first error in
    config order, with every stage's outcome beside it under `stages`."""
    outcomes = await asyncio.gather(
        *(state.lifecycle(n, command, call(n), level=level) for n in names), return_exceptions=True
    )
    per_stage: dict[str, Any] = {}
    first_error: tuple[int, tuple[tuple[str, str], ...], dict[str, Any]] | None = None
    for name, outcome in zip(names, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            err = to_http(outcome, stage=name)
            per_stage[name] = err.body
            if first_error is None:
                first_error = (err.status, tuple(err.headers.items()), err.body)
        else:
            if isinstance(outcome, LifecycleReport):
                per_stage[name] = report_json(outcome)
            else:
                per_stage[name] = outcome.to_dict() if isinstance(outcome, RestartReport) else None
    if first_error is None:
        return per_stage, None
    status, headers, body = first_error
    return per_stage, answer(status, dict(body, stages=per_stage) if stages_in_error else body, headers)


def lifecycle_work(
    state: ServeState,
    request: Request,
    names: list[str],
    command: str,
    call: MakeCall,
    shape: Callable[[dict[str, Any]], Any | Awaitable[Any]],
    *,
    level: int | None = None,
    failed: Callable[[Answer], Answer] | None = None,
    stages_in_error: bool = True,
) -> Callable[[], Awaitable[Answer]]:
    """The work of a lifecycle route: `command` on each of `names` at once, answered with
    `shape` of the outcomes (which may await, as a restart's reads the new epoch), or with
    the first error passed through `failed` (an anchor's own error fields)."""
    tid = lifecycle_tid(request)

    async def work() -> Answer:
        per_stage, error = await on_stages(
            state, names, command, lambda n: call(n, tid), level, stages_in_error=stages_in_error
        )
        if error is None:
            try:
                body = shape(per_stage)
                if inspect.isawaitable(body):
                    body = await body
            except Exception as exc:
                error = error_answer(exc, names[0] if len(names) == 1 else None)
            else:
                return answer(200, body)
        return failed(error) if failed is not None else error

    return work


async def lifecycle_route(state: ServeState, request: Request, *args: Any, **kwargs: Any) -> Response:
    """A lifecycle route's whole answer: `lifecycle_work(state, request, *args, **kwargs)` run
    by `run_post`."""
    return await run_post(state, request, lifecycle_work(state, request, *args, **kwargs))


async def stage_route(
    state: ServeState,
    request: Request,
    name: str,
    command: str,
    call: Callable[..., Any],
    level: int | None = None,
) -> Response:
    """omni-core's lifecycle routes act on the stage in the path and answer its report, or its
    error alone (no list of stages beside it); `call(name, task_id=...)` is the engine's call."""
    return await lifecycle_route(
        state,
        request,
        [name],
        command,
        lambda n, tid: functools.partial(call, n, task_id=tid),
        lambda per_stage: per_stage[name],
        level=level,
        stages_in_error=False,
    )


# ---------------------------------------------------------------------- what the routes share


def sleep_call(state: ServeState, level: int, tags: list[str] | None, abort_in_flight: bool = False) -> MakeCall:
    engine = state.require_engine()
    return lambda n, tid: functools.partial(engine.sleep, n, level, tags, task_id=tid, abort_in_flight=abort_in_flight)


def wake_call(state: ServeState, tags: list[str] | None) -> MakeCall:
    engine = state.require_engine()
    return lambda n, tid: functools.partial(engine.wake, n, tags, task_id=tid)


# A stage in these states has memory released, or is releasing or restoring it: vLLM's
# is_sleeping stays true until every tag is back and the weights are valid again.
NOT_AWAKE_STATES = frozenset({"DRAINING", "TRANSITIONING", "SLEEPING", "WAKING", "PARTIAL", "NEEDS_RELOAD"})


def not_awake(stage_status: dict[str, Any]) -> bool:
    """Whether a stage (as Engine.status gives it) has anything asleep, or invalid weights."""
    return (
        stage_status.get("state") in NOT_AWAKE_STATES
        or bool(stage_status.get("asleep_tags"))
        or stage_status.get("weights_valid") is False
    )


# ---------------------------------------------------------------------- a prefix-cache reset

# Where the stage table's row for ResetPrefixCache takes it: the ranks' caches are resident.
CACHE_RESET_STATES = ("RUNNING", "PAUSED", "PARTIAL")
CACHE_RESET_STEPS = {
    "FAILED": "restart it (POST /v1/stages/{name}/restart)",
    "STOPPED": "restart it (POST /v1/stages/{name}/restart)",
    "STARTING": "wait until it is RUNNING",
    "DRAINING": "another lifecycle call is in flight; retry once it is RUNNING",
    "TRANSITIONING": "another lifecycle call is in flight; retry once it is RUNNING",
    "WAKING": "another lifecycle call is in flight; retry once it is RUNNING",
    "NEEDS_RELOAD": "reload its weights (POST /collective_rpc reload_weights), then retry",
}
CACHE_RESET_WAKE = "wake it (POST /wake_up, or POST /resume_memory_occupation), then retry"


def cache_reset_work(
    state: ServeState,
    request: Request,
    names: list[str],
    shape: Callable[[dict[str, Any], dict[str, Any]], Any],
    *,
    refused_status: int,
    limit_s: float | None = None,
    failed: Callable[[Answer], Answer] | None = None,
) -> Callable[[], Awaitable[Answer]]:
    """The anchors' prefix-cache resets as the protocol's own command (`ResetPrefixCache`):
    every rank's runner drops what it caches across requests; nothing is released or
    remapped, and requests keep running. A stage in a state whose row refuses it is refused
    with `refused_status`, naming its state and what to do, before anything is sent.
    `shape(released, reset)` is the answer: `released` is empty (no memory is), `reset` each
    stage's report."""
    engine, tid = state.require_engine(), lifecycle_tid(request)
    fail = failed or (lambda error: error)
    task_id = None if tid is None else f"{tid}/reset_prefix_cache"

    def call(name: str) -> Callable[[], Any]:
        return functools.partial(engine.reset_prefix_cache, name, task_id=task_id, timeout_s=limit_s)

    async def work() -> Answer:
        try:
            status = await state.status()
        except Exception as exc:
            return fail(error_answer(exc))
        for name in names:
            now = status[name]["state"]
            if now not in CACHE_RESET_STATES:
                what = CACHE_RESET_STEPS.get(now, CACHE_RESET_WAKE).replace("{name}", name)
                refusal = ApiError(
                    refused_status,
                    f"stage {name!r} is {now}, not RUNNING: its prefix cache is reset only where its "
                    f"caches are resident (RUNNING, PAUSED or PARTIAL); {what}",
                    kind="InvalidStateError",
                    extra={"stage": name, "state": now},
                )
                return fail(error_answer(refusal))
        reset, error = await on_stages(state, names, "reset_prefix_cache", call)
        if error is not None:
            return fail(error)
        return answer(200, shape({}, reset))

    return work
