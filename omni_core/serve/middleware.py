"""What stands around every route: the API key check, the refusal of undeclared query
parameters, the rendering of every error as one JSON shape, and the middleware stack (body
limit, browser guards, HTTP metrics)."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_core.engine.errors import OmniCoreError
from omni_core.serve.errors import ApiError
from omni_core.serve.guard import BrowserGuard, BrowserPolicy
from omni_core.serve.lifecycle import answer, error_answer, response
from omni_core.serve.limits import BodyLimit
from omni_core.serve.state import ServeState

# The method label comes from this set, never from the request: a client choosing the
# label text could create series without end (one per made-up method).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in KNOWN_METHODS else "other"


def known_query_only(request: Request) -> None:
    """Every route refuses query parameters it does not declare, as bodies refuse unknown
    fields: a router that renames `level` gets told, not a default."""
    route = request.scope.get("route")
    dependant = getattr(route, "dependant", None)
    allowed = {p.alias for p in dependant.query_params} if dependant is not None else set()
    unknown = sorted(set(request.query_params) - allowed)
    if unknown:
        raise ApiError(
            422,
            f"unknown query parameter(s) {[u[:100] for u in unknown[:10]]} for {request.url.path}; "
            f"accepted: {sorted(allowed)}",
            kind="InvalidArgumentError",
            extra={"fields": [f"query.{u[:100]}" for u in unknown[:10]]},
        )


def require_key(request: Request) -> None:
    """The API key, when the server has one (a dependency of every route but the page's)."""
    state: ServeState = request.app.state.serve
    if not state.key_check.accepts(request.headers.get("authorization")):
        state.metrics.http_auth_failures.inc()
        raise ApiError(
            401,
            "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
            "server was given (api_key_file or its environment variable)",
            kind="Unauthorized",
            headers={"WWW-Authenticate": "Bearer"},
        )


class HttpMetrics:
    """Counts every HTTP answer by route template, method and code; times it. Every label
    comes from a closed set: route templates ("unmatched" else), known methods ("other"
    else) and the status code the app chose."""

    def __init__(self, app: ASGIApp, state: ServeState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        metrics = self.state.metrics
        code = 500
        started = time.perf_counter()

        async def counting_send(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        metrics.http_in_flight.inc()
        try:
            await self.app(scope, receive, counting_send)
        finally:
            metrics.http_in_flight.dec()
            route = getattr(scope.get("route"), "path", None)
            route = route if isinstance(route, str) else "unmatched"
            method = method_label(scope["method"])
            elapsed_s = time.perf_counter() - started
            metrics.http_requests.labels(route, method, str(code)).inc()
            metrics.http_duration.labels(route, method).observe(elapsed_s)
            if self.state.access_log is not None:
                peer = scope.get("client") or ("-", 0)
                self.state.access_log.answered(
                    method, scope.get("path", ""), route, code, elapsed_s, f"{peer[0]}:{peer[1]}"
                )


def add_error_handlers(app: FastAPI) -> None:
    """Every error, the app's own and FastAPI's, as `{"error": {"code", "type", "message"}}`."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return response(error_answer(exc))

    @app.exception_handler(OmniCoreError)
    async def _engine_error(request: Request, exc: OmniCoreError) -> Response:
        return response(error_answer(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return response(
                error_answer(
                    ApiError(
                        400,
                        "the body is not valid JSON; send a JSON object (the schema is in /openapi.json)",
                        kind="InvalidJSON",
                    )
                )
            )
        fields = [".".join(str(p) for p in e.get("loc", ())) for e in errors]
        problems = "; ".join(f"{where}: {e.get('msg')}" for where, e in zip(fields, errors, strict=True))
        return response(
            error_answer(
                ApiError(
                    422,
                    f"invalid request: {problems}; send each field with the JSON type /openapi.json gives it "
                    "(nothing is converted)",
                    kind="InvalidArgumentError",
                    extra={"fields": fields},
                )
            )
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        kind = {404: "NotFound", 405: "MethodNotAllowed", 413: "BodyTooLarge"}.get(exc.status_code, "HTTPError")
        message = (
            exc.detail if exc.status_code != 404 else (f"no route {request.url.path}; the routes are in /openapi.json")
        )
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":  # FastAPI's words
            kind, message = (
                "InvalidJSON",
                (
                    "the body could not be read as JSON (nested too deep, or a number too "
                    "long for the parser); send a JSON object as /openapi.json gives it"
                ),
            )
        allow = (exc.headers or {}).get("Allow")
        if exc.status_code == 405 and allow:
            # SGLang also takes GET on its state-changing routes; here a GET never changes state,
            # since a GET is what any web page can send without the browser guards seeing it.
            message = (
                f"{method_label(request.method)} is not allowed on {request.url.path}; use {allow} (a GET "
                "never changes state here: any web page can send one)"
            )
        headers = {"Allow": allow} if allow else {}
        return response(
            answer(
                exc.status_code,
                {"error": {"code": exc.status_code, "type": kind, "message": str(message)}},
                headers.items(),
            ),
        )


def add_middleware(app: FastAPI, state: ServeState) -> None:
    # The last added is outermost: metrics see every answer, 413s included; the body limit
    # still runs before any route reads a byte.
    app.add_middleware(
        BodyLimit, max_body_bytes=state.server.max_body_bytes, on_refused=state.metrics.http_body_refused.inc
    )
    policy = BrowserPolicy(state.server.host, state.server.allowed_hosts, state.server.allowed_origins)
    app.add_middleware(
        BrowserGuard, policy=policy, on_refused=lambda reason: state.metrics.http_refused.labels(reason).inc()
    )
    app.add_middleware(HttpMetrics, state=state)
