"""Step-wise diffusion requests of several callers stepped together: one denoiser call per step
over the batch, each request surviving a level-1 sleep, each result the one it has alone."""

from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

from omni_core.protocol import Capability, Execute, Result, WorkerState
from omni_core.runners import diffusers_runner
from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.diffusers_runner import DiffusersRunner, RequestLostError
from omni_core.runners.diffusion_trajectory import from_wire
from tests.workers._harness import TestOrchestrator

from .conftest import CPU, Pools
from .test_diffusers_runner import DIT, DPM_SOLVER, SD, runner_in_pools

DDPM = {"steps": 6}
# A UNet's convolutions and group norms on CPU round differently at another batch size: the
# latents of a request stepped in a batch of three differ from its own run by up to 4.2e-6
# (DDPM) and 5.3e-5 on latents of magnitude 52 (SD), i.e. < 1e-5 of the latents' largest
# magnitude, measured. DiT's linear layers and attention give the same bits at any batch size.
UNET_RELATIVE_TOLERANCE = 1e-5


def count_calls(module: torch.nn.Module) -> list[int]:
    """The batch size of every forward call of `module`, from now on."""
    rows: list[int] = []
    module.register_forward_pre_hook(lambda _module, args, kwargs: rows.append(len(args[0])), with_kwargs=True)
    return rows


def start_three(runner, request: dict, *, trajectory: bool = False) -> list[str]:
    """Three requests of different seeds and lengths, so their steps sit at different timesteps."""
    payloads = [{"op": "start", **request, "seed": s, "steps": 6 + s, "trajectory": trajectory} for s in range(3)]
    return [runner.execute(p)["request_id"] for p in payloads]


def alone(runner, request: dict, *, trajectory: bool = False) -> list[dict]:
    return [runner.execute({**request, "seed": s, "steps": 6 + s, "trajectory": trajectory}) for s in range(3)]


def test_a_dit_batch_makes_one_transformer_call_per_step_and_stays_bit_exact(checkpoints):
    pools = runner_in_pools(checkpoints["dit"], scheduler=DPM_SOLVER)
    runner = pools.runner
    wanted = [out["sha256"] for out in alone(runner, DIT)]
    ids = start_three(runner, DIT)
    rows = count_calls(runner.modules["transformer"])
    progress = runner.execute_batch(
        [{"op": "step", "request_id": i, "steps": n} for i, n in zip(ids, (2, 3, 1), strict=True)]
    )
    assert [p["steps_done"] for p in progress] == [2, 3, 1]
    # Three steps for the longest; each guided request adds its two rows while it steps.
    assert rows == [6, 4, 2]
    pools.sleep(1)
    assert pools.backend.usage()["requests"] == 0
    pools.wake()
    rows.clear()
    outputs = runner.execute_batch([{"op": "finish", "request_id": i} for i in ids])
    assert [out["sha256"] for out in outputs] == wanted
    assert rows[0] == 6 and len(rows) == 8 - 1  # the longest request's remaining steps
    assert runner.requests == {}


@pytest.mark.parametrize(("family", "scheduler", "request_"), [("ddpm", None, DDPM), ("sd", DPM_SOLVER, SD)])
def test_a_unet_batch_survives_a_level1_sleep_within_tolerance(family, scheduler, request_, checkpoints):
    pools = runner_in_pools(checkpoints[family], scheduler=scheduler)
    runner = pools.runner
    wanted = alone(runner, request_, trajectory=True)
    ids = start_three(runner, request_, trajectory=True)
    rows = count_calls(runner.modules["unet"])
    runner.execute_batch([{"op": "step", "request_id": i, "steps": 2} for i in ids])
    assert len(rows) == 2 and rows[0] == sum(2 if family == "sd" else 1 for _ in ids)
    pools.sleep(1)
    pools.wake()
    outputs = runner.execute_batch([{"op": "finish", "request_id": i} for i in ids])
    for own, batched in zip(wanted, outputs, strict=True):
        expected, got = (from_wire(out["trajectory"]["latents"][-1]) for out in (own, batched))
        assert torch.allclose(got, expected, rtol=0, atol=UNET_RELATIVE_TOLERANCE * float(expected.abs().max()))
        assert batched["trajectory"]["timesteps"] == own["trajectory"]["timesteps"]


def test_one_request_of_a_batch_failing_leaves_the_others(checkpoints):
    pools = runner_in_pools(checkpoints["dit"])
    runner = pools.runner
    wanted = runner.execute({**DIT, "steps": 4})["sha256"]
    first = runner.execute({"op": "start", **DIT, "steps": 4})["request_id"]
    second = runner.execute({"op": "start", **DIT, "steps": 4})["request_id"]
    outputs = runner.execute_batch(
        [
            {"op": "step", "request_id": first, "steps": 1},
            {"op": "step", "request_id": "r999"},
            {"op": "step", "request_id": second, "steps": 0},
            {"op": "finish", "request_id": first},  # the same request twice: one after the other
        ]
    )
    assert outputs[0] == {"request_id": first, "steps_done": 1, "steps_total": 4}
    assert isinstance(outputs[1], ValueError) and "unknown request_id 'r999'" in str(outputs[1])
    assert isinstance(outputs[2], ValueError) and "steps must be an int >= 1" in str(outputs[2])
    assert outputs[3]["sha256"] == wanted
    assert runner.execute({"op": "finish", "request_id": second})["sha256"] == wanted


