"""The built-in memory-pressure hook (P-16) on its own: what it leaves free, whom it names,
and that it leaves nothing behind (no worker started)."""

from __future__ import annotations

import json
import os

import msgspec
import pytest

from omni_core.conformance import SuiteOptions
from omni_core.conformance.pressure import (
    PRESSURE_STAGE,
    SimulatedPressure,
    pressure_for,
    reference_on_device,
    resolve_pressure,
)
from omni_core.conformance.runner import SuiteRunner
from omni_core.conformance.targets import TargetError
from omni_core.workers.config import WorkerConfig

CAPACITY_BYTES = 1 << 20


def test_squeeze_leaves_what_was_asked_besides_other_holders_and_names_this_process():
    pressure = SimulatedPressure(capacity_bytes=CAPACITY_BYTES)
    try:
        device = pressure.device
        device.write("talker", 0, os.getpid(), 300_000)  # a worker's own file: counted, not squeezed away
        assert pressure.squeeze(100_000) == f"pid {os.getpid()}"
        assert device.free_bytes() == 100_000
        assert pressure.squeeze(5_000) and device.free_bytes() == 5_000  # a second squeeze replaces the first
        assert any(h.label == f"stage {PRESSURE_STAGE} rank 0" for h in device.holders().holders)
        pressure.relieve()
        assert device.free_bytes() == CAPACITY_BYTES - 300_000
        pressure.squeeze(0)
        assert device.free_bytes() == 0
        pressure.squeeze(2 * CAPACITY_BYTES)  # more than is free: holds nothing
        assert device.free_bytes() == CAPACITY_BYTES - 300_000
    finally:
        pressure.close()
    assert not os.path.exists(pressure.directory)


def test_the_reference_worker_runs_on_the_hooks_device():
    pressure = SimulatedPressure()
    try:
        # As the worker process reads it: the JSON the suite passes with --config
        config = msgspec.json.decode(json.dumps(pressure.worker("ipc:///tmp/x.sock", 0, 3)), type=WorkerConfig)
        assert config.simulated_device == pressure.device
        assert reference_on_device("ipc:///tmp/x.sock", 0, 3, pressure.device)["backend"] == "portable"
    finally:
        pressure.close()


def test_only_the_builtin_targets_get_a_builtin_hook_and_a_named_one_wins():
    assert pressure_for("synthetic") is SimulatedPressure and pressure_for("reference") is SimulatedPressure
    assert pressure_for("cmd:./worker {address} {rank}") is None
    assert SuiteRunner("cmd:./w {address} {rank}").pressure_factory is None
    named = SuiteRunner(
        "synthetic", options=SuiteOptions(memory_pressure="omni_core.conformance.pressure:SimulatedPressure")
    )
    assert named.pressure_factory is SimulatedPressure
    with pytest.raises(TargetError, match="memory_pressure must be"):
        resolve_pressure("")
