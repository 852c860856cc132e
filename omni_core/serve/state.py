"""What every route shares: the engine and its thread pools, the config, the idempotency
cache, the metrics and the status feed; and the accounting of each lifecycle call (its time,
its outcome, the memory it moved) whichever route made it.

Every blocking engine call runs on a bounded thread pool; status calls get threads of their
own, so a pool full of long drains never freezes the status page, the metrics or GET
/v1/stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from omni_core.config import OmniConfig
from omni_core.engine import Engine, LifecycleReport, RestartReport, SwapReport
from omni_core.engine.errors import OmniCoreError, SwapFailedError
from omni_core.protocol import DiskSource, WeightSource
from omni_core.serve.access_log import AccessLog
from omni_core.serve.auth import KeyCheck
from omni_core.serve.errors import ApiError, to_http
from omni_core.serve.errors import outcome_label as _outcome
from omni_core.serve.feed import StatusFeed
from omni_core.serve.idempotency import IdempotencyCache
from omni_core.serve.metrics import ServeMetrics
from omni_core.serve.strict import check_path_text, check_wire_value
from omni_core.serve.versions import VersionLabels

STATUS_CALL_TIMEOUT_S = 10.0  # Engine.status answers from the orchestrator loop in ms; this bounds a stuck one


class ServeState:
    """Everything the routes share: the engine, the config, caches, metrics, the status feed."""

    def __init__(self, engine: Engine | None, config: OmniConfig, api_key: str | None) -> None:
        self.engine = engine
        self.config = config
        self.server = config.server
        self.specs = {s.name: s for s in config.stages}
        self.names = [s.name for s in config.stages]
        self.key_check = KeyCheck(api_key)
        self.idempotency = IdempotencyCache(self.server.idempotency_entries, self.server.idempotency_bytes)
        self.executor = ThreadPoolExecutor(max_workers=self.server.lifecycle_threads, thread_name_prefix="omni-serve")
        self.status_executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="omni-serve-status")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = ServeMetrics(lambda: self.feed.snapshot)
        self.access_log = AccessLog() if config.server.access_log else None
        self.feed = StatusFeed(
            config.stages, self.server, self.metrics, self.status, (OmniCoreError, ApiError, asyncio.TimeoutError)
        )
        # The anchors' version labels; the stages a /sleep?level=0 paused (their /wake_up
        # resumes them, as vLLM's wake resumes its scheduler); the stages inside vLLM's
        # /start_weight_update ... /finish_weight_update, each with whether the start paused
        # it. Each is keyed by stage name: bounded by the config.
        self.labels = VersionLabels(self.names)
        self.level0_paused: set[str] = set()
        # LoRA adapters loaded through the anchors' routes (lora_routes.py): name -> path, for
        # /v1/models and SGLang's loaded_adapters; bounded there (MAX_LISTED_PATHS).
        self.lora_paths: dict[str, str] = {}
        self.weight_brackets: dict[str, bool] = {}

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

    # ------------------------------------------------------------------ what a request names

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
        """What vLLM's and SGLang's routes act on: the configured default stage, or every stage."""
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
            with metrics.vllm_operation(command):
                result = await self.blocking(call)
        except BaseException as exc:
            status = to_http(exc).status
            outcome = _outcome(status)
            if status == 504:
                metrics.deadlines.labels(stage, "lifecycle").inc()
            self.feed.record_event(stage, command, outcome, time.perf_counter() - started, error=str(exc), level=level)
            metrics.lifecycle_duration.labels(stage, command, outcome).observe(time.perf_counter() - started)
            raise
        finally:
            metrics.lifecycle_in_flight.labels(stage).dec()
            self.feed.poke()
        elapsed_s = time.perf_counter() - started
        metrics.lifecycle_duration.labels(stage, command, "ok").observe(elapsed_s)
        if isinstance(result, LifecycleReport):
            self.feed.note_report(stage, command, result, level)
            self.feed.record_event(
                stage,
                command,
                "ok",
                elapsed_s,
                state=result.state,
                status=result.status,
                level=level,
                freed_bytes=sum(rr.freed_bytes for rr in result.ranks.values()),
                restored_bytes=sum(rr.restored_bytes for rr in result.ranks.values()),
            )
        elif isinstance(result, RestartReport):  # the event log says what became of the version
            self.feed.record_event(
                stage,
                command,
                "ok",
                elapsed_s,
                state=result.state,
                status="OK",
                weights_version=result.weights_version,
                version_floor=result.version_floor,
                version_reset_from=result.version_reset_from,
                detail=result.detail,
            )
        else:
            self.feed.record_event(stage, command, "ok", elapsed_s, level=level)
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
                self.feed.record_event(
                    out_stage, "swap", _outcome(to_http(exc).status), elapsed_s, error=str(exc), level=level
                )
            raise
        finally:
            for stage in (out_stage, in_stage):
                metrics.lifecycle_in_flight.labels(stage).dec()
            self.feed.poke()
        metrics.swap_duration.labels(out_stage, in_stage, "ok").observe(time.perf_counter() - started)
        self._note_half(out_stage, "sleep", report.outgoing, level, report.duration_s)
        self._note_half(in_stage, "wake", report.incoming, None, report.duration_s)
        return report

    def _note_half(self, stage: str, command: str, half: object, level: int | None, elapsed_s: float) -> None:
        if isinstance(half, LifecycleReport):
            self.feed.note_report(stage, command, half, level)
            self.feed.record_event(
                stage,
                command,
                "ok",
                half.duration_s,
                state=half.state,
                status=half.status,
                level=level,
                swap=half.task_id.rsplit("/", 1)[0],
                freed_bytes=sum(rr.freed_bytes for rr in half.ranks.values()),
                restored_bytes=sum(rr.restored_bytes for rr in half.ranks.values()),
            )
        elif isinstance(half, BaseException):
            self.feed.record_event(
                stage, command, _outcome(to_http(half).status), elapsed_s, error=str(half), level=level
            )

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
                loop.call_soon_threadsafe(self.feed.close_now)
                return
        self.feed.close_now()
