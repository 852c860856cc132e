"""Runner loading by import path, the synthetic runner's determinism, backend selection."""

from __future__ import annotations

import pytest
import torch

from omni_core.runners.base import ModelRunner, load_runner, load_runner_class
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.backends import BackendUnavailable, PortableBackend, select_backend
from omni_testing.faults import FailingWakeBackend, FaultyRunner

CPU = torch.device("cpu")
ARGS = {"weights_bytes": 256 << 10, "tensor_count": 4, "kv_bytes": 32 << 10, "hidden": 32}


def ready(runner: ModelRunner) -> ModelRunner:
    for tag in ("weights", "kv_cache"):
        runner.allocate(tag)
    return runner


def test_runners_by_name_and_import_path():
    assert load_runner_class("synthetic") is SyntheticRunner
    assert load_runner_class("omni_testing.faults:FaultyRunner") is FaultyRunner
    runner = load_runner("synthetic", CPU, {"seed": 3, **ARGS})
    assert isinstance(runner, SyntheticRunner) and runner.seed == 3


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_pkg.mod:Runner", "cannot import module 'no_such_pkg.mod'"),
        ("omni_core.runners.synthetic:Nope", "has no attribute 'Nope'"),
        ("omni_core.runners.synthetic", "must look like 'package.module:ClassName'"),
        ("omni_core.runners.synthetic:tensor_bytes", "not a subclass of omni_core.runners.base.ModelRunner"),
        ("omni_core.workers.synthetic:SyntheticRunner", "cannot import module 'omni_core.workers.synthetic'"),
    ],
)
def test_bad_runner_paths_say_what_to_fix(path, message):
    with pytest.raises((ImportError, ValueError, TypeError), match=message):
        load_runner_class(path)


def test_synthetic_output_is_deterministic_and_reads_every_weight():
    a, b = ready(SyntheticRunner(CPU, **ARGS)), ready(SyntheticRunner(CPU, **ARGS))
    payload = {"seed": 9, "batch": 2}
    out = a.execute(payload)
    assert out == b.execute(payload) and out["shape"] == [2, 32] and out["dtype"] == "float32"
    assert a.execute({"seed": 10, "batch": 2})["data"] != out["data"]
    for i in range(len(a.weights)):  # one flipped element in any tensor shows
        with torch.no_grad():
            a.weights[i].view(-1)[-1] += 1.0
        assert a.execute(payload)["data"] != out["data"], i
        a.reload_weights(None)
        assert a.execute(payload)["data"] == out["data"]


def test_synthetic_sizes_and_sources():
    runner = ready(SyntheticRunner(CPU, weights_bytes=1 << 20, tensor_count=8, hidden=64, dtype="bfloat16"))
    assert runner.weights_nbytes == 1 << 20 and len(runner.weights) == 8
    assert runner.weights[0].dtype is torch.bfloat16
    out = runner.execute({"seed": 1, "batch": 1})
    runner.reload_weights("seed:4")  # other weights, same tensors
    assert runner.execute({"seed": 1, "batch": 1})["data"] != out["data"]
    with pytest.raises(ValueError, match="seed:<int>"):
        runner.reload_weights("/path/to/checkpoint")
    with pytest.raises(ValueError, match="batch must be in"):
        runner.execute({"seed": 1, "batch": 0})
    with pytest.raises(TypeError, match="payload must be a dict"):
        runner.execute([1, 2])
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        runner.execute({"seed": 1, "graph": True})
    with pytest.raises(ValueError, match="too small"):
        SyntheticRunner(CPU, weights_bytes=100, tensor_count=8)
    with pytest.raises(ValueError, match="dtype"):
        SyntheticRunner(CPU, dtype="int8")
    with pytest.raises(ValueError, match="no allocation for tag 'activations'"):
        runner.allocate("activations")


def test_faulty_runner_validates_its_fault_points():
    with pytest.raises(ValueError, match="unknown fault point"):
        FaultyRunner(CPU, fail_on=["sleep"])


def test_select_backend():
    assert isinstance(select_backend("auto", CPU), PortableBackend)  # no CUDA here
    assert isinstance(select_backend("portable", "cpu"), PortableBackend)
    assert isinstance(select_backend("omni_testing.faults:FailingWakeBackend", CPU), FailingWakeBackend)
    with pytest.raises(BackendUnavailable, match=r"cumem.*configured for device 'cpu'.*use backend 'portable'"):
        select_backend("cumem", CPU)
    with pytest.raises(BackendUnavailable, match=r"backend 'fast' is unavailable.*configured for device 'cpu'"):
        select_backend("fast", CPU)
    with pytest.raises(BackendUnavailable, match=r"backend 'mmap' is not one of \['auto', "):
        select_backend("mmap", CPU)
    with pytest.raises(TypeError, match=r"not a subclass of omni_core\.workers\.backends\.MemoryBackend"):
        select_backend("omni_testing.faults:FaultyRunner", CPU)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cumem_without_cuda_says_why_and_what_to_do():
    with pytest.raises(BackendUnavailable, match=r"sees no CUDA device.*CUDA build of torch"):
        select_backend("cumem", "cuda")


def test_a_reply_cache_below_the_protocol_minimum_is_refused():
    import msgspec

    from omni_core.fsm.reply_cache import MIN_REPLY_CACHE_ENTRIES
    from omni_core.workers.config import WorkerConfig

    assert WorkerConfig(address="ipc:///x", rank=0, reply_cache_entries=MIN_REPLY_CACHE_ENTRIES)
    for build in (
        lambda: WorkerConfig(address="ipc:///x", rank=0, reply_cache_entries=MIN_REPLY_CACHE_ENTRIES - 1),
        lambda: msgspec.json.decode(b'{"address": "x", "rank": 0, "reply_cache_entries": 4}', type=WorkerConfig),
    ):
        with pytest.raises((ValueError, msgspec.ValidationError), match="latest answers for retries"):
            build()
