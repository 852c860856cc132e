"""Prometheus metrics of `omni-core serve` (`GET /metrics`). Every name is documented in
README.md ("Serving over HTTP", Metrics); `tests/serve/test_metrics.py` checks that the
README lists exactly the families this module exports.

Two sources: what the server sees happen (lifecycle calls through it, requests, HTTP), kept
in ordinary counters and histograms; and the engine's own view (`Engine.status()`, polled),
exported by a collector at scrape time from the latest snapshot.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from omni_core.protocol import StageState
from omni_core.serve.adapter_metrics import adapter_families

# `*_created` series (one per labelled child) double what a scrape carries and nothing here reads
# them; prometheus_client only offers a process-wide switch.
disable_created_metrics()

# vLLM's sleep_mode_operation_duration_seconds spans 0.01-600 s; the control plane on CPU
# answers in milliseconds, so the low end starts finer.
LIFECYCLE_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
HTTP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's engine_sleep_state values
# vLLM's sleep-mode operation metrics (`vllm/entrypoints/serve/dev/sleep/metrics.py`): its
# operations and its buckets, so a vLLM dashboard's queries over them read omni-core's too.
VLLM_SLEEP_OPERATIONS = ("sleep", "release_kv_cache_memory", "wake")
VLLM_SLEEP_BUCKETS_S = (0.01, 0.1, 1.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
VLLM_OPERATION_OF = {"sleep": "sleep", "wake": "wake"}  # omni-core's command -> vLLM's operation
STAGE_STATES = tuple(s.value for s in StageState)
LABEL_CHARS = 64  # a label value a rank reports (its state, its memory source) is cut to this


def vllm_sleep_state(state: str, weights_valid: bool) -> str | None:
    """vLLM's sleep_state for a stage state: awake when serving (RUNNING: every tag resident,
    weights valid), weights_offloaded while asleep with the weights kept on the host (level 1),
    discard_all while the weights are discarded (level 2, until reloaded); None in transitions,
    FAILED and STOPPED, which vLLM has no value for."""
    if state in ("RUNNING", "PAUSED"):  # a pause releases nothing (vLLM's pause leaves it too)
        return "awake"
    if state in ("SLEEPING", "PARTIAL", "NEEDS_RELOAD"):
        return "weights_offloaded" if weights_valid else "discard_all"
    return None


class ServeMetrics:
    """One registry per app, so two servers (or tests) in a process never share counters."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lifecycle_duration = Histogram(
            "omni_core_lifecycle_duration_seconds",
            "Sleep, wake, reload and restart calls through the server, "
            "from call to answer, by stage, command and outcome",
            ["stage", "command", "outcome"],
            buckets=LIFECYCLE_BUCKETS_S,
            registry=r,
        )
        self.swap_duration = Histogram(
            "omni_core_swap_duration_seconds",
            "Swaps through the server (one stage sleeps while another wakes), "
            "from call to answer, by outgoing stage, incoming stage and outcome",
            ["out_stage", "in_stage", "outcome"],
            buckets=LIFECYCLE_BUCKETS_S,
            registry=r,
        )
        self.lifecycle_in_flight = Gauge(
            "omni_core_lifecycle_operations_in_flight",
            "Lifecycle calls through the server not yet answered",
            ["stage"],
            registry=r,
        )
        self.freed_bytes = Counter(
            "omni_core_freed_bytes",
            "Pool bytes released by sleeps, summed over ranks, by stage and tag",
            ["stage", "tag"],
            registry=r,
        )
        self.restored_bytes = Counter(
            "omni_core_restored_bytes",
            "Pool bytes brought back by wakes and reloads, summed over ranks",
            ["stage", "tag"],
            registry=r,
        )
        self.requests = Counter(
            "omni_core_requests",
            "Execute requests through the server by stage and outcome (ok, rejected, "
            "conflict, invalid, failed, deadline, ...)",
            ["stage", "outcome"],
            registry=r,
        )
        self.deadlines = Counter(
            "omni_core_deadlines_fired",
            "Deadlines that ended a call through the server (HTTP 504), by stage and kind (request, lifecycle)",
            ["stage", "kind"],
            registry=r,
        )
        self.restarts = Counter("omni_core_stage_restarts", "Stage restarts through the server", ["stage"], registry=r)
        self.http_requests = Counter(
            "omni_core_http_requests",
            "HTTP requests answered, by route template, method and status code",
            ["route", "method", "code"],
            registry=r,
        )
        self.http_duration = Histogram(
            "omni_core_http_request_duration_seconds",
            "HTTP request latency by route template",
            ["route", "method"],
            buckets=HTTP_BUCKETS_S,
            registry=r,
        )
        self.http_in_flight = Gauge("omni_core_http_requests_in_flight", "HTTP requests being handled", registry=r)
        self.http_disconnects = Counter(
            "omni_core_http_client_disconnects",
            "Clients that went away before their answer; the call still ran to its end and was counted",
            ["route"],
            registry=r,
        )
        self.http_auth_failures = Counter(
            "omni_core_http_auth_failures", "Requests refused for a missing or wrong API key (401)", registry=r
        )
        self.http_refused = Counter(
            "omni_core_http_requests_refused",
            "Requests refused before any route ran: a foreign Host (403), a "
            "foreign Origin on a state-changing route (403), a body that is not JSON there (415), by reason",
            ["reason"],
            registry=r,
        )
        self.http_connections_open = Gauge("omni_core_http_connections_open", "HTTP connections held", registry=r)
        self.http_connections_closed = Counter(
            "omni_core_http_connections_closed",
            "Connections the server closed on its own: read_timeout (the "
            "request did not arrive within read_timeout_s), limit_evicted (the oldest not busy with a request, to "
            "make room at max_connections), limit_refused (full of busy connections), client_evicted and "
            "client_refused (the same at one peer's max_connections_per_client)",
            ["reason"],
            registry=r,
        )
        self.http_body_refused = Counter(
            "omni_core_http_body_too_large", "Requests refused for a body above max_body_bytes (413)", registry=r
        )
        self.idempotent_replays = Counter(
            "omni_core_idempotent_replays",
            "Requests answered from the Idempotency-Key record, not run again",
            registry=r,
        )
        self.vllm_sleep_duration = Histogram(
            "vllm:sleep_mode_operation_duration_seconds",
            "vLLM's name: the duration of one sleep-mode operation (a stage's sleep or wake through "
            "the server, whatever its outcome), by operation",
            ["operation"],
            buckets=VLLM_SLEEP_BUCKETS_S,
            registry=r,
        )
        self.vllm_sleep_in_flight = Gauge(
            "vllm:sleep_mode_operations_in_flight",
            "vLLM's name: sleep-mode operations being awaited, by operation",
            ["operation"],
            registry=r,
        )
        for operation in VLLM_SLEEP_OPERATIONS:  # every series exists from the first scrape, as vLLM's
            self.vllm_sleep_in_flight.labels(operation).set(0)
        r.register(_EngineCollector(snapshot))

    @contextlib.contextmanager
    def vllm_operation(self, command: str) -> Iterator[None]:
        """Count a lifecycle command under vLLM's sleep-mode metrics when it is one of vLLM's
        operations (a sleep or a wake); anything else passes untouched."""
        operation = VLLM_OPERATION_OF.get(command)
        if operation is None:
            yield
            return
        active, started = self.vllm_sleep_in_flight.labels(operation), time.perf_counter()
        active.inc()
        try:
            yield
        finally:
            active.dec()
            self.vllm_sleep_duration.labels(operation).observe(time.perf_counter() - started)


