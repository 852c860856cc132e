"""A server just started knows what each rank holds: its Hello carries its pools' bytes, so
/v1/stages, the status snapshot (the page's chart) and the metrics show them before any
lifecycle call."""

from __future__ import annotations

from .conftest import SMALL_RUNNER, make_config, metric_value, serving, stage_table, wait_for


def test_a_server_just_started_answers_each_ranks_pool_bytes() -> None:
    with serving(make_config(stage_table("fresh", ranks=2))) as served:
        stage = served.stage("fresh")
        assert stage["state"] == "RUNNING"
        known = {rank: r["pool_bytes"] for rank, r in stage["ranks"].items()}
        assert set(known) == {"0", "1"}
        for pools in known.values():  # the runner's tensors (and its small buffers) as loaded
            assert pools["kv_cache"] == SMALL_RUNNER["kv_bytes"]
            assert SMALL_RUNNER["weights_bytes"] <= pools["weights"] < 2 * SMALL_RUNNER["weights_bytes"]
        listed = served.client.get("/v1/stages").json()["stages"][0]["ranks"]
        assert {rank: r["pool_bytes"] for rank, r in listed.items()} == known

        def exported() -> bool:
            text = served.client.get("/metrics").text
            return all(
                metric_value(text, "omni_core_pool_bytes", stage="fresh", rank=rank, tag=tag) == value
                for rank, pools in known.items()
                for tag, value in pools.items()
            )

        wait_for(exported, what="omni_core_pool_bytes of both ranks from their Hellos")
        snapshot = served.client.get("/v1/status").json()
        assert not any(e["stage"] == "fresh" for e in snapshot["events"])  # no lifecycle call yet
        total = sum(sum(p.values()) for p in known.values())
        assert snapshot["memory_history"]["fresh"][-1][1] == total  # the chart starts at start-up
        # The first sleep finds what the Hellos said, and the figures then follow its reports.
        report = served.client.post("/v1/stages/fresh/sleep", json={"level": 2}).json()
        assert {rank: r["pool_bytes_before"] for rank, r in report["ranks"].items()} == known
        assert served.stage("fresh")["ranks"]["0"]["pool_bytes"] == {"weights": 0, "kv_cache": 0}
