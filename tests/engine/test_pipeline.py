"""P-22 end to end on CPU: a request across two stages, each a rank process, the intermediate
moved over shared memory by a transfer, under both stages' lifecycles."""

from __future__ import annotations

import hashlib
import os
import signal

import pytest
import torch

from omni_core.engine import InvalidArgumentError, PipelineError, PipelineStage
from omni_core.fsm import StageBusyError
from omni_core.fsm import inputs as I
from omni_core.protocol import TransferOut
from omni_core.runners.synthetic import SyntheticRunner, tensor_bytes
from tests.engine.conftest import SMALL_RUNNER, rank_pid, small_spec, wait_for

EXPORT = {"seed": 5, "batch": 2}


def reference(seed: int) -> SyntheticRunner:
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=seed))
    runner.load_weights()
    runner.allocate_caches()
    return runner


def by_hand() -> str:
    """The consumer's output for the producer's rows, passed by hand in this process."""
    producer, consumer = reference(len("text")), reference(len("image"))
    hidden = producer.export_tensors(EXPORT, ("hidden",))["hidden"]
    consumer.inbox.put("r", {"hidden": hidden.clone()}, 0)
    return consumer.execute({"transfer": "r"})["sha256"]


def stages(**first: object) -> list[PipelineStage]:
    return [PipelineStage("text", EXPORT, export=("hidden",), **first), PipelineStage("image", {})]  # type: ignore[arg-type]


def test_a_pipeline_equals_the_same_conditioning_passed_by_hand_both_stages_sleeping_around_it(
    engine_factory,
) -> None:
    engine = engine_factory(small_spec("text"), small_spec("image", admission="wake"))
    engine.sleep("image", 1)  # the consumer sleeps: its policy wakes it for the transfer
    result = engine.pipeline(stages(), request_id="p1")
    assert result.output["sha256"] == by_hand() and result.producer_versions == (0,)
    assert engine.status()["image"]["state"] == "RUNNING"
    # The hop is released: the producer sleeps and wakes again, the request runs the same.
    engine.sleep("text", 1)
    engine.sleep("image", 1)
    engine.wake("text")
    assert engine.pipeline(stages(), request_id="p2").output["sha256"] == by_hand()
    digest = hashlib.sha256(tensor_bytes(torch.zeros(1))).hexdigest()
    assert digest != by_hand()


def test_a_request_declared_for_another_producer_version_is_refused_and_released(engine_factory) -> None:
    engine = engine_factory(small_spec("text"), small_spec("image"))
    with pytest.raises(PipelineError, match="declared for producer weights version 3") as refused:
        engine.pipeline(stages(expect_version=3), request_id="p3")
    assert refused.value.producer_version == 0 and refused.value.hop == 0
    engine.sleep("text", 1)  # released: nothing holds the producer awake
    assert engine.status()["text"]["state"] == "SLEEPING"


def test_a_producer_holding_an_export_does_not_sleep(engine_factory) -> None:
    engine = engine_factory(small_spec("text"), small_spec("image"))
    out = TransferOut(task_id="held/out", epoch=0, request_id="held", names=("hidden",), payload=EXPORT)
    report = engine._lifecycle("text", I.CommandCall(out, 10.0))
    assert report.ranks[0].shared is not None
    with pytest.raises((InvalidArgumentError, StageBusyError), match="transfer\\(s\\) in flight"):
        engine.sleep("text", 1)


def test_a_consumer_refusing_the_landing_fails_the_request_once_and_releases(engine_factory) -> None:
    engine = engine_factory(small_spec("text"), small_spec("image", runner_args=dict(SMALL_RUNNER, hidden=64)))
    with pytest.raises(PipelineError, match=r"did not land on stage 'image'.*the connector takes float32"):
        engine.pipeline(stages(), request_id="p4")
    engine.sleep("text", 1)
    assert engine.status()["text"]["state"] == "SLEEPING"


def test_a_dead_consumer_fails_the_request_once_and_the_producer_is_released(engine_factory) -> None:
    engine = engine_factory(small_spec("text"), small_spec("image"))
    os.kill(rank_pid(engine, "image", 0), signal.SIGKILL)
    wait_for(lambda: engine.status()["image"]["state"] == "FAILED", what="the consumer FAILED")
    with pytest.raises(PipelineError, match="the consumer is FAILED") as failed:
        engine.pipeline(stages(), request_id="p5")
    assert failed.value.hop == 0
    engine.sleep("text", 1)  # its export was released
    assert engine.status()["text"]["state"] == "SLEEPING"


def test_a_config_declares_a_pipeline_by_name_and_the_engine_runs_it(engine_factory) -> None:
    from omni_core.config import ConfigError, parse_config

    stage = {"runner": "synthetic", "runner_args": dict(SMALL_RUNNER), "backend": "portable"}
    data = {
        "stages": [{"name": "text", **stage}, {"name": "image", **stage}],
        "pipelines": [{"name": "t2i", "stages": [{"stage": "text", "export": ["hidden"]}, {"stage": "image"}]}],
    }
    config = parse_config(data)
    (route,) = config.pipelines
    assert [hop.stage for hop in route.stages] == ["text", "image"]
    specs = {s.name: s for s in config.stages}
    engine = engine_factory(
        small_spec("text", runner_args=specs["text"].runner_args),
        small_spec("image", runner_args=specs["image"].runner_args),
    )
    both = engine.pipeline(route.request([EXPORT, {}]), request_id="cfg")
    hidden = reference(0).export_tensors(EXPORT, ("hidden",))["hidden"]
    consumer = reference(0)
    consumer.inbox.put("r", {"hidden": hidden}, 0)
    assert both.output["sha256"] == consumer.execute({"transfer": "r"})["sha256"]
    with pytest.raises(ConfigError, match=r"names stages \['dit'\]"):
        parse_config(
            {
                **data,
                "pipelines": [{"name": "x", "stages": [{"stage": "text", "export": ["hidden"]}, {"stage": "dit"}]}],
            }
        )
    with pytest.raises(ConfigError, match="exports nothing to the next"):
        parse_config({**data, "pipelines": [{"name": "x", "stages": [{"stage": "text"}, {"stage": "image"}]}]})
