"""omni-core's own adapter routes (P-20), one stage per call as the other `/v1/stages/{name}`
routes are: `GET /v1/stages/{name}/adapters` (ListAdapters), `POST .../adapters` (AddAdapter
from a directory under allowed_reload_sources), `POST .../adapters/{adapter}/remove` and
`.../pin`. Each answers the stage's lifecycle report, whose ranks list every adapter; the
CLI's `omni-core adapters` verb speaks them."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omni_core.serve import models as m
from omni_core.serve.lifecycle import stage_route, timeout_s
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])
    report: dict[str, Any] = {
        "response_model": m.LifecycleReportModel,
        "responses": m.ERROR_RESPONSES,
        "tags": ["omni-core"],
    }

    @api.get("/v1/stages/{name}/adapters", **report)
    async def list_adapters(name: str, request: Request) -> Response:
        """ListAdapters on every rank: each adapter loaded, gone or stale (the ranks' reports)."""
        state.stage_name(name)
        engine = state.require_engine()
        return await stage_route(state, request, name, "list_adapters", engine.list_adapters)

    @api.post("/v1/stages/{name}/adapters", **report)
    async def add_adapter(name: str, request: Request, body: m.AddAdapterBody) -> Response:
        """AddAdapter on every rank: `source` a PEFT directory under allowed_reload_sources (its
        rank and modules from adapter_config.json unless given)."""
        state.stage_name(name)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        call = functools.partial(
            engine.add_adapter,
            name=body.name,
            source=state.check_source(body.source),
            rank=body.rank,
            target_modules=body.target_modules,
            version=body.version,
            base_version=body.base_version,
            pinned=body.pinned,
            rebind=body.rebind,
            timeout_s=limit_s,
        )
        return await stage_route(state, request, name, "add_adapter", call)

    @api.post("/v1/stages/{name}/adapters/{adapter}/remove", **report)
    async def remove_adapter(name: str, adapter: str, request: Request, body: m.TimeoutBody | None = None) -> Response:
        """RemoveAdapter on every rank (not loaded: ALREADY)."""
        state.stage_name(name)
        engine, limit_s = state.require_engine(), timeout_s((body or m.TimeoutBody()).timeout_s)
        call = functools.partial(engine.remove_adapter, name=adapter, timeout_s=limit_s)
        return await stage_route(state, request, name, "remove_adapter", call)

    @api.post("/v1/stages/{name}/adapters/{adapter}/pin", **report)
    async def pin_adapter(name: str, adapter: str, request: Request, body: m.PinAdapterBody | None = None) -> Response:
        """PinAdapter on every rank: pinned (default) or not; a pinned adapter is never evicted."""
        state.stage_name(name)
        body = body or m.PinAdapterBody(pinned=True)
        engine, limit_s = state.require_engine(), timeout_s(body.timeout_s)
        call = functools.partial(engine.pin_adapter, name=adapter, pinned=body.pinned, timeout_s=limit_s)
        return await stage_route(state, request, name, "pin_adapter", call)

    return api
