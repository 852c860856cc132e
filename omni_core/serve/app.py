"""The HTTP control plane over one `Engine`: omni-core's own routes, vLLM's and vLLM-Omni's.

Every blocking engine call runs on a bounded thread pool; requests go through
`Engine.submit` and are awaited without a thread. Each POST runs as a task of its own, so a
client that disconnects never cancels a sleep halfway or loses a request's accounting: the
call runs to its end, its outcome is counted, and an `Idempotency-Key` retry gets it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import itertools
import json
import logging
import os
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec
from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omni_core.config import OmniConfig
from omni_core.engine import Engine, LifecycleReport, SwapReport
from omni_core.engine.api import WAIT_GRACE_S
from omni_core.engine.errors import InvalidArgumentError, OmniCoreError, SwapFailedError
from omni_core.protocol import CollectiveSource, DiskSource, WeightSource
from omni_core.serve import models as m
from omni_core.serve.auth import KeyCheck
from omni_core.serve.errors import ApiError, to_http
from omni_core.serve.errors import outcome_label as _outcome
from omni_core.serve.guard import BrowserGuard, BrowserPolicy
from omni_core.serve.idempotency import Answer, IdempotencyCache, check_key, fingerprint, task_id_for
from omni_core.serve.limits import BodyLimit
from omni_core.serve.logs import EVENT_ATTR
from omni_core.serve.metrics import ServeMetrics
from omni_core.serve.page import STATUS_PAGE_CSP, STATUS_PAGE_HTML
from omni_core.serve.reports import report_json, swap_json
from omni_core.serve.strict import check_path_text, check_wire_value

API_VERSION = "1"
STATUS_CALL_TIMEOUT_S = 10.0  # Engine.status answers from the orchestrator loop in ms; this bounds a stuck one
SSE_KEEPALIVE_S = 15.0  # proxies close idle streams; a comment line keeps them open
SSE_QUEUE_MESSAGES = 256  # a subscriber this far behind is dropped (it reconnects and gets a fresh snapshot)
EVENTS_IN_SNAPSHOT = 50
# /health answers 503 while a stage is in one of these (vLLM and SGLang answer 503 when their
# engine is dead, so a probe restarts or routes around it); a sleeping stage is healthy.
UNHEALTHY_STATES = frozenset({"FAILED", "STOPPED"})
MAX_REASON_CHARS = 500  # a failure reason quoted in /health; the full text is in GET /v1/stages/{name}
JSON = "application/json"
# Not "omni_core.serve", whose messages are rate-limited (peers can cause them): every
# lifecycle event, failure and dead rank gets its line.
log = logging.getLogger("omni_core.serve.events")


def _json_default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def dumps(value: Any) -> bytes:
    return json.dumps(value, default=_json_default, separators=(",", ":")).encode()


def _read_rss_bytes(pid: int | None) -> int | None:
    """Host resident memory of a rank process (Linux /proc; None elsewhere or once it is gone)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class RankMemory:
    """A rank's memory as of its last lifecycle report through this server."""

    pool_bytes: dict[str, int] = field(default_factory=dict)
    process_bytes: int | None = None
    process_bytes_source: str = "none"
    host_offloaded_bytes: int = 0