class _EngineCollector(Collector):
    """The engine's state as of the latest status snapshot (polled every status_poll_interval_s)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list:
        return []  # families depend on the snapshot; nothing to check at registration

    def collect(self) -> Iterator[Any]:
        snap = self._snapshot()
        stages: dict[str, Any] = snap.get("stages", {})
        state = GaugeMetricFamily(
            "omni_core_stage_state", "1 for the stage's current lifecycle state", labels=["stage", "state"]
        )
        sleep_state = GaugeMetricFamily(
            "omni_core_engine_sleep_state",
            "vLLM's engine_sleep_state: 1 for the stage's current value "
            "(awake, weights_offloaded, discard_all); all 0 in transitions, FAILED, STOPPED",
            labels=["stage", "sleep_state"],
        )
        # The same values under vLLM's own name and labels, so a vLLM dashboard finds them: each
        # stage is one of vLLM's engines (model_name: the stage's name from the config; engine:
        # its index, as vLLM-Omni's stage_ids). No label comes from a request.
        vllm_sleep = GaugeMetricFamily(
            "vllm:engine_sleep_state",
            "vLLM's engine sleep state, one engine per stage: awake = 1 while the "
            "stage serves; weights_offloaded = 1 after a level-1 sleep; discard_all = 1 after a level-2 one",
            labels=["model_name", "engine", "sleep_state"],
        )
        epoch = GaugeMetricFamily(
            "omni_core_stage_epoch", "The stage's epoch (grows by one per restart)", labels=["stage"]
        )
        version = GaugeMetricFamily(
            "omni_core_weights_version",
            "The weights version the stage committed last (P-17; 0: as loaded at start)",
            labels=["stage"],
        )
        queued = GaugeMetricFamily(
            "omni_core_requests_queued", "Requests waiting in the stage's queue", labels=["stage"]
        )
        in_flight = GaugeMetricFamily(
            "omni_core_requests_in_flight",
            "Requests sent to the ranks, not yet answered by all of them",
            labels=["stage"],
        )
        stage_events = CounterMetricFamily(
            "omni_core_stage_protocol_events",
            "The stage core's counters: replies ignored as stale, unknown or "
            "duplicate, ACKs without a memory report, task retries",
            labels=["stage", "event"],
        )
        rank_up = GaugeMetricFamily("omni_core_rank_up", "1 while the rank process is alive", labels=["stage", "rank"])
        rank_state = GaugeMetricFamily(
            "omni_core_rank_state", "1 for the rank's last known worker state", labels=["stage", "rank", "state"]
        )
        pool = GaugeMetricFamily(
            "omni_core_pool_bytes",
            "Bytes resident in each tagged pool of a rank, as of its Hello or its last lifecycle report",
            labels=["stage", "rank", "tag"],
        )
        process = GaugeMetricFamily(
            "omni_core_rank_process_memory_bytes",
            "The rank process's own device memory after its last "
            "lifecycle command (NVML per process; `source` names the fallback)",
            labels=["stage", "rank", "source"],
        )
        rss = GaugeMetricFamily(
            "omni_core_rank_resident_memory_bytes",
            "The rank process's host resident set (RSS), read from /proc",
            labels=["stage", "rank"],
        )
        host = GaugeMetricFamily(
            "omni_core_host_offloaded_bytes",
            "Weights bytes a level-1 sleep moved to host memory and no wake has brought back, per rank",
            labels=["stage", "rank"],
        )
        runner = CounterMetricFamily(
            "omni_core_runner_events",
            "The runner's own counters per rank (a prompt cache's hits, misses, stale entries "
            "dropped, evictions): `counter` is one of the names the rank's Hello declared",
            labels=["stage", "rank", "counter"],
        )
        for name, stage in stages.items():
            for s in STAGE_STATES:
                state.add_metric([name, s], 1.0 if stage["state"] == s else 0.0)
            current = vllm_sleep_state(stage["state"], stage.get("weights_valid", True))
            for s in SLEEP_STATES:
                sleep_state.add_metric([name, s], 1.0 if current == s else 0.0)
                vllm_sleep.add_metric([name, str(stage.get("stage_id", 0)), s], 1.0 if current == s else 0.0)
            epoch.add_metric([name], stage.get("epoch", 0))
            version.add_metric([name], stage.get("weights_version", 0))
            queued.add_metric([name], stage.get("queued", 0))
            in_flight.add_metric([name], stage.get("in_flight", 0))
            for event, value in sorted(stage.get("counters", {}).items()):
                stage_events.add_metric([name, event], value)
            own_tags = set(stage.get("tags", ()))
            for rank, info in stage.get("ranks", {}).items():
                labels = [name, str(rank)]
                rank_up.add_metric(labels, 1.0 if info.get("alive") else 0.0)
                rank_state.add_metric([*labels, str(info.get("state", "-"))[:LABEL_CHARS]], 1.0)
                # A rank's report names its tags: only the stage's own become label values.
                by_tag: dict[str, float] = {}
                for tag, value in info.get("pool_bytes", {}).items():
                    label = tag if tag in own_tags else "other"
                    by_tag[label] = by_tag.get(label, 0) + value
                for tag, value in sorted(by_tag.items()):
                    pool.add_metric([*labels, tag], value)
                if info.get("process_bytes") is not None:
                    source = str(info.get("process_bytes_source", "none"))[:LABEL_CHARS]
                    process.add_metric([*labels, source], info["process_bytes"])
                if info.get("rss_bytes") is not None:
                    rss.add_metric(labels, info["rss_bytes"])
                host.add_metric(labels, info.get("host_offloaded_bytes", 0))
                for counter, value in sorted(info.get("runner_counters", {}).items()):
                    runner.add_metric([*labels, counter], value)  # names from the Hello: a closed set
        engine_events = CounterMetricFamily(
            "omni_core_engine_protocol_events",
            "What strangers and faulty peers tried, each refused and counted: "
            "undecodable replies (bad_replies), unknown peers, forged Hellos, rebinds refused, rank mismatches, "
            "late results, send failures, CURVE refusals",
            labels=["event"],
        )
        for event, value in sorted(snap.get("engine", {}).items()):
            engine_events.add_metric([event], value)
        up = GaugeMetricFamily("omni_core_engine_up", "1 while the engine answers status calls")
        up.add_metric([], 1.0 if snap.get("engine_up") else 0.0)
        yield from (
            state,
            sleep_state,
            vllm_sleep,
            epoch,
            version,
            queued,
            in_flight,
            stage_events,
            rank_up,
            rank_state,
            pool,
            process,
            rss,
            host,
            runner,
            engine_events,
            up,
        )
        yield from adapter_families(stages)
