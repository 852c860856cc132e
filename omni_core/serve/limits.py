"""Bounded request bodies: a pure ASGI middleware, so nothing reads an unbounded body first."""

from __future__ import annotations

import json
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def too_large_message(max_body_bytes: int, what: str) -> str:
    return (
        f"request body {what} exceeds max_body_bytes ({max_body_bytes}); send less, or raise max_body_bytes in [server]"
    )


class BodyTooLargeError(HTTPException):
    """An HTTPException so that FastAPI's body parsing passes it on instead of calling it a
    parse error (400); the app's handler renders it as 413."""

    def __init__(self, message: str) -> None:
        super().__init__(413, detail=message)


def _too_large_body(max_body_bytes: int, what: str) -> bytes:
    return json.dumps(
        {"error": {"code": 413, "type": "BodyTooLarge", "message": too_large_message(max_body_bytes, what)}}
    ).encode()


class BodyLimit:
    """Answers 413 when Content-Length says too much, and stops reading a chunked body as
    soon as it passes the limit (a missing or lying Content-Length changes nothing)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, on_refused: Any = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.on_refused = on_refused  # callback for the metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                declared_bytes = int(declared)
            except ValueError:
                declared_bytes = -1
            if declared_bytes > self.max_body_bytes:
                await self._refuse(send, f"of {declared_bytes} bytes (Content-Length)")
                return
        seen_bytes = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen_bytes
            message = await receive()
            if message["type"] == "http.request":
                seen_bytes += len(message.get("body", b""))
                if seen_bytes > self.max_body_bytes:
                    if self.on_refused is not None:
                        self.on_refused()
                    raise BodyTooLargeError(
                        too_large_message(self.max_body_bytes, f"of more than {self.max_body_bytes} bytes (chunked)")
                    )
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLargeError:  # raised outside a route that renders it (none today)
            if not started:
                await self._send_413(send, f"of more than {self.max_body_bytes} bytes (chunked)")

    async def _refuse(self, send: Send, what: str) -> None:
        if self.on_refused is not None:
            self.on_refused()
        await self._send_413(send, what)

    async def _send_413(self, send: Send, what: str) -> None:
        body = _too_large_body(self.max_body_bytes, what)
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
