"""The HTTP control plane over one `Engine`: create_app assembles it.

Each concern has its module: `state` (the engine, its thread pools, the accounting of each
lifecycle call), `feed` (the status snapshot, its subscribers, the operator's log lines),
`middleware` (API key, query check, error rendering, the middleware stack), `lifecycle` (the
one path every lifecycle route takes: a task of its own under its Idempotency-Key, every
stage at once, one answer), and one router per route family, listed in `ROUTERS`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, FastAPI

from omni_core.config import OmniConfig
from omni_core.engine import Engine
from omni_core.serve import (
    adapter_routes,
    core_routes,
    ipc_routes,
    lora_routes,
    omni_routes,
    openai_routes,
    pause_routes,
    rl_routes,
    sglang_generate,
    sglang_routes,
    trl_routes,
    vllm_routes,
    weight_routes,
)
from omni_core.serve import models as m
from omni_core.serve.middleware import add_error_handlers, add_middleware, known_query_only
from omni_core.serve.state import ServeState

__all__ = ["API_VERSION", "ROUTERS", "create_app"]

API_VERSION = "1"

# Every route family: a module whose `router(state)` returns its APIRouter. A new family is
# one module and one line here.
ROUTERS: tuple[Callable[[ServeState], APIRouter], ...] = (
    core_routes.router,
    adapter_routes.router,
    lora_routes.router,
    vllm_routes.router,
    pause_routes.router,
    omni_routes.router,
    sglang_routes.router,
    sglang_generate.router,
    weight_routes.router,
    ipc_routes.router,
    rl_routes.router,
    trl_routes.router,
    openai_routes.router,
)


def create_app(engine: Engine | None, config: OmniConfig, *, api_key: str | None = None) -> FastAPI:
    """The ASGI app. `engine` is owned by the caller (started before, shut down after)."""
    state = ServeState(engine, config, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        poller = asyncio.ensure_future(state.feed.poll_forever()) if engine is not None else None
        try:
            yield
        finally:
            state.begin_close()
            if poller is not None:
                poller.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await poller
            state.executor.shutdown(wait=False, cancel_futures=True)
            state.status_executor.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(
        title="omni-core serve",
        version=API_VERSION,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        dependencies=[Depends(known_query_only)],
        responses=m.EVERY_ROUTE_ERRORS,
        description="HTTP control plane of omni-core: stage lifecycle (sleep, wake, reload, restart), "
        "requests, vLLM- and vLLM-Omni-compatible routes, Prometheus metrics and a live "
        "status page. Errors: README.md, 'Serving over HTTP'.",
    )
    app.state.serve = state
    add_error_handlers(app)
    for make_router in ROUTERS:
        app.include_router(make_router(state))
    add_middleware(app, state)
    return app