class ServeState:
    """Everything the routes share: the engine, the config, caches, metrics, subscribers."""

    def __init__(self, engine: Engine | None, config: OmniConfig, api_key: str | None) -> None:
        self.engine = engine
        self.config = config
        self.server = config.server
        self.specs = {s.name: s for s in config.stages}
        self.names = [s.name for s in config.stages]
        self.key_check = KeyCheck(api_key)
        self.idempotency = IdempotencyCache(self.server.idempotency_entries, self.server.idempotency_bytes)
        self.executor = ThreadPoolExecutor(max_workers=self.server.lifecycle_threads, thread_name_prefix="omni-serve")
        # Status calls get threads of their own: a pool full of long drains must not freeze
        # the status page, the metrics or GET /v1/stages.
        self.status_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="omni-serve-status")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.memory: dict[str, dict[int, RankMemory]] = {name: {} for name in self.names}
        self.last_level: dict[str, int | None] = dict.fromkeys(self.names)
        self.events: deque[dict[str, Any]] = deque(maxlen=self.server.events_kept)
        self.snapshot: dict[str, Any] = {
            "time": time.time(),
            "engine_up": False,
            "engine": {},
            "stages": {},
            "events": [],
        }
        self.subscribers: set[asyncio.Queue] = set()
        self.metrics = ServeMetrics(lambda: self.snapshot)
        self.closing = asyncio.Event()
        self._refresh: asyncio.Event | None = None
        self._event_ids = itertools.count(1)
        # What the log already said per stage ("state") and per rank: two refreshes may end
        # out of order, and a change must still be one line. One entry per stage and rank.
        self.logged: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------------ engine calls

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise ApiError(503, "this app has no engine (schema generation only)", kind="EngineClosedError")
        return self.engine

    async def blocking(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))

    async def status(self) -> dict[str, Any]:
        engine = self.require_engine()
        call = asyncio.get_running_loop().run_in_executor(self.status_executor, engine.status)
        return await asyncio.wait_for(call, STATUS_CALL_TIMEOUT_S)

    def stage_name(self, ident: int | str) -> str:
        """A stage named, or given by its index in the config (vLLM-Omni's stage_ids)."""
        if isinstance(ident, int) and not isinstance(ident, bool):
            if 0 <= ident < len(self.names):
                return self.names[ident]
            raise ApiError(
                404,
                f"unknown stage id {ident}; stage ids are 0..{len(self.names) - 1} ({dict(enumerate(self.names))})",
                kind="InvalidArgumentError",
            )
        if ident not in self.specs:
            raise ApiError(
                404, f"unknown stage {ident!r}; stages are {sorted(self.specs)}", kind="InvalidArgumentError"
            )
        return ident

    def stage_list(self, ids: list[int | str]) -> list[str]:
        """vLLM-Omni's stage_ids as names, each once (a stage named twice would race itself)."""
        return list(dict.fromkeys(self.stage_name(i) for i in ids))

    def targets(self) -> list[str]:
        """What vLLM's routes act on: the configured default stage, or every stage."""
        return [self.server.default_stage] if self.server.default_stage else list(self.names)

    def check_source(self, source: str | None) -> str | None:
        """A reload source is a path the ranks will open: only the config may widen that.
        Returns the path resolved, which is what the ranks get: the one that was checked, so
        a symlink swapped after the check is not followed out of the allowed roots."""
        if source is None:
            return None
        check_path_text(source, "source")
        allowed = self.server.allowed_reload_sources
        real = os.path.realpath(source)
        for root in allowed:
            with contextlib.suppress(ValueError):
                if os.path.commonpath([real, root]) == root:
                    return real
        raise ApiError(
            403,
            f"reload source {source!r} is not under the config's allowed_reload_sources "
            f"({list(allowed) or 'none'}); the server opens no path a caller names unless the "
            "operator lists it under [server] allowed_reload_sources",
            kind="SourceNotAllowed",
        )

    def weight_source(self, source: str | dict[str, Any]) -> WeightSource:
        """The body's `source` as the protocol's type: a path is a disk source; an object is
        decoded strictly (no conversion, no unknown field) and a disk path in it is checked
        against allowed_reload_sources like a reload's."""
        if isinstance(source, str):
            return DiskSource(path=self.check_source(source) or source)
        check_wire_value(source, "source")
        try:
            decoded = msgspec.convert(source, WeightSource, strict=True)  # type: ignore[arg-type]
        except msgspec.ValidationError as exc:
            # msgspec names the place as `$.buckets[0].nbytes`: say it from the body's root.
            where = str(exc).replace("$", "source", 1) if "$" in str(exc) else f"source: {exc}"
            raise ApiError(
                422,
                f'weight source refused: {where}; send a path, {{"type": "disk", "path": ...}} '
                "or msgspec.to_builtins of what WeightSender shares",
                kind="RequestValidationError",
                extra={"fields": ["source"]},
            ) from None
        if isinstance(decoded, DiskSource):
            return DiskSource(path=self.check_source(decoded.path) or decoded.path)
        return decoded

    async def lifecycle(self, stage: str, command: str, call: Callable[[], Any], *, level: int | None = None) -> Any:
        """Run one blocking lifecycle call; time it, count it, remember its memory figures."""
        metrics = self.metrics
        metrics.lifecycle_in_flight.labels(stage).inc()
        started = time.perf_counter()
        try:
            result = await self.blocking(call)
        except BaseException as exc:
            status = to_http(exc).status
            outcome = _outcome(status)
            if status == 504:
                metrics.deadlines.labels(stage, "lifecycle").inc()
            self.record_event(stage, command, outcome, time.perf_counter() - started, error=str(exc), level=level)
            metrics.lifecycle_duration.labels(stage, command, outcome).observe(time.perf_counter() - started)
            raise
        finally:
            metrics.lifecycle_in_flight.labels(stage).dec()
            self.poke()
        elapsed_s = time.perf_counter() - started
        metrics.lifecycle_duration.labels(stage, command, "ok").observe(elapsed_s)
        if isinstance(result, LifecycleReport):
            self.note_report(stage, command, result, level)
            self.record_event(
                stage,
                command,
                "ok",
                elapsed_s,
                state=result.state,
                status=result.status,
                level=level,
                freed_bytes=sum(rr.freed_bytes for rr in result.ranks.values()),
            )
        else:
            self.record_event(stage, command, "ok", elapsed_s, level=level)
        return result

    async def swap(self, out_stage: str, in_stage: str, call: Callable[[], SwapReport], level: int) -> SwapReport:
        """Run one blocking swap; time it and count it, and account each half as its stage's
        sleep or wake (memory figures, events) whether or not the other half completed."""
        metrics = self.metrics
        for stage in (out_stage, in_stage):
            metrics.lifecycle_in_flight.labels(stage).inc()
        started = time.perf_counter()
        try:
            report = await self.blocking(call)
        except BaseException as exc:
            elapsed_s = time.perf_counter() - started
            metrics.swap_duration.labels(out_stage, in_stage, _outcome(to_http(exc).status)).observe(elapsed_s)
            if isinstance(exc, SwapFailedError):
                self._note_half(out_stage, "sleep", exc.outgoing, level, elapsed_s)
                self._note_half(in_stage, "wake", exc.incoming, None, elapsed_s)
            else:  # refused before anything was sent (unknown tag, a stage busy or FAILED, ...)
                self.record_event(
                    out_stage, "swap", _outcome(to_http(exc).status), elapsed_s, error=str(exc), level=level
                )
            raise
        finally:
            for stage in (out_stage, in_stage):
                metrics.lifecycle_in_flight.labels(stage).dec()
            self.poke()
        metrics.swap_duration.labels(out_stage, in_stage, "ok").observe(time.perf_counter() - started)
        self._note_half(out_stage, "sleep", report.outgoing, level, report.duration_s)
        self._note_half(in_stage, "wake", report.incoming, None, report.duration_s)
        return report

    def _note_half(self, stage: str, command: str, half: object, level: int | None, elapsed_s: float) -> None:
        if isinstance(half, LifecycleReport):
            self.note_report(stage, command, half, level)
            self.record_event(
                stage,
                command,
                "ok",
                half.duration_s,
                state=half.state,
                status=half.status,
                level=level,
                swap=half.task_id.rsplit("/", 1)[0],
                freed_bytes=sum(rr.freed_bytes for rr in half.ranks.values()),
            )
        elif isinstance(half, BaseException):
            self.record_event(stage, command, _outcome(to_http(half).status), elapsed_s, error=str(half), level=level)

    def note_report(self, stage: str, command: str, report: LifecycleReport, level: int | None) -> None:
        if command == "sleep" and report.status == "OK":
            self.last_level[stage] = level
        ranks = self.memory[stage]
        for rank, rr in report.ranks.items():
            mem = ranks.setdefault(rank, RankMemory())
            if rr.pool_bytes_after or rr.pool_bytes_before:
                mem.pool_bytes = dict(rr.pool_bytes_after)
            if rr.process_bytes_after is not None:
                mem.process_bytes, mem.process_bytes_source = rr.process_bytes_after, rr.process_bytes_source
            for tag in rr.pool_bytes_before.keys() | rr.pool_bytes_after.keys():
                delta = rr.pool_bytes_before.get(tag, 0) - rr.pool_bytes_after.get(tag, 0)
                # A rank's report names the tags; only the stage's own become label values.
                label = tag if tag in self.specs[stage].tags else "other"
                if delta > 0:
                    self.metrics.freed_bytes.labels(stage, label).inc(delta)
                elif delta < 0:
                    self.metrics.restored_bytes.labels(stage, label).inc(-delta)
            weights_freed = rr.pool_bytes_before.get("weights", 0) - rr.pool_bytes_after.get("weights", 0)
            weights_back = command in ("wake", "reload") and rr.pool_bytes_after.get("weights", 0) > 0
            if command == "sleep" and level == 1 and weights_freed > 0:
                mem.host_offloaded_bytes = weights_freed  # level 1 keeps the weights on the host
            elif (command == "sleep" and level == 2) or weights_back:
                mem.host_offloaded_bytes = 0

    def forget(self, stage: str) -> None:
        """A restarted stage has fresh ranks: what the old ones reported no longer holds."""
        self.memory[stage] = {}
        self.last_level[stage] = None

    # ------------------------------------------------------------------ events and snapshots

    def record_event(self, stage: str, command: str, outcome: str, duration_s: float, **details: Any) -> None:
        event = {
            "id": next(self._event_ids),
            "time": time.time(),
            "stage": stage,
            "command": command,
            "outcome": outcome,
            "duration_s": duration_s,
            **{k: v for k, v in details.items() if v is not None},
        }
        self.events.append(event)
        self.broadcast("lifecycle", event)
        _log_event(event)

    def broadcast(self, kind: str, data: dict[str, Any]) -> None:
        for queue in list(self.subscribers):
            try:
                queue.put_nowait((kind, data))
            except asyncio.QueueFull:  # too slow a reader: drop it; it reconnects for a fresh snapshot
                self.subscribers.discard(queue)
                with contextlib.suppress(asyncio.QueueEmpty):
                    queue.get_nowait()
                queue.put_nowait((None, {}))

    def poke(self) -> None:
        if self._refresh is not None:
            self._refresh.set()

    def stage_view(self, index: int, name: str, st: dict[str, Any] | None) -> dict[str, Any]:
        spec = self.specs[name]
        st = st or {}
        ranks: dict[str, Any] = {}
        for rank, info in (st.get("ranks") or {}).items():
            mem = self.memory[name].get(int(rank), RankMemory())
            ranks[str(rank)] = {
                "pid": info.get("pid"),
                "alive": bool(info.get("alive")),
                "state": str(info.get("state", "-")),
                "pool_bytes": dict(mem.pool_bytes),
                "process_bytes": mem.process_bytes,
                "process_bytes_source": mem.process_bytes_source,
                "rss_bytes": _read_rss_bytes(info.get("pid")) if info.get("alive") else None,
                "host_offloaded_bytes": mem.host_offloaded_bytes,
                "weights_version": info.get("weights_version", 0),
            }
        return {
            "stage_id": index,
            "name": name,
            "state": st.get("state", "UNKNOWN"),
            "epoch": st.get("epoch", 0),
            "task_id": st.get("task_id"),
            "admission": str(st.get("admission", spec.admission.value)),
            "failure": st.get("failure") or None,
            "queued": st.get("queued", 0),
            "in_flight": st.get("in_flight", 0),
            "counters": dict(st.get("counters") or {}),
            "last_sleep_level": self.last_level[name],
            "asleep_tags": list(st.get("asleep_tags") or []),
            "weights_valid": bool(st.get("weights_valid", True)),
            "weights_version": st.get("weights_version", 0),
            "tags": list(spec.tags),
            "runner": spec.runner,
            "device": spec.device,
            "backend": spec.backend,
            "host_offloaded_bytes": sum(r["host_offloaded_bytes"] for r in ranks.values()),
            "ranks": ranks,
        }

    def build_snapshot(self, status: dict[str, Any] | None) -> dict[str, Any]:
        status = status or {}
        return {
            "time": time.time(),
            "engine_up": bool(status),
            "engine": dict(status.get("_engine") or {}),
            "stages": {name: self.stage_view(i, name, status.get(name)) for i, name in enumerate(self.names)},
            "events": list(self.events)[-EVENTS_IN_SNAPSHOT:],
        }

    async def refresh(self) -> dict[str, Any]:
        try:
            status: dict[str, Any] | None = await self.status()
        except (OmniCoreError, ApiError, asyncio.TimeoutError):
            status = None
        previous, self.snapshot = self.snapshot, self.build_snapshot(status)
        _log_changes(previous, self.snapshot, self.logged)
        self.broadcast("status", self.snapshot)
        return self.snapshot

    async def poll_forever(self) -> None:
        """Keeps the snapshot (metrics, status page) fresh: every status_poll_interval_s, and
        at once after each lifecycle call through the server."""
        self._refresh = asyncio.Event()
        while not self.closing.is_set():
            self._refresh.clear()
            await self.refresh()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._refresh.wait(), self.server.status_poll_interval_s)

    def begin_close(self) -> None:
        """Server shutdown: end every event stream so connections can close. Callable from
        any thread (a test or an embedding program stops the server from its own)."""
        loop = self.loop
        if loop is not None and loop.is_running():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is not loop:
                loop.call_soon_threadsafe(self._close_now)
                return
        self._close_now()

    def _close_now(self) -> None:
        self.closing.set()
        for queue in list(self.subscribers):
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait((None, {}))


