"""A wake refused for lack of device memory over HTTP (vLLM's /wake_up): every rank rolled
back, so the answer is 503 naming who holds the memory and the stage stays asleep at its
version, never FAILED; the same route wakes it once the memory is free."""

from __future__ import annotations

import os

from omni_core.workers.simulated_device import SimulatedDevice
from tests.serve.conftest import PROBE, MiB, make_config, serving, stage_table


def test_a_wake_up_refused_for_memory_is_503_and_leaves_the_stage_asleep_at_its_version(tmp_path) -> None:
    device = SimulatedDevice(str(tmp_path / "gpu0"), 5 * MiB)
    table = stage_table("solo", simulated_device={"directory": device.directory, "capacity_bytes": 5 * MiB})
    with serving(make_config(table, default_stage="solo")) as served:
        served.engine.update_weights("solo", "seed:9", version=2)
        before = served.engine.execute("solo", PROBE)
        assert served.client.post("/sleep?level=1&mode=wait").status_code == 200
        device.write("trainer", 0, os.getpid(), device.capacity_bytes - MiB // 2)
        try:
            refused = served.client.post("/wake_up")
            assert refused.status_code == 503, refused.text
            assert f"stage trainer rank 0, pid {os.getpid()}" in refused.text, refused.text
            stage = served.client.get("/v1/stages/solo").json()
            assert (stage["state"], stage["weights_version"]) == ("SLEEPING", 2), stage
        finally:
            device.remove("trainer", 0, os.getpid())
        assert served.client.post("/wake_up").status_code == 200
        assert served.client.get("/v1/stages/solo").json()["state"] == "RUNNING"
        assert served.engine.execute("solo", PROBE) == before
