"""Prometheus metrics follow the lifecycle, and README.md documents exactly the families exported."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import Served, metric_value, wait_for

README = Path(__file__).resolve().parents[2] / "README.md"


pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def _metrics(served: Served) -> str:
    answer = served.client.get("/metrics")
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")
    return answer.text


def _sleep_state(served: Served, stage: str) -> str:
    text = _metrics(served)
    values = [
        s
        for s in ("awake", "weights_offloaded", "discard_all")
        if metric_value(text, "omni_core_engine_sleep_state", stage=stage, sleep_state=s) == 1
    ]
    return values[0] if len(values) == 1 else f"none of them ({values})"


def test_sleep_state_follows_vllm_values(served: Served) -> None:
    # settle() may have just restarted the stage through the engine: the snapshot catches up
    wait_for(lambda: _sleep_state(served, "decoder") == "awake", what="awake")
    served.client.post("/v1/stages/decoder/sleep", json={"level": 1})
    wait_for(lambda: _sleep_state(served, "decoder") == "weights_offloaded", what="weights_offloaded")
    served.client.post("/v1/stages/decoder/wake")
    served.client.post("/v1/stages/decoder/sleep", json={"level": 2})
    wait_for(lambda: _sleep_state(served, "decoder") == "discard_all", what="discard_all after level 2")
    served.client.post("/v1/stages/decoder/wake")
    wait_for(lambda: _sleep_state(served, "decoder") == "discard_all", what="discard_all while NEEDS_RELOAD")
    served.client.post("/v1/stages/decoder/reload")
    wait_for(lambda: _sleep_state(served, "decoder") == "awake", what="awake after reload")


def test_durations_bytes_and_host_memory(served: Served) -> None:
    before = _metrics(served)
    report = served.client.post("/v1/stages/talker/sleep", json={"level": 1}).json()
    weights_bytes = sum(r["pool_bytes_before"]["weights"] for r in report["ranks"].values())
    wait_for(lambda: served.stage("talker")["host_offloaded_bytes"] == weights_bytes, what="host bytes")
    during = _metrics(served)
    assert (
        metric_value(during, "omni_core_freed_bytes_total", stage="talker", tag="weights")
        - metric_value(before, "omni_core_freed_bytes_total", stage="talker", tag="weights")
    ) == weights_bytes
    assert metric_value(during, "omni_core_host_offloaded_bytes", stage="talker") == weights_bytes
    assert metric_value(during, "omni_core_pool_bytes", stage="talker", tag="weights") == 0
    count = "omni_core_lifecycle_duration_seconds_count"
    assert (
        metric_value(during, count, stage="talker", command="sleep", outcome="ok")
        == metric_value(before, count, stage="talker", command="sleep", outcome="ok") + 1
    )
    served.client.post("/v1/stages/talker/wake")
    wait_for(
        lambda: metric_value(_metrics(served), "omni_core_host_offloaded_bytes", stage="talker") == 0,
        what="host bytes back to 0 after the wake",
    )
    after = _metrics(served)
    assert (
        metric_value(after, "omni_core_restored_bytes_total", stage="talker", tag="weights")
        - metric_value(during, "omni_core_restored_bytes_total", stage="talker", tag="weights")
    ) == weights_bytes
    assert metric_value(after, "omni_core_pool_bytes", stage="talker", tag="weights") == weights_bytes


def test_engine_view(served: Served) -> None:
    text = _metrics(served)
    assert metric_value(text, "omni_core_engine_up") == 1
    assert metric_value(text, "omni_core_rank_up", stage="talker") == 2
    assert metric_value(text, "omni_core_stage_state", stage="talker", state="RUNNING") == 1
    assert metric_value(text, "omni_core_rank_resident_memory_bytes", stage="decoder", rank="0") > 0
    events = {
        s.labels["event"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "omni_core_engine_protocol_events_total"
    }
    assert {"bad_replies", "forged_hellos", "unknown_peers"} <= events


def test_vllm_sleep_mode_operation_metrics_count_sleeps_and_wakes_under_vllms_names(served: Served) -> None:
    """vLLM's `vllm:sleep_mode_*` families beside omni-core's: one observation per sleep and
    per wake through the server, none for other calls, every operation's in-flight gauge at 0
    once nothing is awaited."""
    count = "vllm:sleep_mode_operation_duration_seconds_count"
    before = _metrics(served)
    assert all(
        f'vllm:sleep_mode_operations_in_flight{{operation="{op}"}} 0.0' in before
        for op in ("sleep", "release_kv_cache_memory", "wake")
    ), before
    sleeps, wakes = (metric_value(before, count, operation=op) for op in ("sleep", "wake"))
    assert served.client.post("/v1/stages/decoder/sleep", json={"level": 1}).status_code == 200
    assert served.client.post("/v1/stages/decoder/wake").status_code == 200
    assert served.client.post("/v1/stages/decoder/pause", json={"mode": "wait"}).status_code == 200  # not vLLM's
    assert served.client.post("/v1/stages/decoder/resume").status_code == 200
    after = _metrics(served)
    assert metric_value(after, count, operation="sleep") == sleeps + 1
    assert metric_value(after, count, operation="wake") == wakes + 1
    assert metric_value(after, count, operation="release_kv_cache_memory") == 0
    assert metric_value(after, "vllm:sleep_mode_operations_in_flight") == 0
    bucket = metric_value(after, "vllm:sleep_mode_operation_duration_seconds_bucket", operation="sleep", le="600.0")
    assert bucket == sleeps + 1  # vLLM's buckets: its largest bound is 600 s


def _documented() -> set[str]:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("### Metrics") :]
    section = section[: section.index("\n## ", 1)] if "\n## " in section else section
    return set(re.findall(r"`(omni_core_[a-z_]+|vllm:[a-z_]+)`", section))


def test_readme_documents_every_family(served: Served) -> None:
    served.client.post("/v1/stages/decoder/sleep")  # touch the labelled families once
    served.client.post("/v1/stages/decoder/wake")
    exported = {f.name for f in text_string_to_metric_families(_metrics(served))}
    assert exported == _documented(), (
        f"README.md '### Metrics' is out of date; missing: {exported - _documented()}, "
        f"extra: {_documented() - exported}"
    )
