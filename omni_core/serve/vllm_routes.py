"""vLLM's dev-mode lifecycle routes (`vllm/entrypoints/serve/dev/{sleep,cache,rpc}`), as its
clients send them: parameters in the query string or in a JSON body, vLLM's defaults. They act
on `[server] default_stage`, or on every stage when it is not set."""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse, Response

from omni_core.integrations.extension import EXTENSION_METHODS
from omni_core.protocol import DiskSource
from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import (
    cache_reset_work,
    error_answer,
    lifecycle_route,
    lifecycle_work,
    not_awake,
    run_post,
    sleep_call,
    timeout_s,
    wake_call,
)
from omni_core.serve.middleware import require_key
from omni_core.serve.reports import report_json
from omni_core.serve.state import ServeState


def split_tags(values: list[str]) -> list[str] | None:
    tags = [t.strip() for v in values for t in v.split(",") if t.strip()]
    return tags or None


def once(field: str, in_query: Any, in_body: Any, default: Any) -> Any:
    """A vLLM route's parameter from its query string or its JSON body; both is ambiguous."""
    if in_query is not None and in_body is not None:
        raise ApiError(
            422,
            f"{field} is given both in the query string and in the JSON body; give it once",
            kind="InvalidArgumentError",
            extra={"fields": [f"query.{field}", f"body.{field}"]},
        )
    return in_query if in_query is not None else in_body if in_body is not None else default


def check_sleep_mode(mode: str) -> None:
    # keep: vLLM freezes running requests and recomputes them after the wake; an Execute
    # cannot be frozen on a rank, so it finishes first, as under wait (docs/http_routes.md).
    if mode not in ("abort", "wait", "keep"):
        raise ApiError(
            400,
            f"mode {mode[:40]!r} is not one of 'abort' (fail in-flight requests now, vLLM's "
            "default), 'wait' or 'keep' (they finish first)",
            kind="InvalidArgumentError",
            extra={"fields": ["mode"]},
        )


# Where collective_rpc reload_weights runs as a versioned update from disk: the stage serves
# (RUNNING drains first, PAUSED stays paused), as vLLM reloads a serving engine's weights.
SERVING_RELOAD_STATES = ("RUNNING", "PAUSED")


def level0_pause(state: ServeState, request: Request, mode: str, tags: list[str] | None) -> Any:
    """vLLM's /sleep?level=0: pause scheduling, release nothing. omni-core's pause; the stages
    are remembered so that /wake_up resumes them, as vLLM's wake resumes its scheduler."""
    if tags:
        raise ApiError(
            400,
            f"tags {tags} with level 0: a level-0 sleep pauses scheduling and releases nothing; send no "
            "tags, or level 1 or 2",
            kind="InvalidArgumentError",
            extra={"fields": ["tags"]},
        )
    engine, names = state.require_engine(), state.targets()

    def paused(per_stage: dict[str, Any]) -> dict[str, Any]:
        state.level0_paused.update(names)
        return {"status": "paused", "level": 0, "mode": mode, "stages": per_stage}

    def call(name: str, tid: str | None) -> Any:
        return functools.partial(engine.pause, name, mode, task_id=tid)

    return lifecycle_route(state, request, names, "pause", call, paused)


async def resume_level0(state: ServeState, request: Request, per_stage: dict[str, Any]) -> None:
    """After a /wake_up: resume the PAUSED stages a /sleep?level=0 paused (their report in
    `per_stage` becomes the resume's)."""
    engine = state.require_engine()
    tid = request.headers.get("idempotency-key")
    for name, report in per_stage.items():
        if name in state.level0_paused and report["state"] == "PAUSED":
            task_id = None if tid is None else f"{report['task_id']}/resume"
            resumed = await state.lifecycle(name, "resume", functools.partial(engine.resume, name, task_id=task_id))
            per_stage[name] = report_json(resumed)
        state.level0_paused.discard(name)


