"""The diffusers runner's prompt-cache counters, end to end: a tiny Stable Diffusion stage in a
rank process declares them in its Hello, its Results carry them, and /v1/stages and /metrics
show them (labels from the declared, closed set)."""

from __future__ import annotations

from tests.serve.conftest import make_config, metric_value, serving, wait_for

from .test_diffusers_runner import SD, SD_SLOT_BYTES, SD_TAGS

NAMES = (
    "denoiser_calls",
    "denoiser_rows",
    "prompt_cache_evictions",
    "prompt_cache_hits",
    "prompt_cache_misses",
    "prompt_cache_stale_dropped",
    "prompt_cache_too_large",
)


def test_prompt_cache_counters_reach_status_and_metrics(checkpoints) -> None:
    table = {
        "name": "sd",
        "runner": "diffusers",
        "tags": list(SD_TAGS),
        "backend": "portable",
        "runner_args": {"model": str(checkpoints["sd"]), "prompt_cache_bytes": SD_SLOT_BYTES, "cpu_threads": 1},
        "deadline_s": 60.0,
        "start_deadline_s": 240.0,
        "request_timeout_s": 60.0,
    }
    with serving(make_config(table)) as served:
        fresh = served.stage("sd")
        assert fresh["ranks"]["0"]["runner_counters"] == dict.fromkeys(NAMES, 0)  # declared by the Hello
        quick = {**SD, "steps": 1}
        for prompt in ("a cat", "a cat", "a dog"):  # a miss, a hit, a miss that evicts (one slot)
            served.engine.execute("sd", {**quick, "prompt": prompt})
        own = served.engine.execute("sd", {"op": "prompt_cache"})
        expected = {
            "denoiser_calls": 3,  # one step each, guided: two rows per call
            "denoiser_rows": 6,
            "prompt_cache_hits": 1,
            "prompt_cache_misses": 2,
            "prompt_cache_evictions": 1,
            "prompt_cache_stale_dropped": 0,
            "prompt_cache_too_large": 0,
        }
        assert (own["hits"], own["misses"], own["evictions"]) == (1, 2, 1)
        stage = served.stage("sd")
        assert stage["ranks"]["0"]["runner_counters"] == expected
        assert stage["runner_counters"] == expected  # summed over the ranks (one here)

        def exported() -> bool:
            text = served.client.get("/metrics").text
            return all(
                metric_value(text, "omni_core_runner_events_total", stage="sd", rank="0", counter=name) == value
                for name, value in expected.items()
            )

        wait_for(exported, what="the runner's counters in /metrics")
