"""SGLang's memory routes (`entrypoints/http_server.py`): release and resume by tags, on
`[server] default_stage` or every stage; answers `{"success", "message"}`, on errors too."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.feed import dumps
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import cache_reset_work, lifecycle_route, run_post, sleep_call, wake_call
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState


def sglang_failed(error: Answer) -> Answer:
    """SGLang's error fields (`success: false`, `message`) beside omni-core's error."""
    body = json.loads(error.body)
    return Answer(error.status, dumps(dict(body, success=False, message=body["error"]["message"])), error.headers)


def sglang_shape(done: str, **extra: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda per_stage: {"success": True, "message": done, **extra, "stages": per_stage}


def refuse_cross_site(request: Request) -> None:
    """A GET that acts (SGLang's GET /flush_cache, which RL frameworks poll) passes no Origin
    check: the browser rules guard only state-changing methods. Every browser marks a request
    another site made it send (an image tag included) with Sec-Fetch-Site; such a GET is refused.
    Trainers' HTTP clients send no such header."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site not in ("same-origin", "none"):
        raise ApiError(
            403,
            f"GET {request.url.path} from a page of another site (Sec-Fetch-Site: {site[:40]}) is refused: a "
            "page must not act on this server; send POST from your own client",
            kind="CrossSiteRequest",
        )


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)], tags=["SGLang"])

    @api.post(
        "/release_memory_occupation",
        response_model=m.SglangMemoryModel,
        responses=m.ERROR_RESPONSES,
        description='SGLang\'s release on the default stage (or every stage): {"tags": ["kv_cache"]} '
        "or no body (every tag). In-flight requests finish first. level (omni-core's "
        "addition): 1 keeps the weights in host memory, 2 discards them. POST only: a GET "
        "that frees memory could be sent by any web page.",
    )
    async def sglang_release(request: Request, body: m.SglangReleaseBody | None = None) -> Response:
        body = body or m.SglangReleaseBody()
        names, tags = state.targets(), body.tags or None
        return await lifecycle_route(
            state,
            request,
            names,
            "sleep",
            sleep_call(state, body.level, tags),
            sglang_shape(f"released {tags or 'every tag'} of {names} (level {body.level})"),
            level=body.level,
            failed=sglang_failed,
        )

    @api.post(
        "/resume_memory_occupation",
        response_model=m.SglangMemoryModel,
        responses=m.ERROR_RESPONSES,
        description='SGLang\'s resume: {"tags": ["weights"]} or no body (every tag asleep)',
    )
    async def sglang_resume(request: Request, body: m.SglangMemoryBody | None = None) -> Response:
        body = body or m.SglangMemoryBody()
        names, tags = state.targets(), body.tags or None
        return await lifecycle_route(
            state,
            request,
            names,
            "wake",
            wake_call(state, tags),
            sglang_shape(f"resumed {tags or 'every tag asleep'} of {names}"),
            failed=sglang_failed,
        )

    @api.post(
        "/flush_cache",
        response_model=m.CacheResetModel,
        responses=m.ERROR_RESPONSES,
        description="SGLang's cache flush on the default stage (or every stage), as the protocol's "
        "ResetPrefixCache: every rank's runner drops what it caches across requests, nothing is "
        "released or remapped and requests keep running (the reset waits up to `timeout` seconds "
        "when it is above 0, else the stage's deadline). RUNNING, PAUSED or PARTIAL: another "
        "state is 400 (SGLang's failure code) naming it and what to do. GET too, as slime and "
        "verl poll it: a flush moves no memory and no state; a GET a browser marks cross-site "
        "(Sec-Fetch-Site) is refused.",
    )
    async def sglang_flush_cache(request: Request, timeout: Annotated[float, Query(ge=0.0)] = 0.0) -> Response:
        if request.method == "GET":
            refuse_cross_site(request)
        names = state.targets()
        work = cache_reset_work(
            state,
            request,
            names,
            lambda released, reset: {
                "success": True,
                # SGLang's answer starts so, and its clients look for it
                "message": f"Cache flushed.\nevery rank's runner dropped its cache on {names}, no memory moved.\n",
                "released": released,
                "stages": reset,
            },
            refused_status=400,
            limit_s=timeout or None,
            failed=sglang_failed,
        )
        return await run_post(state, request, work)

    # SGLang's GET, which slime and verl poll until it answers 200.
    api.add_api_route(
        "/flush_cache",
        sglang_flush_cache,
        methods=["GET"],
        response_model=m.CacheResetModel,
        responses=m.ERROR_RESPONSES,
        operation_id="sglang_flush_cache_get",
        description="As POST /flush_cache; a GET a browser marks cross-site (Sec-Fetch-Site) is 403.",
    )
    return api