# ====================================================================== the operator's log


def _log_event(event: dict[str, Any]) -> None:
    """One line per lifecycle call through the server: its outcome, state and bytes moved."""
    fields = dict(event, event="lifecycle")
    if "level" in fields:  # a log line's `level` is its severity
        fields["sleep_level"] = fields.pop("level")
    extra = {EVENT_ATTR: fields}
    what = f"stage {event['stage']!r}: {event['command']}" + (f" level {event['level']}" if "level" in event else "")
    took = f"{event['duration_s'] * 1000:.1f} ms"
    if event["outcome"] == "ok":
        freed = event.get("freed_bytes")
        moved = "" if not freed else f", {'freed' if freed > 0 else 'restored'} {abs(freed)} bytes"
        state = f" -> {event['state']} ({event['status']})" if "state" in event else ""
        log.info("%s%s in %s%s", what, state, took, moved, extra=extra)
    else:
        log.warning("%s failed (%s) after %s: %s", what, event["outcome"], took, event.get("error", ""), extra=extra)


def _log_changes(before: dict[str, Any], after: dict[str, Any], logged: dict[tuple[str, str], Any]) -> None:
    """What the engine did on its own, seen between two status snapshots: a stage that became
    FAILED or STOPPED, a rank process that is gone, the engine no longer answering. `logged`
    holds what was said, so each is said once."""
    if before["engine_up"] and not after["engine_up"]:
        log.error(
            "the engine did not answer a status call; if it persists, restart `omni-core serve`",
            extra={EVENT_ATTR: {"event": "engine_unresponsive"}},
        )
    for name, now in after["stages"].items():
        then = before["stages"].get(name) or {}
        failed = (now["epoch"], now["state"]) if now["state"] in UNHEALTHY_STATES else None
        if failed is not None and then.get("state") != now["state"] and logged.get((name, "state")) != failed:
            logged[(name, "state")] = failed
            log.error(
                "stage %r is %s: %s; restart it: omni-core restart %s",
                name,
                now["state"],
                now.get("failure") or "no reason recorded",
                name,
                extra={
                    EVENT_ATTR: {
                        "event": "stage_failed",
                        "stage": name,
                        "state": now["state"],
                        "epoch": now["epoch"],
                        "failure": now.get("failure"),
                    }
                },
            )
        for rank, info in now["ranks"].items():
            old = (then.get("ranks") or {}).get(rank)
            gone = old is not None and old["alive"] and not info["alive"] and old["pid"] == info["pid"]
            if gone and logged.get((name, rank)) != info["pid"]:
                logged[(name, rank)] = info["pid"]
                log.error(
                    "stage %r rank %s (pid %s) is gone: its process exited while the stage is %s",
                    name,
                    rank,
                    info["pid"],
                    now["state"],
                    extra={
                        EVENT_ATTR: {
                            "event": "rank_gone",
                            "stage": name,
                            "rank": int(rank),
                            "pid": info["pid"],
                            "state": now["state"],
                        }
                    },
                )