def reload_work(state: ServeState, request: Request, source: str | None, limit_s: float | None) -> Any:
    """collective_rpc reload_weights on each stage acted on: a stage that serves (RUNNING,
    PAUSED) takes `source` as a versioned update from disk (drained first when RUNNING, its
    version the next one: requests run on the old weights or the new, never a mix); one whose
    weights are discarded (NEEDS_RELOAD) reloads them, from `source` or the runner's own."""
    engine = state.require_engine()

    async def work() -> Answer:
        names = state.targets()
        try:
            status = await state.status()
        except Exception as exc:
            return error_answer(exc)
        serving = {name for name in names if status[name]["state"] in SERVING_RELOAD_STATES}
        if serving and source is None:
            first = sorted(serving)[0]
            refusal = ApiError(
                409,
                f"stage {first!r} is {status[first]['state']}: reload_weights on a serving stage runs as a "
                "versioned update and needs kwargs.source (a checkpoint directory under "
                "allowed_reload_sources); without one it reloads the runner's own weights, which omni-core "
                "does only after a level-2 sleep (NEEDS_RELOAD)",
                kind="InvalidStateError",
                extra={"stage": first, "state": status[first]["state"], "fields": ["kwargs.source"]},
            )
            return error_answer(refusal, first)

        def call(name: str, tid: str | None) -> Any:
            if name in serving and source is not None:  # a serving stage without one was refused above
                version = status[name]["weights_version"] + 1
                return functools.partial(
                    engine.update_weights,
                    name,
                    DiskSource(path=source),
                    version=version,
                    task_id=tid,
                    timeout_s=limit_s,
                )
            return functools.partial(engine.reload_weights, name, source, task_id=tid, timeout_s=limit_s)

        return await lifecycle_work(
            state, request, names, "reload", call, lambda per: {"results": list(per.values())}
        )()

    return work


# The extension methods verl's and OpenRLHF's clients call (omni_core.integrations'
# allowlist, run in-process by StageExtension), each with the route that does it over HTTP.
RPC_ROUTES = {
    "init_process_group": "POST /init_weights_update_group",
    "update_weight": "POST /update_weights_from_distributed",
    "update_weight_cuda_ipc": "POST /update_weights_from_ipc",
    "update_weights_from_ipc": "POST /update_weights_from_ipc",
    "reset_prefix_cache": "POST /reset_prefix_cache",
    "sleep": "POST /sleep",
    "wake_up": "POST /wake_up",
}


