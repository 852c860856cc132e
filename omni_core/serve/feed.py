"""The status feed: what the server knows of each stage, as one snapshot kept fresh.

The snapshot (GET /v1/status, the first message of GET /v1/events, the metrics and the status
page) joins the engine's status with what the lifecycle reports through this server said of
each rank's memory. Subscribers (event streams) get each new snapshot and each lifecycle
event; every lifecycle event, failure and dead rank also gets one line in the operator's log.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from omni_core.config import ServerConfig
from omni_core.engine import LifecycleReport
from omni_core.engine.spec import StageSpec
from omni_core.serve.logs import EVENT_ATTR
from omni_core.serve.metrics import ServeMetrics

EVENTS_IN_SNAPSHOT = 50
MOVED_WORDS = (("freed_bytes", "freed"), ("restored_bytes", "restored"))  # an event's byte counts, in its log line
# Samples of each stage's device memory kept for the status page's chart: one per lifecycle
# report that changed it, so this many cover hours of ordinary use; the oldest go first.
MEMORY_SAMPLES_KEPT = 120
# /health answers 503 while a stage is in one of these (vLLM and SGLang answer 503 when their
# engine is dead, so a probe restarts or routes around it); a sleeping stage is healthy.
UNHEALTHY_STATES = frozenset({"FAILED", "STOPPED"})
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


def _summed(per_rank: Iterable[dict[str, int]]) -> dict[str, int]:
    """The runner counters of a stage: each name summed over its ranks."""
    total: dict[str, int] = {}
    for values in per_rank:
        for name, value in values.items():
            total[name] = total.get(name, 0) + value
    return dict(sorted(total.items()))


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


class StatusFeed:
    """The snapshot, the lifecycle events, the memory each rank reported, and the subscribers."""

    def __init__(
        self,
        specs: Sequence[StageSpec],
        server: ServerConfig,
        metrics: ServeMetrics,
        status: Callable[[], Awaitable[dict[str, Any]]],
        unanswered: tuple[type[BaseException], ...],
    ) -> None:
        self.specs = {s.name: s for s in specs}
        self.names = [s.name for s in specs]
        self.server = server
        self.metrics = metrics
        self._status = status
        self._unanswered = unanswered  # what a status call raises when the engine cannot answer
        self.memory: dict[str, dict[int, RankMemory]] = {name: {} for name in self.names}
        self.last_level: dict[str, int | None] = dict.fromkeys(self.names)
        self.events: deque[dict[str, Any]] = deque(maxlen=server.events_kept)
        # stage -> [(time, device bytes of its pools over every rank, None: not known)]
        self.memory_history: dict[str, deque[tuple[float, int | None]]] = {
            name: deque(maxlen=MEMORY_SAMPLES_KEPT) for name in self.names
        }
        self.snapshot: dict[str, Any] = {
            "time": time.time(),
            "engine_up": False,
            "engine": {},
            "stages": {},
            "events": [],
            "memory_history": {},
        }
        self.subscribers: set[asyncio.Queue] = set()
        self.closing = asyncio.Event()
        self._refresh: asyncio.Event | None = None
        self._event_ids = itertools.count(1)
        # What the log already said per stage ("state") and per rank: two refreshes may end
        # out of order, and a change must still be one line. One entry per stage and rank.
        self.logged: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------------ memory reports

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
        self._sample_memory(stage, report)

    def _sample_memory(self, stage: str, report: LifecycleReport) -> None:
        """One point of the stage's device memory over time, as the report left it, after the
        point before it (`pool_bytes_before`) where that differs from the last one known: the
        first report (from ranks whose Hello carried no pool bytes), or memory moved by a call
        the server did not see (the Python API)."""
        history, now = self.memory_history[stage], time.time()
        if not any(rr.pool_bytes_before or rr.pool_bytes_after for rr in report.ranks.values()):
            return  # answered without the ranks (ALREADY): nothing measured
        before = sum(sum(rr.pool_bytes_before.values()) for rr in report.ranks.values())
        if not history or history[-1][1] != before:
            history.append((now - report.duration_s, before))
        total = sum(sum(mem.pool_bytes.values()) for mem in self.memory[stage].values())
        if history[-1][1] != total:
            history.append((now, total))

    def forget(self, stage: str) -> None:
        """A restarted stage has fresh ranks: what the old ones reported no longer holds."""
        self.memory[stage] = {}
        self.last_level[stage] = None
        self.memory_history[stage].append((time.time(), None))  # a gap: fresh ranks, nothing measured yet

    # ------------------------------------------------------------------ events

    def record_event(self, stage: str, command: str, outcome: str, duration_s: float, **details: Any) -> None:
        _log_event(self._append_event(stage, command, outcome, duration_s, **details))

    def _append_event(
        self, stage: str, command: str, outcome: str, duration_s: float, **details: Any
    ) -> dict[str, Any]:
        """An event for the page's list and the event stream (the log line is the caller's)."""
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
        return event

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

    # ------------------------------------------------------------------ snapshots

    def stage_view(self, index: int, name: str, st: dict[str, Any] | None) -> dict[str, Any]:
        spec = self.specs[name]
        st = st or {}
        ranks: dict[str, Any] = {}
        for rank, info in (st.get("ranks") or {}).items():
            mem = self.memory[name].get(int(rank), RankMemory())
            # The engine's figure (the rank's Hello, then each ACK it took) where it has one:
            # known from the start, and it follows calls the server did not see.
            pool_bytes = info.get("pool_bytes") or mem.pool_bytes
            ranks[str(rank)] = {
                "pid": info.get("pid"),
                "alive": bool(info.get("alive")),
                "state": str(info.get("state", "-")),
                "pool_bytes": dict(pool_bytes),
                "process_bytes": mem.process_bytes,
                "process_bytes_source": mem.process_bytes_source,
                "rss_bytes": _read_rss_bytes(info.get("pid")) if info.get("alive") else None,
                "host_offloaded_bytes": mem.host_offloaded_bytes,
                "weights_version": info.get("weights_version", 0),
                "runner_counters": dict(info.get("runner_counters") or {}),
            }
        history = self.memory_history[name]
        if ranks and all(r["pool_bytes"] for r in ranks.values()) and (not history or history[-1][1] is None):
            # the ranks' Hellos told their pools: the chart starts at start-up, not at a first call
            history.append((time.time(), sum(sum(r["pool_bytes"].values()) for r in ranks.values())))
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
            "weights_source": st.get("weights_source", "checkpoint"),
            "version_floor": st.get("version_floor", 0),
            "version_reset_from": st.get("version_reset_from"),
            "tags": list(spec.tags),
            "runner": spec.runner,
            "device": spec.device,
            "backend": spec.backend,
            "host_offloaded_bytes": sum(r["host_offloaded_bytes"] for r in ranks.values()),
            "runner_counters": _summed(r["runner_counters"] for r in ranks.values()),
            "ranks": ranks,
            "adapters": list(st.get("adapters") or []),  # P-20: as the stage's rank 0 listed them last
        }

    def build_snapshot(self, status: dict[str, Any] | None) -> dict[str, Any]:
        status = status or {}
        return {
            "time": time.time(),
            "engine_up": bool(status),
            "engine": dict(status.get("_engine") or {}),
            "stages": {name: self.stage_view(i, name, status.get(name)) for i, name in enumerate(self.names)},
            "events": list(self.events)[-EVENTS_IN_SNAPSHOT:],
            "memory_history": {name: [list(p) for p in points] for name, points in self.memory_history.items()},
        }

    async def refresh(self) -> dict[str, Any]:
        try:
            status: dict[str, Any] | None = await self._status()
        except self._unanswered:
            status = None
        previous, self.snapshot = self.snapshot, self.build_snapshot(status)
        for seen in _log_changes(previous, self.snapshot, self.logged):  # the page lists them too
            self._append_event(**seen)
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

    def close_now(self) -> None:
        """End every event stream, so connections can close (on the loop's thread only)."""
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
        moved = "".join(f", {verb} {event[key]} bytes" for key, verb in MOVED_WORDS if event.get(key))
        state = f" -> {event['state']} ({event['status']})" if "state" in event else ""
        if event.get("version_floor") or "version_reset_from" in event:  # a restart that lost a version
            log.warning("%s%s in %s: %s", what, state, took, event.get("detail", ""), extra=extra)
            return
        log.info("%s%s in %s%s", what, state, took, moved, extra=extra)
    else:
        log.warning("%s failed (%s) after %s: %s", what, event["outcome"], took, event.get("error", ""), extra=extra)


def _log_changes(
    before: dict[str, Any], after: dict[str, Any], logged: dict[tuple[str, str], Any]
) -> list[dict[str, Any]]:
    """What the engine did on its own, seen between two status snapshots: a stage that became
    FAILED or STOPPED, a rank process that is gone, the engine no longer answering. `logged`
    holds what was said, so each is said once. Returns the stage failures and rank deaths said,
    as events for the page (`stage_failed`, `rank_gone`, outcome `failed`)."""
    said: list[dict[str, Any]] = []
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
            reason = now.get("failure") or "no reason recorded"
            said.append(_seen(name, "stage_failed", now["state"], f"{reason}; restart it: omni-core restart {name}"))
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
                said.append(_seen(name, "rank_gone", now["state"], f"rank {rank} (pid {info['pid']}) exited"))
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
    return said


def _seen(stage: str, command: str, state: str, error: str) -> dict[str, Any]:
    return {"stage": stage, "command": command, "outcome": "failed", "duration_s": 0.0, "state": state, "error": error}