# ====================================================================== answering


def _answer(status: int, body: Any, headers: Iterable[tuple[str, str]] = ()) -> Answer:
    return Answer(status, dumps(body), tuple(headers))


def error_answer(exc: BaseException, stage: str | None = None) -> Answer:
    err = to_http(exc, stage=stage)
    return _answer(err.status, err.body, err.headers.items())


def _response(answer: Answer, replayed: bool = False) -> Response:
    headers = dict(answer.headers)
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return Response(answer.body, status_code=answer.status, headers=headers, media_type=JSON)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_post(state: ServeState, request: Request, route: str, work: Callable[[], Awaitable[Answer]]) -> Response:
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
        state.metrics.http_disconnects.labels(route).inc()
        # The work goes on to its end; its outcome is counted and kept under its key.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return Response(status_code=499)  # nobody reads it; uvicorn drops it
    if task.exception() is not None:
        return _response(error_answer(task.exception()))
    answer, replayed = task.result()
    if replayed:
        state.metrics.idempotent_replays.inc()
    return _response(answer, replayed)


def _lifecycle_tid(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    return task_id_for(check_key(key)) if key is not None else None


def _timeout(value: float | None) -> float | None:
    if value is not None and not (0 < value <= 24 * 3600):
        raise InvalidArgumentError(f"timeout_s must be a positive number of seconds up to 86400, got {value!r}")
    return value


def _split_tags(values: list[str]) -> list[str] | None:
    tags = [t.strip() for v in values for t in v.split(",") if t.strip()]
    return tags or None


def _once(field: str, in_query: Any, in_body: Any, default: Any) -> Any:
    """A vLLM route's parameter from its query string or its JSON body; both is ambiguous."""
    if in_query is not None and in_body is not None:
        raise ApiError(
            422,
            f"{field} is given both in the query string and in the JSON body; give it once",
            kind="InvalidArgumentError",
            extra={"fields": [f"query.{field}", f"body.{field}"]},
        )
    return in_query if in_query is not None else in_body if in_body is not None else default


def _check_sleep_mode(mode: str) -> None:
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


# A stage in these states has memory released, or is releasing or restoring it: vLLM's
# is_sleeping stays true until every tag is back and the weights are valid again.
NOT_AWAKE_STATES = frozenset({"DRAINING", "TRANSITIONING", "SLEEPING", "WAKING", "PARTIAL", "NEEDS_RELOAD"})
NO_CACHE_RESET = (
    "not served: no protocol command reaches a runner's prefix cache; a sleep that releases "
    "kv_cache empties it (POST /sleep?tags=kv_cache&mode=wait, then POST /wake_up?tags=kv_cache)"
)


def _decimal_version(text: str) -> int:
    """SGLang's weight_version is a string; omni-core's versions are monotonic integers."""
    if not (text.isascii() and text.isdigit() and 0 < len(text) <= 19 and int(text) >= 1):
        raise ApiError(
            422,
            f"weight_version {text[:40]!r} is not a decimal integer >= 1 (at most 19 digits); "
            "omni-core's weights versions are monotonic integers",
            kind="RequestValidationError",
            extra={"fields": ["weight_version"]},
        )
    return int(text)


def _collective(
    names: list[str], dtypes: list[str], shapes: list[list[int]], fields: tuple[str, str, str]
) -> CollectiveSource:
    """An anchor's three parallel lists as the broadcast's typed source, decoded strictly."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ApiError(
            422,
            f"{', '.join(fields)} must be lists of one length (got {len(names)}, {len(dtypes)}, "
            f"{len(shapes)}): entry i describes tensor i",
            kind="RequestValidationError",
            extra={"fields": list(fields)},
        )
    tensors = [{"name": n, "dtype": d, "shape": sh} for n, d, sh in zip(names, dtypes, shapes, strict=True)]
    try:
        return msgspec.convert({"type": "collective", "tensors": tensors}, CollectiveSource, strict=True)
    except msgspec.ValidationError as exc:
        raise ApiError(
            422,
            f"{'/'.join(fields)} refused: {exc} (tensors[i] is entry i of the lists)",
            kind="RequestValidationError",
            extra={"fields": list(fields)},
        ) from None


def not_awake(stage_status: dict[str, Any]) -> bool:
    """Whether a stage (as Engine.status gives it) has anything asleep, or invalid weights."""
    return (
        stage_status.get("state") in NOT_AWAKE_STATES
        or bool(stage_status.get("asleep_tags"))
        or stage_status.get("weights_valid") is False
    )


def _known_query_only(request: Request) -> None:
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


# ====================================================================== the app


# The method label comes from this set, never from the request: a client choosing the
# label text could create series without end (one per made-up method).
KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"})


def method_label(method: str) -> str:
    return method if method in KNOWN_METHODS else "other"


class _HttpMetrics:
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
            metrics.http_requests.labels(route, method, str(code)).inc()
            metrics.http_duration.labels(route, method).observe(time.perf_counter() - started)


def create_app(engine: Engine | None, config: OmniConfig, *, api_key: str | None = None) -> FastAPI:
    """The ASGI app. `engine` is owned by the caller (started before, shut down after)."""
    state = ServeState(engine, config, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        poller = asyncio.ensure_future(state.poll_forever()) if engine is not None else None
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
        dependencies=[Depends(_known_query_only)],
        responses=m.EVERY_ROUTE_ERRORS,
        description="HTTP control plane of omni-core: stage lifecycle (sleep, wake, reload, restart), "
        "requests, vLLM- and vLLM-Omni-compatible routes, Prometheus metrics and a live "
        "status page. Errors: README.md, 'Serving over HTTP'.",
    )
    app.state.serve = state

    def require_key(request: Request) -> None:
        if not state.key_check.accepts(request.headers.get("authorization")):
            state.metrics.http_auth_failures.inc()
            raise ApiError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the "
                "server was given (api_key_file or its environment variable)",
                kind="Unauthorized",
                headers={"WWW-Authenticate": "Bearer"},
            )

    control = [Depends(require_key)]
    health_deps = [] if state.server.public_health else control
    metrics_deps = [] if state.server.public_metrics else control

    # ------------------------------------------------------------------ error rendering

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _response(error_answer(exc))

    @app.exception_handler(OmniCoreError)
    async def _engine_error(request: Request, exc: OmniCoreError) -> Response:
        return _response(error_answer(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return _response(
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
        return _response(
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
        return _response(
            _answer(
                exc.status_code,
                {"error": {"code": exc.status_code, "type": kind, "message": str(message)}},
                headers.items(),
            ),
        )

    # ------------------------------------------------------------------ public

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> HTMLResponse:
        return HTMLResponse(
            STATUS_PAGE_HTML, headers={"Cache-Control": "no-store", "Content-Security-Policy": STATUS_PAGE_CSP}
        )

    @app.get(
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

    @app.get(
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

    @app.get(
        "/v1/stages",
        dependencies=control,
        response_model=m.StagesModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def list_stages() -> Response:
        snap = state.build_snapshot(await state.status())
        return JSONResponse({"stages": list(snap["stages"].values())})

    @app.get(
        "/v1/stages/{name}",
        dependencies=control,
        response_model=m.StageModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def get_stage(name: str) -> Response:
        state.stage_name(name)
        status = await state.status()
        return JSONResponse(state.stage_view(state.names.index(name), name, status.get(name)))

    @app.get(
        "/v1/status",
        dependencies=control,
        tags=["omni-core"],
        description="The status page's data: every stage, rank memory, recent lifecycle events",
    )
    async def status_snapshot() -> Response:
        return Response(dumps(await state.refresh()), media_type=JSON)

    @app.get(
        "/v1/events",
        dependencies=control,
        tags=["omni-core"],
        response_class=StreamingResponse,
        description="Server-sent events: `status` (a snapshot like GET /v1/status) and `lifecycle` (one "
        "call's outcome). The first message is a snapshot.",
    )
    async def events() -> StreamingResponse:
        queue: asyncio.Queue = asyncio.Queue(maxsize=SSE_QUEUE_MESSAGES)
        state.subscribers.add(queue)

        async def stream() -> AsyncIterator[bytes]:
            try:
                yield b"retry: 1000\nevent: status\ndata: " + dumps(state.snapshot) + b"\n\n"
                while not state.closing.is_set():
                    try:
                        kind, data = await asyncio.wait_for(queue.get(), SSE_KEEPALIVE_S)
                    except asyncio.TimeoutError:
                        yield b": keep-alive\n\n"
                        continue
                    if kind is None:
                        return
                    yield f"event: {kind}\ndata: ".encode() + dumps(data) + b"\n\n"
            finally:
                state.subscribers.discard(queue)

        return StreamingResponse(
            stream(), media_type="text/event-stream", headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
        )

    def lifecycle_work(
        name: str, command: str, call: Callable[[], Any], level: int | None = None
    ) -> Callable[[], Awaitable[Answer]]:
        async def work() -> Answer:
            try:
                report = await state.lifecycle(name, command, call, level=level)
            except Exception as exc:
                return error_answer(exc, name)
            return _answer(200, report_json(report))

        return work

    @app.post(
        "/v1/stages/{name}/sleep",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def sleep(name: str, request: Request, body: m.SleepBody | None = None) -> Response:
        body = body or m.SleepBody()
        state.stage_name(name)
        engine, tid, timeout_s = state.require_engine(), _lifecycle_tid(request), _timeout(body.timeout_s)
        call = functools.partial(
            engine.sleep,
            name,
            body.level,
            body.tags,
            task_id=tid,
            timeout_s=timeout_s,
            abort_in_flight=body.abort_in_flight,
        )
        work = lifecycle_work(name, "sleep", call, body.level)
        return await run_post(state, request, "/v1/stages/{name}/sleep", work)

    @app.post(
        "/v1/stages/{name}/wake",
        dependencies=control,
        response_model=m.LifecycleReportModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
    )
    async def wake(name: str, request: Request, body: m.WakeBody | None = None) -> Response:
        body = body or m.WakeBody()
        state.stage_name(name)
        engine, tid, timeout_s = state.require_engine(), _lifecycle_tid(request), _timeout(body.timeout_s)
        call = functools.partial(engine.wake, name, body.tags, task_id=tid, timeout_s=timeout_s)
        return await run_post(state, request, "/v1/stages/{name}/wake", lifecycle_work(name, "wake", call))

    @app.post(
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
        engine, tid, timeout_s = state.require_engine(), _lifecycle_tid(request), _timeout(body.timeout_s)
        call = functools.partial(engine.reload_weights, name, source, task_id=tid, timeout_s=timeout_s)
        return await run_post(state, request, "/v1/stages/{name}/reload", lifecycle_work(name, "reload", call))

    @app.post(
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
        engine, tid, timeout_s = state.require_engine(), _lifecycle_tid(request), _timeout(body.timeout_s)
        call = functools.partial(
            engine.update_weights, name, source, version=body.version, task_id=tid, timeout_s=timeout_s
        )
        work = lifecycle_work(name, "update", call)
        return await run_post(state, request, "/v1/stages/{name}/update_weights", work)

    @app.post(
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
        engine, tid, timeout_s = state.require_engine(), _lifecycle_tid(request), _timeout(body.timeout_s)
        call = functools.partial(
            engine.swap,
            out_stage,
            in_stage,
            level=body.level,
            tags=body.tags,
            task_id=tid,
            timeout_s=timeout_s,
            memory_wait_s=body.memory_wait_s,
        )

        async def work() -> Answer:
            try:
                report = await state.swap(out_stage, in_stage, call, body.level)
            except Exception as exc:
                return error_answer(exc)
            return _answer(200, swap_json(report))

        return await run_post(state, request, "/v1/swap", work)

    @app.post(
        "/v1/stages/{name}/restart",
        dependencies=control,
        response_model=m.RestartModel,
        responses=m.ERROR_RESPONSES,
        tags=["omni-core"],
        description="Fresh rank processes under a new epoch. With an Idempotency-Key, a retry while the "
        "key is kept (idempotency_entries) returns the first answer without restarting "
        "again.",
    )
    async def restart(name: str, request: Request) -> Response:
        state.stage_name(name)
        engine = state.require_engine()

        async def work() -> Answer:
            try:
                await state.lifecycle(name, "restart", functools.partial(engine.restart, name))
                state.forget(name)
                state.metrics.restarts.labels(name).inc()
                st = (await state.status())[name]
            except Exception as exc:
                return error_answer(exc, name)
            return _answer(200, {"stage": name, "state": st["state"], "epoch": st["epoch"]})

        return await run_post(state, request, "/v1/stages/{name}/restart", work)

    @app.post(
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
            state.poke()
            return _answer(200, {"stage": name, "admission": body.policy})

        return await run_post(state, request, "/v1/stages/{name}/admission", work)

    @app.post(
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
        engine, timeout_s = state.require_engine(), _timeout(body.timeout_s)
        budget_s = (timeout_s or state.specs[name].request_timeout_s) + WAIT_GRACE_S

        async def work() -> Answer:
            try:
                future = asyncio.wrap_future(engine.submit(name, body.payload, timeout_s=timeout_s))
                try:
                    output = await asyncio.wait_for(asyncio.shield(future), budget_s)
                except asyncio.TimeoutError:
                    raise OmniCoreError(
                        f"no answer from the orchestrator within {budget_s:.1f} s; its deadlines "
                        "should have fired: this is a bug, please report it"
                    ) from None
                answer = _answer(200, {"stage": name, "output": output})
            except Exception as exc:
                answer = error_answer(exc, name)
            if answer.status == 504:
                state.metrics.deadlines.labels(name, "request").inc()
            state.metrics.requests.labels(name, _outcome(answer.status)).inc()
            return answer

        return await run_post(state, request, "/v1/stages/{name}/execute", work)

    # ------------------------------------------------------------------ vLLM-compatible

    async def on_targets(
        names: list[str], command: str, make_call: Callable[[str], Callable[[], Any]], level: int | None = None
    ) -> tuple[dict[str, Any], Answer | None]:
        """Run one lifecycle command on several stages at once; the first error (in config
        order) becomes the answer, with every stage's outcome beside it."""
        outcomes = await asyncio.gather(
            *(state.lifecycle(n, command, make_call(n), level=level) for n in names), return_exceptions=True
        )
        per_stage: dict[str, Any] = {}
        first_error: Answer | None = None
        for name, outcome in zip(names, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                err = to_http(outcome, stage=name)
                per_stage[name] = err.body
                if first_error is None:
                    first_error = Answer(err.status, b"", tuple(err.headers.items()))
            else:
                per_stage[name] = report_json(outcome)
        if first_error is not None:
            first_body = next(v for v in per_stage.values() if "error" in v)
            body = dict(first_body, stages=per_stage)
            return per_stage, Answer(first_error.status, dumps(body), first_error.headers)
        return per_stage, None

    def on_many(
        names: list[str],
        command: str,
        make_call: Callable[[str], Callable[[], Any]],
        shape: Callable[[dict[str, Any]], Any],
        level: int | None = None,
    ) -> Callable[[], Awaitable[Answer]]:
        """The work of an anchor's route: one command on several stages, answered in the
        anchor's shape (`shape` of the reports per stage) or with the first error."""

        async def work() -> Answer:
            per_stage, error = await on_targets(names, command, make_call, level)
            return error or _answer(200, shape(per_stage))

        return work

    def sleep_call(
        level: int, tags: list[str] | None, tid: str | None, abort_in_flight: bool = False
    ) -> Callable[[str], Callable[[], Any]]:
        engine = state.require_engine()
        return lambda n: functools.partial(engine.sleep, n, level, tags, task_id=tid, abort_in_flight=abort_in_flight)

    def wake_call(tags: list[str] | None, tid: str | None) -> Callable[[str], Callable[[], Any]]:
        engine = state.require_engine()
        return lambda n: functools.partial(engine.wake, n, tags, task_id=tid)

    def woken_shape(names: list[str], tags: list[str] | None) -> Callable[[dict[str, Any]], Any]:
        def shape(per_stage: dict[str, Any]) -> Any:
            # RUNNING and PAUSED are the states with every tag resident and the weights valid.
            awake = all(r["state"] in ("RUNNING", "PAUSED") for r in per_stage.values())
            woken = tags or sorted({t for n in names for t in state.specs[n].tags})
            return {"status": "awake" if awake else "sleeping", "tags_woken": woken, "stages": per_stage}

        return shape

    @app.post(
        "/sleep",
        dependencies=control,
        response_model=m.VllmSleepModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
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
        chosen_level = _once("level", level, body.level, 1)
        chosen_mode = _once("mode", mode, body.mode, "abort")
        chosen_tags = _once("tags", _split_tags(tags or []), body.tags or None, None)
        _check_sleep_mode(chosen_mode)
        names = state.targets()
        work = on_many(
            names,
            "sleep",
            sleep_call(chosen_level, chosen_tags, _lifecycle_tid(request), chosen_mode == "abort"),
            lambda per: {"status": "sleeping", "level": chosen_level, "mode": chosen_mode, "stages": per},
            chosen_level,
        )
        return await run_post(state, request, "/sleep", work)

    @app.post(
        "/wake_up",
        dependencies=control,
        response_model=m.VllmWakeModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description='vLLM\'s wake_up: ?tags=weights (repeatable, or comma-separated) or {"tags": '
        '["weights"]} wakes part of the memory; neither: every tag asleep',
    )
    async def vllm_wake(
        request: Request, body: m.VllmWakeBody | None = None, tags: Annotated[list[str] | None, Query()] = None
    ) -> Response:
        body = body or m.VllmWakeBody()
        chosen_tags = _once("tags", _split_tags(tags or []), body.tags or None, None)
        names = state.targets()
        work = on_many(names, "wake", wake_call(chosen_tags, _lifecycle_tid(request)), woken_shape(names, chosen_tags))
        return await run_post(state, request, "/wake_up", work)

    @app.get(
        "/is_sleeping",
        dependencies=control,
        response_model=m.IsSleepingModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="true until every tag of the default stage (or of every stage) is back and its weights "
        "are valid: SLEEPING, PARTIAL, NEEDS_RELOAD and the transitions between them are asleep",
    )
    async def vllm_is_sleeping() -> Response:
        status = await state.status()
        return JSONResponse({"is_sleeping": any(not_awake(status[n]) for n in state.targets())})

    from omni_core.serve.pause_routes import add_pause_routes  # it imports this module's helpers

    add_pause_routes(app, state, control, lifecycle_work, on_many)

    @app.post(
        "/reset_prefix_cache",
        dependencies=control,
        responses=m.NOT_SERVED_RESPONSES,
        tags=["vLLM"],
        description="Not served (501): see docs/http_routes.md",
    )
    async def vllm_reset_prefix_cache(reset_running_requests: bool = False, reset_external: bool = False) -> Response:
        raise ApiError(501, NO_CACHE_RESET, kind="NotServed")

    @app.post(
        "/collective_rpc",
        dependencies=control,
        response_model=m.CollectiveRpcModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="Only method 'reload_weights' (kwargs: optional 'source', checked against "
        "allowed_reload_sources); any other method would run caller-named code on the "
        "ranks",
    )
    async def vllm_collective_rpc(request: Request, body: m.CollectiveRpcBody) -> Response:
        if body.method != "reload_weights":
            raise ApiError(
                400,
                f"collective_rpc method {body.method!r} is not served; only 'reload_weights' is "
                "(any other would run caller-named code on the ranks)",
                kind="InvalidArgumentError",
            )
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
        engine, tid, names, timeout_s = (
            state.require_engine(),
            _lifecycle_tid(request),
            state.targets(),
            _timeout(body.timeout),
        )
        work = on_many(
            names,
            "reload",
            lambda n: functools.partial(engine.reload_weights, n, source, task_id=tid, timeout_s=timeout_s),
            lambda per: {"results": list(per.values())},
        )
        return await run_post(state, request, "/collective_rpc", work)

    # ------------------------------------------------------------------ vLLM-Omni-compatible

    def omni_shape(per_stage: dict[str, Any]) -> dict[str, Any]:
        """vLLM-Omni's answer: SUCCESS and one OmniACK-shaped entry per rank; a stage that had
        nothing to do (ALREADY, answered without asking its ranks) gets one with rank null."""
        acks: list[dict[str, Any]] = []
        for name, report in per_stage.items():
            stage_id = state.names.index(name)
            ranks = list(report["ranks"].values()) or [
                {"rank": None, "status": report["status"], "freed_bytes": 0, "state": report["state"]}
            ]
            acks.extend(
                {
                    "task_id": report["task_id"],
                    "status": rr["status"],
                    "stage_id": stage_id,
                    "rank": rr["rank"],
                    "freed_bytes": rr["freed_bytes"],
                    "metadata": {"stage": name, "state": rr["state"]},
                }
                for rr in ranks
            )
        return {"status": "SUCCESS", "acks": acks, "stages": per_stage}

    @app.post(
        "/v1/omni/sleep",
        dependencies=control,
        response_model=m.OmniLifecycleModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM-Omni"],
        description='vLLM-Omni\'s sleep: {"stage_ids": [0, 1], "level": 2}; stage_ids required and not '
        "empty, level 2 unless given (its OmniSleepRequest)",
    )
    async def omni_sleep(request: Request, body: m.OmniSleepBody) -> Response:
        names = state.stage_list(body.stage_ids)
        work = on_many(
            names, "sleep", sleep_call(body.level, body.tags, _lifecycle_tid(request)), omni_shape, body.level
        )
        return await run_post(state, request, "/v1/omni/sleep", work)

    @app.post(
        "/v1/omni/wakeup",
        dependencies=control,
        response_model=m.OmniLifecycleModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM-Omni"],
        description='vLLM-Omni\'s wake-up: {"stage_ids": [0]}; SKIPPED when none of them sleeps',
    )
    async def omni_wake(request: Request, body: m.OmniWakeBody) -> Response:
        names = state.stage_list(body.stage_ids)
        wake = on_many(names, "wake", wake_call(body.tags, _lifecycle_tid(request)), omni_shape)

        async def work() -> Answer:
            try:
                status = await state.status()
            except Exception as exc:
                return error_answer(exc)
            if not any(not_awake(status[n]) for n in names):
                return _answer(
                    200,
                    {
                        "status": "SKIPPED",
                        "acks": [],
                        "stages": {},
                        "message": f"none of the stages {names} sleeps; nothing was woken",
                    },
                )
            return await wake()

        return await run_post(state, request, "/v1/omni/wakeup", work)

    # ------------------------------------------------------------------ SGLang-compatible

    def sglang_work(
        command: str,
        names: list[str],
        make_call: Callable[[str], Callable[[], Any]],
        done: str,
        level: int | None = None,
        **extra: Any,
    ) -> Callable[[], Awaitable[Answer]]:
        """SGLang's answer, {"success", "message"} (and `extra`), on errors too (beside omni-core's
        error)."""

        async def work() -> Answer:
            per_stage, error = await on_targets(names, command, make_call, level)
            if error is None:
                return _answer(200, {"success": True, "message": done, **extra, "stages": per_stage})
            body = json.loads(error.body)
            return Answer(
                error.status, dumps(dict(body, success=False, message=body["error"]["message"])), error.headers
            )

        return work

    @app.post(
        "/release_memory_occupation",
        dependencies=control,
        response_model=m.SglangMemoryModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description='SGLang\'s release on the default stage (or every stage): {"tags": ["kv_cache"]} '
        "or no body (every tag). In-flight requests finish first. level (omni-core's "
        "addition): 1 keeps the weights in host memory, 2 discards them. POST only: a GET "
        "that frees memory could be sent by any web page.",
    )
    async def sglang_release(request: Request, body: m.SglangReleaseBody | None = None) -> Response:
        body = body or m.SglangReleaseBody()
        names, tags = state.targets(), body.tags or None
        work = sglang_work(
            "sleep",
            names,
            sleep_call(body.level, tags, _lifecycle_tid(request)),
            f"released {tags or 'every tag'} of {names} (level {body.level})",
            body.level,
        )
        return await run_post(state, request, "/release_memory_occupation", work)

    @app.post(
        "/resume_memory_occupation",
        dependencies=control,
        response_model=m.SglangMemoryModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description='SGLang\'s resume: {"tags": ["weights"]} or no body (every tag asleep)',
    )
    async def sglang_resume(request: Request, body: m.SglangMemoryBody | None = None) -> Response:
        body = body or m.SglangMemoryBody()
        names, tags = state.targets(), body.tags or None
        work = sglang_work(
            "wake", names, wake_call(tags, _lifecycle_tid(request)), f"resumed {tags or 'every tag asleep'} of {names}"
        )
        return await run_post(state, request, "/resume_memory_occupation", work)

    @app.post(
        "/update_weights_from_disk",
        dependencies=control,
        response_model=m.SglangUpdateModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description='SGLang\'s update from disk on the default stage (or every stage): {"model_path", '
        '"weight_version"}; weight_version is required (a decimal integer above the '
        "stage's), model_path must lie under allowed_reload_sources. In-flight requests finish "
        "first (abort_all_requests: false only).",
    )
    async def sglang_update_from_disk(request: Request, body: m.SglangUpdateFromDiskBody) -> Response:
        if body.load_format not in (None, "safetensors"):
            raise ApiError(
                400,
                f"load_format {body.load_format!r} is not read here; the ranks read safetensors "
                "checkpoints: send null or 'safetensors'",
                extra={"fields": ["load_format"]},
            )
        if body.abort_all_requests:
            raise ApiError(
                400,
                "abort_all_requests true is not served: an update drains in-flight requests; send "
                "false, or abort them first with POST /sleep?mode=abort",
                extra={"fields": ["abort_all_requests"]},
            )
        version, source = _decimal_version(body.weight_version), state.weight_source(body.model_path)
        names, tid = state.targets(), _lifecycle_tid(request)
        work = sglang_work(
            "update",
            names,
            update_call(source, version, tid),
            f"updated {names} to weights version {version} from {body.model_path}",
            num_paused_requests=0,
        )
        return await run_post(state, request, "/update_weights_from_disk", work)

    def update_call(source: WeightSource, version: int, tid: str | None) -> Callable[[str], Callable[[], Any]]:
        engine = state.require_engine()
        return lambda n: functools.partial(engine.update_weights, n, source, version=version, task_id=tid)

    def group_call(
        address: str, port: int, world_size: int, rank_offset: int, backend: str | None, group: str, tid: str | None
    ) -> Callable[[str], Callable[[], Any]]:
        engine = state.require_engine()
        # vLLM's init_info names no backend (its server's config does): NCCL on a GPU stage, gloo else.
        return lambda n: functools.partial(
            engine.init_weight_group,
            n,
            address=address,
            port=port,
            world_size=world_size,
            rank_offset=rank_offset,
            backend=backend or ("nccl" if state.specs[n].device.startswith("cuda") else "gloo"),
            group=group,
            task_id=tid,
        )

    @app.post(
        "/init_weight_transfer_engine",
        dependencies=control,
        response_model=m.VllmMessageModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description='vLLM\'s weight-transfer init on the default stage (or every stage): {"init_info": '
        "{master_address, master_port, rank_offset, world_size}}; every rank joins the "
        "trainer's group (NCCL on a GPU stage, gloo on CPU). Then POST /update_weights.",
    )
    async def vllm_init_weight_transfer(request: Request, body: m.VllmInitWeightTransferBody) -> Response:
        info, names = body.init_info, state.targets()
        make = group_call(
            info.master_address,
            info.master_port,
            info.world_size,
            info.rank_offset,
            None,
            "weights",
            _lifecycle_tid(request),
        )
        work = on_many(
            names, "weight-group", make, lambda per: {"message": "Weight transfer initialized", "stages": per}
        )
        return await run_post(state, request, "/init_weight_transfer_engine", work)

    @app.post(
        "/update_weights",
        dependencies=control,
        response_model=m.VllmMessageModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's weight update over the group /init_weight_transfer_engine set up: "
        '{"update_info": {names, dtype_names, shapes, packed: false}, "version": N}; the '
        "trainer broadcasts each tensor whole, in order. `version` is omni-core's addition and "
        "required. ipc_handles_pickled is not taken: a pickle from the network runs code; send "
        "an ipc source to POST /v1/stages/{name}/update_weights instead.",
    )
    async def vllm_update_weights(request: Request, body: m.VllmUpdateWeightsBody) -> Response:
        info = body.update_info
        if info.packed:
            raise ApiError(
                400,
                "update_info.packed true is not served: the ranks take each tensor broadcast whole, "
                "in order; send packed: false",
                extra={"fields": ["update_info.packed"]},
            )
        source = _collective(
            info.names,
            info.dtype_names,
            info.shapes,
            ("update_info.names", "update_info.dtype_names", "update_info.shapes"),
        )
        names = state.targets()
        work = on_many(
            names,
            "update",
            update_call(source, body.version, _lifecycle_tid(request)),
            lambda per: {"message": "Weights updated", "stages": per},
        )
        return await run_post(state, request, "/update_weights", work)

    @app.post(
        "/init_weights_update_group",
        dependencies=control,
        response_model=m.SglangResultModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's weight-group init on the default stage (or every stage): master_address, "
        "master_port, rank_offset, world_size, group_name, backend (nccl or gloo).",
    )
    async def sglang_init_group(request: Request, body: m.SglangInitGroupBody) -> Response:
        if body.backend not in ("nccl", "gloo"):
            raise ApiError(
                400,
                f"backend {body.backend!r} is not served; send 'nccl' (GPU) or 'gloo' (CPU)",
                extra={"fields": ["backend"]},
            )
        names = state.targets()
        make = group_call(
            body.master_address,
            body.master_port,
            body.world_size,
            body.rank_offset,
            body.backend,
            body.group_name,
            _lifecycle_tid(request),
        )
        work = sglang_work("weight-group", names, make, f"{names} joined weight group {body.group_name!r}")
        return await run_post(state, request, "/init_weights_update_group", work)

    @app.post(
        "/update_weights_from_distributed",
        dependencies=control,
        response_model=m.SglangResultModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's update by broadcast over the group /init_weights_update_group set up: names, "
        "dtypes, shapes (parallel lists, each tensor whole, in order) and weight_version "
        "(required here: a decimal integer above the stage's).",
    )
    async def sglang_update_from_distributed(request: Request, body: m.SglangUpdateFromDistributedBody) -> Response:
        version = _decimal_version(body.weight_version)
        source = _collective(body.names, body.dtypes, body.shapes, ("names", "dtypes", "shapes"))
        names = state.targets()
        work = sglang_work(
            "update",
            names,
            update_call(source, version, _lifecycle_tid(request)),
            f"updated {names} to weights version {version} by broadcast",
        )
        return await run_post(state, request, "/update_weights_from_distributed", work)

    @app.post(
        "/update_weights_from_tensor",
        dependencies=control,
        responses=m.NOT_SERVED_RESPONSES,
        tags=["SGLang"],
        description="Not served (501): see docs/http_routes.md",
    )
    async def sglang_update_from_tensor() -> Response:
        raise ApiError(
            501,
            "update_weights_from_tensor is not served: its serialized_named_tensors are pickles, "
            "and unpickling bytes from the network runs code. Share the tensors with "
            "omni_core.weights_sender.WeightSender (CUDA IPC or shared memory) and POST its source "
            "to /v1/stages/{name}/update_weights (or Engine.update_weights)",
            kind="NotServed",
        )

    @app.post(
        "/flush_cache",
        dependencies=control,
        responses=m.NOT_SERVED_RESPONSES,
        tags=["SGLang"],
        description="Not served (501): see docs/http_routes.md",
    )
    async def sglang_flush_cache(timeout: float = 0.0) -> Response:
        raise ApiError(501, NO_CACHE_RESET, kind="NotServed")

    # The last added is outermost: metrics see every answer, 413s included; the body limit
    # still runs before any route reads a byte.
    app.add_middleware(
        BodyLimit, max_body_bytes=state.server.max_body_bytes, on_refused=state.metrics.http_body_refused.inc
    )
    policy = BrowserPolicy(state.server.host, state.server.allowed_hosts, state.server.allowed_origins)
    app.add_middleware(
        BrowserGuard, policy=policy, on_refused=lambda reason: state.metrics.http_refused.labels(reason).inc()
    )
    app.add_middleware(_HttpMetrics, state=state)
    return app