def rpc_refusal(method: str) -> ApiError:
    """collective_rpc over HTTP runs reload_weights only: any other name would run caller-named
    code on the ranks. An allowlisted extension method is named with its own route."""
    route = RPC_ROUTES.get(method)
    where = (
        f"send its arguments to {route} (the same typed command), or call it in-process through "
        "omni_core.integrations.StageExtension"
        if route is not None
        else f"omni-core's extension methods are {list(EXTENSION_METHODS)}, each typed and checked"
    )
    return ApiError(
        400,
        f"collective_rpc method {method[:80]!r} is not served over HTTP; only 'reload_weights' is (any other "
        f"would run caller-named code on the ranks): {where}",
        kind="InvalidArgumentError",
        extra={"fields": ["method"]},
    )


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)], tags=["vLLM"])

    def woken_shape(request: Request, names: list[str], tags: list[str] | None) -> Any:
        async def shape(per_stage: dict[str, Any]) -> Any:
            await resume_level0(state, request, per_stage)
            # RUNNING and PAUSED are the states with every tag resident and the weights valid.
            awake = all(r["state"] in ("RUNNING", "PAUSED") for r in per_stage.values())
            woken = tags or sorted({t for n in names for t in state.specs[n].tags})
            return {"status": "awake" if awake else "sleeping", "tags_woken": woken, "stages": per_stage}

        return shape

    @api.post(
        "/sleep",
        response_model=m.VllmSleepModel,
        responses=m.ERROR_RESPONSES,
        description="vLLM's dev-mode sleep on the default stage (or every stage): level, mode and tags in "
        "the query string (?level=2&mode=wait&tags=weights) or in a JSON body "
        '({"level": 2}), not both. mode: abort (vLLM\'s default: in-flight requests fail at '
        "once with 409), wait and keep (they finish first; see docs/http_routes.md).",
    )
    async def vllm_sleep(
        request: Request,
        body: m.VllmSleepBody | None = None,
        level: int | None = None,
        mode: str | None = None,
        tags: Annotated[list[str] | None, Query()] = None,
    ) -> Response:
        body = body or m.VllmSleepBody()
        chosen_level = once("level", level, body.level, 1)
        chosen_mode = once("mode", mode, body.mode, "abort")
        chosen_tags = once("tags", split_tags(tags or []), body.tags or None, None)
        check_sleep_mode(chosen_mode)
        if chosen_level == 0:
            return await level0_pause(state, request, chosen_mode, chosen_tags)
        return await lifecycle_route(
            state,
            request,
            state.targets(),
            "sleep",
            sleep_call(state, chosen_level, chosen_tags, chosen_mode == "abort"),
            lambda per: {"status": "sleeping", "level": chosen_level, "mode": chosen_mode, "stages": per},
            level=chosen_level,
        )

    @api.post(
        "/wake_up",
        response_model=m.VllmWakeModel,
        responses=m.ERROR_RESPONSES,
        description='vLLM\'s wake_up: ?tags=weights (repeatable, or comma-separated) or {"tags": '
        '["weights"]} wakes part of the memory; neither: every tag asleep',
    )
    async def vllm_wake(
        request: Request, body: m.VllmWakeBody | None = None, tags: Annotated[list[str] | None, Query()] = None
    ) -> Response:
        body = body or m.VllmWakeBody()
        chosen_tags = once("tags", split_tags(tags or []), body.tags or None, None)
        names = state.targets()
        return await lifecycle_route(
            state, request, names, "wake", wake_call(state, chosen_tags), woken_shape(request, names, chosen_tags)
        )

    @api.get(
        "/is_sleeping",
        response_model=m.IsSleepingModel,
        responses=m.ERROR_RESPONSES,
        description="true until every tag of the default stage (or of every stage) is back and its weights "
        "are valid: SLEEPING, PARTIAL, NEEDS_RELOAD and the transitions between them are asleep",
    )
    async def vllm_is_sleeping() -> Response:
        status = await state.status()
        return JSONResponse({"is_sleeping": any(not_awake(status[n]) for n in state.targets())})

    @api.post(
        "/reset_prefix_cache",
        response_model=m.CacheResetModel,
        responses=m.ERROR_RESPONSES,
        description="vLLM's prefix-cache reset on the default stage (or every stage), as the "
        "protocol's ResetPrefixCache: every rank's runner drops its cached prefixes (vLLM's own "
        "reset_prefix_cache), nothing is released or remapped and requests keep running. "
        "RUNNING, PAUSED or PARTIAL: another state is 409 naming it and what to do. "
        "reset_running_requests changes nothing (a rank resets between requests); "
        "reset_external: omni-core keeps no connector cache, so there is nothing more to reset.",
    )
    async def vllm_reset_prefix_cache(
        request: Request, reset_running_requests: bool = False, reset_external: bool = False
    ) -> Response:
        names = state.targets()
        work = cache_reset_work(
            state,
            request,
            names,
            lambda released, reset: {
                "success": True,
                "message": f"prefix cache reset on {names}: every rank's runner dropped its cache, no memory moved",
                "released": released,
                "stages": reset,
            },
            refused_status=409,
        )
        return await run_post(state, request, work)

    # TRL's pre-1.0 client posts it with a trailing slash (trl_routes.py).
    api.add_api_route("/reset_prefix_cache/", vllm_reset_prefix_cache, methods=["POST"], include_in_schema=False)

    @api.post(
        "/collective_rpc",
        response_model=m.CollectiveRpcModel,
        responses=m.ERROR_RESPONSES,
        description="Only method 'reload_weights' (kwargs: optional 'source', checked against "
        "allowed_reload_sources); any other method would run caller-named code on the "
        "ranks. On a serving stage (RUNNING drains first, PAUSED) it is a versioned update from "
        "the checkpoint directory `source` (required there); after a level-2 sleep a reload.",
    )
    async def vllm_collective_rpc(request: Request, body: m.CollectiveRpcBody) -> Response:
        if body.method != "reload_weights":
            raise rpc_refusal(body.method)
        unknown = sorted(set(body.kwargs) - {"source"})
        if body.args or unknown:
            raise ApiError(
                400,
                f"reload_weights takes only kwargs {{'source': ...}}; got args {body.args} and kwargs {unknown}",
                kind="InvalidArgumentError",
            )
        source = body.kwargs.get("source")
        if source is not None and not isinstance(source, str):
            raise ApiError(
                422,
                f"kwargs.source must be a path string, got a {type(source).__name__}",
                kind="InvalidArgumentError",
                extra={"fields": ["kwargs.source"]},
            )
        source = state.check_source(source)
        return await run_post(state, request, reload_work(state, request, source, timeout_s(body.timeout)))

    return api
