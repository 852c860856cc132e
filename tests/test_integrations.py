"""The in-process adapters (`omni_core/integrations`): the `collective_rpc` allowlist refuses
every name off its list and every argument its declarations do not take, before anything is
sent; verl's rollout and OpenRLHF's actor each run a 3-step colocated loop (release, train,
push, generate) on a real CPU stage, its outputs equal to the trainer's own model after every
push. verl and OpenRLHF install no CPU build here: their calls are as their sources make them
(`verl/workers/rollout/base.py`; `openrlhf/trainer/ray/vllm_engine.py`, `vllm_worker_wrap.py`,
whose `init_process_group` is SGLang's `init_custom_process_group`, `tests/serve/sglang_trainer.py`)."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from omni_core.engine import Engine
from omni_core.integrations import EXTENSION_METHODS, ExtensionRefusedError, OmniRollout, OpenRLHFActor, StageExtension
from omni_core.protocol import CollectiveSource, IpcSource, ShmSource
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, SMALL_RUNNER, small_spec
from tests.serve.sglang_trainer import init_custom_process_group

STAGE = "rollout"
JOIN_S = 60.0


class RecordingEngine:
    """Stands for `Engine` where only the mapping is under test: every call is recorded."""

    def __init__(self, state: str = "RUNNING") -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.state = state

    def status(self) -> dict[str, Any]:
        return {STAGE: {"state": self.state, "weights_version": 4}}

    def __getattr__(self, name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> str:
            self.calls.append((name, args, kwargs))
            return f"{name} report"

        return call


@pytest.mark.parametrize(
    "method",
    ["execute_model", "_update", "collective_rpc", "__init__", "load_model", "__class__", 7, "update_weights"],
)
def test_collective_rpc_refuses_every_method_off_the_allowlist_and_sends_nothing(method: Any) -> None:
    engine = RecordingEngine()
    with pytest.raises(ExtensionRefusedError, match="not on omni-core's allowlist"):
        StageExtension(engine, STAGE).collective_rpc(method)  # type: ignore[arg-type]
    assert engine.calls == []


@pytest.mark.parametrize(
    ("method", "args", "kwargs", "needle"),
    [
        ("sleep", (), {"level": 1, "mode": "abort"}, "unexpected keyword argument 'mode'"),
        ("update_weight", ("w0",), {}, "missing a required argument: 'dtype'"),
        ("update_weight", ("w0", "float99", [4]), {}, "tensor 'w0' refused"),
        ("init_process_group", ("127.0.0.1", 1, 1, 2, "g"), {"use_ray": True}, "use_ray true is not served"),
        (
            "update_weight_cuda_ipc",
            ("w0", torch.float32, (4,)),
            {"ipc_handles": {0: (print, ("x",))}},
            "runs the caller's function",
        ),
        ("update_weight_cuda_ipc", ("w0", torch.float32, (4,)), {"ipc_handles": None}, "must map one GPU id"),
        ("update_weights_from_ipc", (), {"peft_config": {"r": 8}}, "peft_config is not served"),
        ("update_weights_from_ipc", (), {"source": {"type": "disk", "path": "/x"}}, "not an inter-process bucket"),
        ("update_weights_from_ipc", (), {"source": {"type": "ipc", "buckets": [{"handle": "gASV"}]}}, "source refused"),
        ("reload_weights", (), {}, "needs source="),
    ],
)
def test_allowlisted_methods_refuse_arguments_they_do_not_take(
    method: str, args: tuple[Any, ...], kwargs: dict[str, Any], needle: str
) -> None:
    engine = RecordingEngine()
    with pytest.raises(ExtensionRefusedError) as info:
        StageExtension(engine, STAGE).collective_rpc(method, args, kwargs)
    assert needle in str(info.value), info.value
    assert engine.calls == []


def test_each_allowlisted_method_maps_onto_its_typed_command() -> None:
    engine = RecordingEngine()
    ext = StageExtension(engine, STAGE)
    assert ext.collective_rpc("sleep", (2,)) == ["sleep report"]
    ext.collective_rpc("wake_up", kwargs={"tags": ["weights"]})
    ext.collective_rpc("reset_prefix_cache")
    ext.collective_rpc("init_process_group", ("10.0.0.1", 29500, 1, 3, "openrlhf"), {"backend": "gloo"})
    ext.collective_rpc("update_weight", ("w0", torch.bfloat16, torch.Size([2, 3])))
    ext.collective_rpc("reload_weights", kwargs={"source": "/ckpt/step-9"})
    names = [name for name, _, _ in engine.calls]
    assert names == ["sleep", "wake", "reset_prefix_cache", "init_weight_group", "update_weights", "update_weights"]
    assert engine.calls[0][1] == (STAGE, 2)
    assert engine.calls[3][2] == {
        "address": "10.0.0.1",
        "port": 29500,
        "world_size": 3,
        "rank_offset": 1,
        "backend": "gloo",
        "group": "openrlhf",
    }
    (_, (stage, source), kwargs) = engine.calls[4]
    assert stage == STAGE and kwargs == {"version": 5} and isinstance(source, CollectiveSource)
    assert [(t.name, t.dtype, tuple(t.shape)) for t in source.tensors] == [("w0", "bfloat16", (2, 3))]
    assert engine.calls[5][1][1].path == "/ckpt/step-9"  # a serving stage: a versioned update from disk
    asleep = RecordingEngine(state="NEEDS_RELOAD")
    StageExtension(asleep, STAGE).collective_rpc("reload_weights")
    assert asleep.calls == [("reload_weights", (STAGE, None), {})]
    assert set(EXTENSION_METHODS) <= {name for name in dir(StageExtension) if not name.startswith("_")}


def test_shared_buckets_reach_update_weights_from_ipc_as_the_typed_source() -> None:
    engine = RecordingEngine()
    with WeightSender() as sender:
        shared = sender.share({"w0": torch.ones(4)})
        StageExtension(engine, STAGE).collective_rpc(
            "update_weights_from_ipc", kwargs={"source": msgspec.to_builtins(shared)}
        )
    source = engine.calls[0][1][1]
    assert isinstance(source, ShmSource | IpcSource) and source == shared


# ---------------------------------------------------------------------- the loops


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine([small_spec(STAGE)])
    try:
        yield engine
    finally:
        engine.shutdown()


def _trainer() -> SyntheticRunner:
    """The trainer's copy of the rollout's model (small_spec seeds it with len(name))."""
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len(STAGE)))
    runner.load_weights()
    runner.allocate_caches()
    return runner


def _train(runner: SyntheticRunner, step: int) -> dict[str, torch.Tensor]:
    """One optimizer step's worth of change, the same on every run."""
    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for weight in runner.weights:
            weight.add_(torch.randn(weight.shape, generator=gen, dtype=weight.dtype) * 0.01)
    return {name: tensor.clone() for name, tensor in runner.weights_to_share().items()}


