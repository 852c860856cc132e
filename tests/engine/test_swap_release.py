"""A swap's outgoing stage keeps its memory until its last copy only when the incoming stage
fits beside it (Sleep.incoming_bytes), end to end on CPU: two stages on one simulated device,
their ranks running a portable backend that logs each sleep's choice
(tests/engine/release_backend.py)."""

from __future__ import annotations

import json
import os

from omni_core.workers.simulated_device import SimulatedDevice

from .conftest import PROBE, MiB, small_spec

BACKEND = "tests.engine.release_backend:ReleaseRecordingBackend"


def choices(log) -> list[bool]:
    return [e["release_late"] for e in map(json.loads, log.read_text().splitlines())] if log.exists() else []


def test_the_outgoing_stage_releases_late_only_when_the_incoming_stage_fits(engine_factory, tmp_path, monkeypatch):
    log = tmp_path / "sleeps.jsonl"
    monkeypatch.setenv("OMNI_TEST_RELEASE_LOG", str(log))
    device = SimulatedDevice(str(tmp_path / "gpu0"), 64 * MiB)  # room for both stages many times over
    specs = [small_spec(name, backend=BACKEND, simulated_device=device) for name in ("talker", "decoder")]
    engine = engine_factory(*specs)
    decoder_output = engine.execute("decoder", PROBE)
    engine.sleep("decoder")  # a plain sleep: nothing incoming, released as it copies
    engine.swap("talker", "decoder", task_id="fits")
    assert choices(log) == [False, True]  # the decoder fits beside the talker: the talker releases late
    assert engine.execute("decoder", PROBE) == decoder_output

    # A third process leaves half of what the talker needs: it must wait for the decoder's
    # memory, so the decoder releases each allocation as its copy lands.
    talker_bytes = engine.status()["talker"]["ranks"][0]["pool_bytes"]
    incoming = sum(talker_bytes.values())
    device.write("trainer", 0, os.getpid(), device.free_bytes() - incoming // 2)
    try:
        engine.swap("decoder", "talker", task_id="waits", memory_wait_s=20.0)
    finally:
        device.remove("trainer", 0, os.getpid())
    assert choices(log) == [False, True, False]
    assert engine.status()["talker"]["state"] == "RUNNING"
