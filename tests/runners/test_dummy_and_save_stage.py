"""A transformers stage with load_format 'dummy' and SaveWeights, end to end with real rank
processes: it starts NEEDS_RELOAD at version 0 with weights_source 'dummy', refuses requests
and a reload of its own weights naming why, serves once an update supplies weights; a save of
that version and a restart bring it back at that version with the same tokens, where without
the save it would come back under the NEEDS_RELOAD floor."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file

from omni_core import Engine, StageSpec
from omni_core.engine.errors import InvalidArgumentError, RequestRejectedError
from omni_core.weights_sender import WeightSender

LLM_ARGS = {"max_seq_len": 64, "max_batch": 1, "cpu_threads": 1}
GREEDY = {"prompt_ids": [5, 6, 7, 8, 9], "max_new_tokens": 8, "stop_at_eos": False}
COMMON = {"backend": "portable", "deadline_s": 60.0, "start_deadline_s": 240.0, "request_timeout_s": 60.0}


def _config_only(source: Path, target: Path) -> Path:
    target.mkdir()
    for path in source.iterdir():
        if not path.name.endswith(".safetensors"):
            shutil.copyfile(path, target / path.name)
    return target


@pytest.fixture(scope="module")
def engine(checkpoints, tmp_path_factory):
    config_only = _config_only(checkpoints["qwen2"], tmp_path_factory.mktemp("dummy") / "config-only")
    specs = [
        StageSpec(
            "rollout",
            runner="transformers",
            runner_args={"model": str(config_only), "load_format": "dummy", **LLM_ARGS},
            admission="reject",
            **COMMON,
        ),
        StageSpec(
            "reference", runner="transformers", runner_args={"model": str(checkpoints["qwen2"]), **LLM_ARGS}, **COMMON
        ),
    ]
    engine = Engine(specs)
    yield engine
    engine.shutdown()


def test_a_dummy_stage_waits_for_its_weights_then_a_save_keeps_them_across_a_restart(
    engine: Engine, checkpoints, tmp_path: Path
) -> None:
    status = engine.status()["rollout"]
    assert (status["state"], status["weights_version"], status["weights_source"]) == ("NEEDS_RELOAD", 0, "dummy")
    with pytest.raises(RequestRejectedError, match="started with dummy weights"):
        engine.execute("rollout", GREEDY)
    with pytest.raises(InvalidArgumentError, match="Model reloading with dummy format"):
        engine.reload_weights("rollout")

    expected = engine.execute("reference", GREEDY)["token_ids"]
    with WeightSender(bucket_bytes=1 << 20) as sender:  # the trainer's weights, from memory
        report = engine.update_weights(
            "rollout", sender.share(load_file(checkpoints["qwen2"] / "model.safetensors")), version=2
        )
    assert (report.state, report.weights_version) == ("RUNNING", 2)
    assert engine.execute("rollout", GREEDY)["token_ids"] == expected

    engine.save_weights("rollout", str(tmp_path / "v2"))
    assert engine.status()["rollout"]["weights_source"] == "disk"
    restart = engine.restart("rollout")
    assert (restart.state, restart.weights_version, restart.weights_source) == ("RUNNING", 2, "disk")
    answer = engine.execute("rollout", GREEDY, with_version=True)
    assert (answer.output["token_ids"], answer.weights_version) == (expected, 2)

    again = engine.restart("rollout", from_checkpoint=True)  # back to the dummy weights: says so
    assert (again.state, again.weights_version, again.version_reset_from) == ("NEEDS_RELOAD", 0, 2)
    assert engine.status()["rollout"]["weights_source"] == "dummy"
