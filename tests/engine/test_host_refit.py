"""Refit into a sleeping stage end to end on CPU (Capability.HOST_REFIT): a stage asleep at
level 1 takes an update into its host copies, stays SLEEPING at the new version with nothing
mapped, and its wake serves exactly what a stage started on the new weights serves."""

from __future__ import annotations

import pytest
import torch

from omni_core.engine.errors import InvalidArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, small_spec
from tests.engine.test_weight_updates import new_weights, reference


def started_on(weights: dict[str, torch.Tensor]) -> SyntheticRunner:
    """A stage's model started on `weights`: what the woken stage must compute."""
    runner = reference(seed=1)
    runner.update_weights(weights.items())
    return runner


def test_an_update_into_a_sleeping_stage_stays_asleep_and_its_wake_serves_it(engine_factory) -> None:
    engine = engine_factory(small_spec("r"))
    ref = reference(seed=1)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        engine.sleep("r", 1)
        v1 = new_weights(ref, 21)
        report = engine.update_weights("r", sender.share(v1), version=1)
        assert (report.state, report.weights_version, report.ranks[0].weights_version) == ("SLEEPING", 1, 1)
        # The device untouched: the weights' pool stays released through the update.
        assert report.ranks[0].pool_bytes_after["weights"] == 0
        status = engine.status()["r"]
        assert (status["state"], status["weights_version"]) == ("SLEEPING", 1)
        engine.wake("r")
        served = engine.execute("r", PROBE, with_version=True)
        assert served.weights_version == 1
        assert served.output["sha256"] == started_on(v1).execute(PROBE)["sha256"]
        assert served.output["sha256"] != ref.execute(PROBE)["sha256"]

        # Refused before writing (a wrong shape): still asleep at version 1, and the wake serves v1.
        engine.sleep("r", 1)
        with pytest.raises(InvalidArgumentError, match=r"tensor 'w0' is float32 \[3, 3\]"):
            engine.update_weights("r", sender.share(dict(v1, w0=torch.zeros(3, 3))), version=2)
        assert engine.status()["r"]["state"] == "SLEEPING" and engine.status()["r"]["weights_version"] == 1

    # From disk (the synthetic runner's 'seed:N'): the same as a stage reloaded from that seed.
    assert engine.update_weights("r", "seed:9", version=2).state == "SLEEPING"
    engine.wake("r")
    served = engine.execute("r", PROBE, with_version=True)
    ref.reload_weights("seed:9")
    assert served.weights_version == 2 and served.output["sha256"] == ref.execute(PROBE)["sha256"]


def test_a_level_2_sleep_leaves_no_host_copy_to_update(engine_factory) -> None:
    engine = engine_factory(small_spec("r"))
    engine.sleep("r", 2)
    with pytest.raises(InvalidArgumentError, match="level-2 sleep discarded them"):
        engine.update_weights("r", "seed:9", version=1)
    assert engine.status()["r"]["weights_version"] == 0


def test_a_backend_without_a_reachable_host_copy_is_refused_naming_the_capability(engine_factory) -> None:
    spec = small_spec("r", backend="tests.engine.no_refit_backend:NoHostRefitBackend")
    engine = engine_factory(spec)
    engine.sleep("r", 1)
    with pytest.raises(InvalidArgumentError, match="no 'host_refit' capability"):
        engine.update_weights("r", "seed:9", version=1)
    engine.wake("r")
    assert engine.execute("r", PROBE, with_version=True).weights_version == 0
    assert engine.update_weights("r", "seed:9", version=1).state == "RUNNING"  # awake, it takes it
