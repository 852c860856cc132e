"""What a rank is started with, declared once: one WorkerConfig builder for every launcher
(each field a rank shares with its StageSpec comes from the spec), and one list of backend
names (omni_core.plugins) for the spec and the worker that selects the backend."""

from __future__ import annotations

import msgspec
import pytest

from omni_core.engine import InvalidArgumentError, StageSpec
from omni_core.engine.ranks import worker_config
from omni_core.plugins import BACKENDS, BUILTIN
from omni_core.workers.config import WorkerConfig

SPEC = StageSpec(
    "talker",
    runner="synthetic",
    runner_args={"weights_bytes": 4096},
    ranks=2,
    backend="portable",
    gpu_memory_fraction=None,
    verify_clean_sleep=True,
    max_frame_bytes=1 << 20,
    profile_dir="/tmp/profiles",
    profile_max_s=30.0,
    tags=("weights", "kv_cache", "requests"),
)


def test_every_field_shared_with_the_stage_spec_comes_from_it() -> None:
    config = worker_config(SPEC, rank=1, epoch=3, address="ipc:///x", trace_path=None, curve=None)
    shared = set(WorkerConfig.__struct_fields__) & set(StageSpec.__struct_fields__)
    assert {
        "runner",
        "runner_args",
        "backend",
        "device",
        "tags",
        "gpu_memory_fraction",
        "verify_clean_sleep",
        "max_frame_bytes",
        "profile_dir",
        "profile_max_s",
        "simulated_device",
    } <= shared
    for name in shared:
        assert getattr(config, name) == getattr(SPEC, name), name
    assert (config.stage, config.rank, config.epoch, config.curve_server_key) == ("talker", 1, 3, None)
    # what crosses to the rank process decodes to the same config
    assert msgspec.json.decode(msgspec.json.encode(config), type=WorkerConfig) == config


def test_what_only_a_launcher_knows_is_its_own() -> None:
    local = worker_config(SPEC, rank=0, epoch=0, address="ipc:///x", trace_path="t.jsonl", curve=None, parent_pid=42)
    ray = worker_config(
        SPEC, rank=0, epoch=0, address="ipc:///x", trace_path="t.jsonl", curve=None, exit_with_parent=False
    )
    assert (local.parent_pid, local.exit_with_parent) == (42, True)
    assert (ray.parent_pid, ray.exit_with_parent) == (None, False)
    assert msgspec.structs.replace(local, parent_pid=None, exit_with_parent=False) == ray


def test_a_stage_takes_every_backend_a_worker_can_select() -> None:
    for name in (*BUILTIN[BACKENDS], "omni_testing.faults:FailingWakeBackend"):
        assert StageSpec("s", backend=name).backend == name
    for name in ("magic", "omni_testing.faults:", ":FailingWakeBackend", 3):
        with pytest.raises(InvalidArgumentError, match="backend"):
            StageSpec("s", backend=name)
