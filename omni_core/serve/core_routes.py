"""omni-core's own routes: the status page, /health, /metrics, and the /v1 API (stages, the
status feed, the lifecycle calls, requests)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from omni_core.engine.api import WAIT_GRACE_S
from omni_core.engine.errors import OmniCoreError
from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.errors import outcome_label as _outcome
from omni_core.serve.feed import UNHEALTHY_STATES, dumps
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import (
    JSON,
    answer,
    error_answer,
    lifecycle_route,
    lifecycle_tid,
    run_post,
    stage_route,
    timeout_s,
)
from omni_core.serve.middleware import require_key
from omni_core.serve.page import STATUS_PAGE_CSP, STATUS_PAGE_HTML
from omni_core.serve.reports import swap_json
from omni_core.serve.state import STATUS_CALL_TIMEOUT_S, ServeState
from omni_core.serve.strict import check_wire_value

SSE_KEEPALIVE_S = 15.0  # proxies close idle streams; a comment line keeps them open
SSE_QUEUE_MESSAGES = 256  # a subscriber this far behind is dropped (it reconnects and gets a fresh snapshot)
MAX_REASON_CHARS = 500  # a failure reason quoted in /health; the full text is in GET /v1/stages/{name}


def router(state: ServeState) -> APIRouter:
    api = APIRouter()
    control = [Depends(require_key)]
    health_deps = [] if state.server.public_health else control
    metrics_deps = [] if state.server.public_metrics else control
    feed = state.feed

    # ------------------------------------------------------------------ public

    @api.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(
            STATUS_PAGE_HTML, headers={"Cache-Control": "no-store", "Content-Security-Policy": STATUS_PAGE_CSP}
        )

    @api.get(
        "/health",
        dependencies=health_deps,
        response_model=m.HealthModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def health() -> Response:
        try:
            status = await state.status()
        except asyncio.TimeoutError:
            raise ApiError(
                503,
                f"the engine did not answer a status call within {STATUS_CALL_TIMEOUT_S} s",
                kind="EngineUnresponsive",
            ) from None
        states = {name: status[name]["state"] for name in state.names if name in status}
        failed = [name for name, st in states.items() if st in UNHEALTHY_STATES]
        if not failed:
            return JSONResponse({"status": "ok", "stages": states, "failed": []})
        first = failed[0]
        why = str(status[first].get("failure") or "no reason recorded")[:MAX_REASON_CHARS]
        also = f"; also FAILED or STOPPED: {failed[1:]}" if len(failed) > 1 else ""
        error = {
            "code": 503,
            "type": "StageFailed",
            "stage": first,
            "message": f"stage {first!r} is {states[first]} ({why}); restart it: POST /v1/stages/{first}/restart{also}",
        }
        return JSONResponse({"status": "failed", "stages": states, "failed": failed, "error": error}, status_code=503)

    # TRL's pre-1.0 client asks with a trailing slash (trl_routes.py).
    api.add_api_route("/health/", health, methods=["GET"], dependencies=health_deps, include_in_schema=False)

    @api.get(
        "/metrics",
        dependencies=metrics_deps,
        include_in_schema=True,
        tags=["omni-core"],
        response_class=Response,
        responses={200: {"content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    # ------------------------------------------------------------------ omni-core's own API

    @api.get(
        "/v1/stages",
        dependencies=control,
        response_model=m.StagesModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def list_stages() -> Response:
        snap = feed.build_snapshot(await state.status())
        return JSONResponse({"stages": list(snap["stages"].values())})

    @api.get(
        "/v1/stages/{name}",
        dependencies=control,
        response_model=m.StageModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def get_stage(name: str) -> Response:
        state.stage_name(name)
        status = await state.status()
        return JSONResponse(feed.stage_view(state.names.index(name), name, status.get(name)))

    @api.get(
        "/v1/status",
        dependencies=control,
        tags=["omni-core"],
        description="The status page's data: every stage, rank memory, recent lifecycle events",
    )
    async def status_snapshot() -> Response:
        return Response(dumps(await feed.refresh()), media_type=JSON)

    @api.get(
        "/v1/events",
        dependencies=control,
        tags=["omni-core"],
        response_class=StreamingResponse,
        description="Server-sent events: `status` (a snapshot like GET /v1/status) and `lifecycle` (one "
        "call's outcome). The first message is a snapshot.",
    )
    async def events() -> StreamingResponse:
        queue: asyncio.Queue = asyncio.Queue(maxsize=SSE_QUEUE_MESSAGES)
        feed.subscribers.add(queue)

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield b"retry: 1000\nevent: status\ndata: " + dumps(feed.snapshot) + b"\n\n"
                while not feed.closing.is_set():
                    try:
                        kind, data = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    if kind is None:
                        return
                    yield f"event: {kind}\ndata: ".encode() + dumps(data) + b"\n\n"
            finally:
                feed.subscribers.discard(queue)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )

    @api.post(
        "/v1/stages/{name}/sleep",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def sleep(name: str, request: Request, body: m.SleepBody | None = None) -> Response:
        body = body or m.SleepBody()
        state.stage_name(name)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        call = functools.partial(
            engine.sleep, level=body.level, tags=body.tags, timeout_s=limit_s, abort_in_flight=body.abort_in_flight
        )
        return await stage_route(state, request, name, "sleep", call, body.level)

    @api.post(
        "/v1/stages/{name}/wake",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def wake(name: str, request: Request, body: m.WakeBody | None = None) -> Response:
        body = body or m.WakeBody()
        state.stage_name(name)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        return await stage_route(
            state, request, name, "wake", functools.partial(engine.wake, tags=body.tags, timeout_s=limit_s)
        )

    @api.post(
        "/v1/stages/{name}/reload",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def reload(name: str, request: Request, body: m.ReloadBody | None = None) -> Response:
        body = body or m.ReloadBody()
        state.stage_name(name)
        source = state.check_source(body.source)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        call = functools.partial(engine.reload_weights, source=source, timeout_s=limit_s)
        return await stage_route(state, request, name, "reload", call)

    @api.post(
        "/v1/stages/{name}/update_weights",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Replace the stage's weights with `source` as weights `version` (P-17), in any state "
        "with the weights resident; RUNNING drains first. A version not above the stage's is "
        "409 naming both; a bad source 422 (its field) or 400 (the ranks refused it, nothing "
        "written); a failed update 503 with the stage NEEDS_RELOAD at its old version. With an "
        "Idempotency-Key, a retry gets the first answer.",
    )
    async def update_weights(name: str, request: Request, body: m.UpdateWeightsBody) -> Response:
        state.stage_name(name)
        source = state.weight_source(body.source)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        call = functools.partial(engine.update_weights, source=source, version=body.version, timeout_s=limit_s)
        return await stage_route(state, request, name, "update", call)

    @api.post(
        "/v1/stages/{name}/save_weights",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Every rank writes the weights it holds, at the stage's version, to `directory` "
        "(under allowed_reload_sources, else 403): safetensors and an index naming the version, "
        "written beside the target and renamed in whole. Legal where valid weights are awake "
        "(RUNNING, PAUSED, PARTIAL with weights awake), else 400, nothing written; so is a directory "
        "that exists (unless overwrite), an unusable one, or a runner that cannot save, nothing left "
        "under that name. Once saved, a restart reloads it at that version.",
    )
    async def save_weights(name: str, request: Request, body: m.SaveWeightsBody) -> Response:
        state.stage_name(name)
        directory = state.check_source(body.directory) or body.directory
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        call = functools.partial(
            engine.save_weights,
            directory=directory,
            overwrite=body.overwrite,
            max_file_bytes=body.max_file_bytes,
            timeout_s=limit_s,
        )
        return await stage_route(state, request, name, "save_weights", call)

    @api.post(
        "/v1/stages/{name}/restart",
        dependencies=control,
        response_model=m.RestartModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Fresh rank processes under a new epoch, at the weights version the stage held: "
        "they reload the directory it came from (a disk update's, a reload's); a version that lived "
        "in memory only (shm, IPC, a collective, a transfer) brings the stage back NEEDS_RELOAD with "
        "version_floor set, refusing requests until an update at or above it. from_checkpoint: start "
        "over at version 0 (version_reset_from says from which). With an Idempotency-Key, a retry "
        "while the key is kept (idempotency_entries) returns the first answer without restarting "
        "again.",
    )
    async def restart(name: str, request: Request, body: m.RestartBody | None = None) -> Response:
        state.stage_name(name)
        engine = state.require_engine()
        reset = (body or m.RestartBody()).from_checkpoint

        def restarted(per_stage: dict[str, Any]) -> dict[str, Any]:
            feed.forget(name)
            state.metrics.restarts.labels(name).inc()
            return dict(per_stage[name])

        return await lifecycle_route(
            state,
            request,
            [name],
            "restart",
            lambda n, tid: functools.partial(engine.restart, n, from_checkpoint=reset),
            restarted,
            stages_in_error=False,
        )

    @api.post(
        "/v1/swap",
        dependencies=control,
        response_model=m.SwapReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Put stage `out` to sleep and wake stage `in` at the same time, so the host link "
        "carries both directions at once; each incoming rank maps an allocation only once the "
        "device has that much free, waiting up to `memory_wait_s` (P-16). A swap that does not "
        "complete answers with the failed half's code and both halves in the error "
        "(`outgoing`, `incoming`); NoMemoryError's `refusals` name who holds the device. "
        "With an Idempotency-Key, a retry gets the first answer.",
    )
    async def swap(request: Request, body: m.SwapBody) -> Response:
        out_stage, in_stage = state.stage_name(body.out), state.stage_name(body.in_)
        engine, tid, limit_s = state.require_engine(), lifecycle_tid(request), timeout_s(body.timeout_s)
        call = functools.partial(
            engine.swap,
            out_stage,
            in_stage,
            level=body.level,
            tags=body.tags,
            task_id=tid,
            timeout_s=limit_s,
            memory_wait_s=body.memory_wait_s,
        )

        async def work() -> Answer:
            try:
                report = await state.swap(out_stage, in_stage, call, body.level)
            except Exception as exc:
                return error_answer(exc)
            return answer(200, swap_json(report))

        return await run_post(state, request, work)

    @api.post(
        "/v1/stages/{name}/admission",
        dependencies=control,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="What requests do while the stage is not RUNNING: queue, reject or wake",
    )
    async def admission(name: str, request: Request, body: m.AdmissionBody) -> Response:
        state.stage_name(name)
        engine = state.require_engine()

        async def work() -> Answer:
            try:
                await state.blocking(engine.set_admission, name, body.policy)
            except Exception as exc:
                return error_answer(exc, name)
            feed.poke()
            return answer(200, {"stage": name, "admission": body.policy})

        return await run_post(state, request, work)

    @api.post(
        "/v1/stages/{name}/execute",
        dependencies=control,
        response_model=m.ExecuteModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="One request to the stage's runner, through its admission policy. With an "
        "Idempotency-Key, a retry returns the first answer and does not run it again.",
    )
    async def execute(name: str, request: Request, body: m.ExecuteBody | None = None) -> Response:
        body = body or m.ExecuteBody()
        state.stage_name(name)
        check_wire_value(body.payload, "payload")
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        budget_s = (limit_s or state.specs[name].request_timeout_s) + WAIT_GRACE_S

        async def work() -> Answer:
            try:
                submitted = engine.submit(
                    name, body.payload, timeout_s=limit_s, with_version=True, adapter=body.adapter
                )
                future = asyncio.wrap_future(submitted)
                try:
                    output = await asyncio.wait_for(asyncio.shield(future), budget_s)
                except asyncio.TimeoutError:
                    raise OmniCoreError(
                        f"no answer from the orchestrator within {budget_s:.1f} s; its deadlines "
                        "should have fired: this is a bug, please report it"
                    ) from None
                ran: dict[str, Any] = {
                    "stage": name,
                    "output": output.output,
                    "weights_version": output.weights_version,
                }
                if output.adapter is not None:  # P-20: the adapter beside the weights version
                    ran |= {"adapter": output.adapter, "adapter_version": output.adapter_version}
                reply = answer(200, ran)
            except Exception as exc:
                reply = error_answer(exc, name)
            if reply.status == 504:
                state.metrics.deadlines.labels(name, "request").inc()
            state.metrics.requests.labels(name, _outcome(reply.status)).inc()
            return reply

        return await run_post(state, request, work)

    return api
