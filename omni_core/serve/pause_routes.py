"""The PAUSED lifecycle over HTTP: vLLM's /pause, /resume and /is_paused, and omni-core's own
/v1/stages/{name}/pause and /resume (the CLI's).

vLLM's routes (vllm/entrypoints/serve/dev/rlhf/api_router.py) take `mode` (abort, its
default; wait; keep), the deprecated `wait_for_inflight_requests` (true means mode=wait)
and `clear_cache` in the query string; omni-core also takes them in a JSON body, not both.
They answer {"status": "paused"} and {"status": "resumed"} (with every stage's report beside
it) and {"is_paused": bool}. What each mode does: omni_core/fsm/stage_pause.py (its modes) and
StageCore._pause in omni_core/fsm/stage.py.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from omni_core.serve import models as m
from omni_core.serve.lifecycle import NOT_AWAKE_STATES, MakeCall, lifecycle_route, stage_route, timeout_s
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState
from omni_core.serve.vllm_routes import once

PauseMode = Literal["abort", "wait", "keep"]
# vLLM's scheduler is paused by a pause and by a sleep (its wake resumes it): /is_paused is
# true while admission is closed by either, as it is there.
PAUSED_STATES = NOT_AWAKE_STATES | {"PAUSED"}


class VllmPauseBody(m._Strict):
    """vLLM's POST /pause, as a JSON body; the same fields as its query string."""

    mode: PauseMode | None = Field(
        None,
        description="abort (in-flight requests fail now), wait (they finish first) or keep (they are frozen "
        "where they are, their KV kept, and go on after /resume, on the weights updated meanwhile); null: abort",
    )
    wait_for_inflight_requests: bool | None = Field(None, description="vLLM's deprecated flag: true means mode=wait")
    clear_cache: bool | None = Field(
        None,
        description="with mode=keep: the frozen requests' KV is dropped instead, each restarts from its prompt "
        "at /resume; with abort or wait accepted, and nothing is cleared",
    )


class PauseBody(m._Strict):
    mode: PauseMode = Field(
        "wait",
        description="wait (in-flight requests finish), keep (they are frozen until resume), abort (they fail now)",
    )
    clear_cache: bool = Field(False, description="with keep: drop the frozen requests' KV (each restarts at resume)")
    timeout_s: float | None = Field(None, description="how long in-flight requests may take; null: deadline_s")


class ResumeBody(m._Strict):
    timeout_s: float | None = Field(None, description="how long to wait for the answer; null: deadline_s")


class VllmPausedModel(BaseModel):
    status: str = Field(description="paused, or resumed")
    stages: dict[str, m.LifecycleReportModel]


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])

    def paused_shape(status: str) -> Callable[[dict[str, Any]], Any]:
        return lambda per_stage: {"status": status, "stages": per_stage}

    def pause_call(mode: str, clear_cache: bool) -> MakeCall:
        engine = state.require_engine()
        return lambda n, tid: functools.partial(engine.pause, n, mode, task_id=tid, clear_cache=clear_cache)

    def resume_call() -> MakeCall:
        engine = state.require_engine()
        return lambda n, tid: functools.partial(engine.resume, n, task_id=tid)

    @api.post(
        "/pause",
        response_model=VllmPausedModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's pause on the default stage (or every stage): admission closes, memory stays, no "
        "request starts until POST /resume. mode=abort (default): in-flight requests fail at once "
        "(409); wait: they finish first; keep: they are frozen where they are on every rank (a runner that "
        "cannot freeze finishes them first), and resume on the weights an update brought meanwhile, each "
        "answer naming its version spans. Answers once none is in flight or every rank holds them.",
    )
    async def vllm_pause(
        request: Request,
        body: VllmPauseBody | None = None,
        mode: PauseMode | None = None,
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool | None = None,
    ) -> Response:
        body = body or VllmPauseBody()
        chosen = once("mode", mode, body.mode, "abort")
        clear = once("clear_cache", clear_cache, body.clear_cache, None)
        if once("wait_for_inflight_requests", wait_for_inflight_requests, body.wait_for_inflight_requests, False):
            chosen = "wait"  # as vLLM: the deprecated flag wins over mode
        state.level0_paused.difference_update(state.targets())  # this pause ends with /resume, not a wake
        return await lifecycle_route(
            state,
            request,
            state.targets(),
            "pause",
            pause_call(chosen, chosen == "keep" and bool(clear)),
            paused_shape("paused"),
        )

    @api.post(
        "/resume",
        response_model=VllmPausedModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's resume on the default stage (or every stage): a PAUSED stage serves again, its "
        "held requests first; a RUNNING one is ALREADY. A sleeping stage is 409: wake it (POST /wake_up).",
    )
    async def vllm_resume(request: Request) -> Response:
        state.level0_paused.difference_update(state.targets())
        return await lifecycle_route(state, request, state.targets(), "resume", resume_call(), paused_shape("resumed"))

    @api.get(
        "/is_paused",
        response_model=m.IsPausedModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="true while the default stage (or any stage) admits no request because of a pause or a "
        "sleep (vLLM's scheduler is paused by both)",
    )
    async def vllm_is_paused() -> Response:
        status = await state.status()
        return JSONResponse({"is_paused": any(status[n]["state"] in PAUSED_STATES for n in state.targets())})

    @api.post(
        "/v1/stages/{name}/pause",
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Close the stage's admission keeping its memory (state PAUSED once no request is in "
        "flight, or every rank holds them under keep); mode as vLLM's. With an Idempotency-Key, a retry gets "
        "the first answer.",
    )
    async def pause(name: str, request: Request, body: PauseBody | None = None) -> Response:
        body = body or PauseBody()
        state.stage_name(name)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        return await stage_route(
            state,
            request,
            name,
            "pause",
            functools.partial(engine.pause, mode=body.mode, timeout_s=limit_s, clear_cache=body.clear_cache),
        )

    @api.post(
        "/v1/stages/{name}/resume",
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Open a PAUSED stage's admission again (ALREADY when RUNNING)",
    )
    async def resume(name: str, request: Request, body: ResumeBody | None = None) -> Response:
        state.stage_name(name)
        limit_s = timeout_s((body or ResumeBody()).timeout_s)
        return await stage_route(
            state, request, name, "resume", functools.partial(state.require_engine().resume, timeout_s=limit_s)
        )

    return api