def test_a_batch_whose_denoiser_call_fails_ends_every_request_in_it(checkpoints, monkeypatch):
    pools = runner_in_pools(checkpoints["dit"])
    runner = pools.runner
    ids = [runner.execute({"op": "start", **DIT, "seed": s})["request_id"] for s in (1, 2)]

    def broken(*_args):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(diffusers_runner, "run_together", broken)
    outputs = runner.execute_batch([{"op": "step", "request_id": i} for i in ids])
    assert all(isinstance(out, RuntimeError) for out in outputs)
    monkeypatch.undo()
    for request_id in ids:  # half a step ran: continuing would give a wrong image
        with pytest.raises(RequestLostError, match="its step op failed"):
            runner.execute({"op": "step", "request_id": request_id})


def test_a_rank_declares_step_mode_and_its_loaded_weights_and_batches_waiting_steps(checkpoints):
    orch = TestOrchestrator()
    try:
        args = {"model": str(checkpoints["dit"]), "max_requests": 4, "cpu_threads": 1}
        tags = ("weights", "kv_cache", "requests")
        worker = orch.spawn(0, runner="diffusers", runner_args=args, tags=tags, batch_max_requests=4)
        dummy = orch.spawn(1, runner="diffusers", runner_args={**args, "load_format": "dummy"}, tags=tags)
        hello = orch.wait_hello(worker)
        assert Capability.STEP_MODE in hello.capabilities
        reference = DiffusersRunner(CPU, **args)
        reference.load_weights()
        assert hello.loaded_weights == tuple(sorted(reference.weight_specs()))
        dummy_hello = orch.wait_hello(dummy)
        assert Capability.STEP_MODE in dummy_hello.capabilities and dummy_hello.loaded_weights == ()
        assert dummy_hello.state is WorkerState.NEEDS_RELOAD  # random weights serve nothing until an update

        def execute(payload: dict, name: str) -> Result:
            reply = orch.request(worker, Execute(task_id=name, epoch=0, payload=payload))
            assert isinstance(reply, Result), reply
            return reply

        alone = [execute({**DIT, "seed": s, "steps": 4}, f"alone-{s}").output["sha256"] for s in range(3)]
        ids = [
            execute({"op": "start", **DIT, "seed": s, "steps": 4}, f"start-{s}").output["request_id"] for s in range(3)
        ]
        before = execute({"op": "cancel", "request_id": execute({"op": "start", **DIT}, "x").output["request_id"]}, "c")
        # Stopped, the rank finds the three requests waiting on its socket together: one batch.
        os.kill(worker.process.pid, signal.SIGSTOP)
        try:
            for i in ids:
                orch.send(worker, Execute(task_id=f"finish-{i}", epoch=0, payload={"op": "finish", "request_id": i}))
        finally:
            os.kill(worker.process.pid, signal.SIGCONT)
        results = {reply.task_id: reply for reply in (orch.next_message(worker) for _ in ids)}
        assert [results[f"finish-{i}"].output["sha256"] for i in ids] == alone
        calls = max(r.runner_counters["denoiser_calls"] for r in results.values())
        assert calls - before.runner_counters["denoiser_calls"] == 4  # four steps, each one call for all three
    finally:
        orch.close()


def test_a_dummy_load_reads_no_weight_file_and_a_reload_fills_the_weights(checkpoints, tmp_path):
    shutil.copytree(checkpoints["dit"], tmp_path / "dit")
    for weights_file in (tmp_path / "dit").rglob("*.safetensors"):
        weights_file.unlink()  # configs only: a load that read a weight would fail
    dummy = DiffusersRunner(CPU, model=str(tmp_path / "dit"), load_format="dummy")
    dummy.load_weights()
    again = DiffusersRunner(CPU, model=str(tmp_path / "dit"), load_format="dummy")
    again.load_weights()
    assert dummy.loaded_weights() == frozenset()
    real = runner_in_pools(checkpoints["dit"]).runner
    assert real.loaded_weights() == frozenset(real.weight_specs())
    assert dummy.weight_specs() == real.weight_specs()  # the same model, other values
    named, twin = dummy.weights_to_share(), again.weights_to_share()
    assert all(torch.equal(named[n], twin[n]) for n in named)  # seeded: two loads agree
    assert not all(torch.equal(named[n], t) for n, t in real.weights_to_share().items())
    with pytest.raises(ValueError, match="load_format must be one of"):
        DiffusersRunner(CPU, model=str(checkpoints["dit"]), load_format="pt")
    pools = Pools(dummy, ("weights", "kv_cache", "requests"))
    with pytest.raises(RunnerArgumentError, match=r"holds no \*.safetensors file"):
        pools.reload()  # the own directory holds no weights to read
    pools.reload(str(checkpoints["dit"]))
    assert dummy.execute(dict(DIT))["sha256"] == real.execute(dict(DIT))["sha256"]