def test_verls_colocated_loop_through_omni_rollout_generates_the_trainers_tokens(engine: Engine) -> None:
    trainer, rollout = _trainer(), OmniRollout(engine, STAGE)

    async def loop() -> list[int]:
        versions = []
        for step in range(1, 4):
            await rollout.release()  # the trainer takes the GPU
            assert engine.status()[STAGE]["state"] == "SLEEPING"
            weights = _train(trainer, step)
            await rollout.resume(["weights"])
            report = await rollout.update_weights(iter(weights.items()), peft_config=None)
            await rollout.resume(["kv_cache"])
            assert rollout.generate_sequences(PROBE)["sha256"] == trainer.execute(PROBE)["sha256"]
            versions.append(report.weights_version)
        return versions

    try:
        start = engine.status()[STAGE]["weights_version"]
        assert asyncio.run(loop()) == [start + 1, start + 2, start + 3]
        with pytest.raises(ExtensionRefusedError, match="peft_config"):
            asyncio.run(rollout.update_weights(iter(()), peft_config={"r": 8}))
    finally:
        rollout.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _beside(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # reported after join
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_openrlhfs_colocated_loop_through_the_actor_generates_the_trainers_tokens(engine: Engine) -> None:
    """OpenRLHF's trainer joins with its init_process_group (SGLang's), then per step: sleep,
    train, wake_up, one update_weight per parameter while it broadcasts that parameter (the
    last through collective_rpc, as the worker extension is reached), reset_prefix_cache."""
    import torch.distributed as dist

    trainer, actor = _trainer(), OpenRLHFActor(engine, STAGE)
    port, group_name = _port(), f"openrlhf-{uuid.uuid4().hex[:8]}"
    joined, group = _beside(
        lambda: init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=0, group_name=group_name
        )
    )
    actor.init_process_group("127.0.0.1", port, 1, 2, group_name, backend="gloo")
    joined.join(JOIN_S)
    assert "value" in group, group
    for step in range(1, 4):
        actor.sleep(level=1)
        weights = _train(trainer, step)
        actor.wake_up()
        names = list(weights)
        for name in names:
            tensor = weights[name]
            if name == names[-1]:
                call = lambda n=name, t=tensor: actor.collective_rpc("update_weight", (n, t.dtype, t.shape))  # noqa: E731
            else:
                call = lambda n=name, t=tensor: actor.update_weight(n, t.dtype, list(t.shape))  # noqa: E731
            updating, result = _beside(call)
            dist.broadcast(tensor, src=0, group=group["value"])
            updating.join(JOIN_S)
            assert "error" not in result, result
        actor.reset_prefix_cache()
        assert actor.generate(PROBE)["sha256"] == trainer.execute(PROBE)["sha256"]
