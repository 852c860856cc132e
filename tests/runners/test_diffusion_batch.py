"""Step-wise diffusion requests of several callers stepped together: one denoiser call per step
over the batch, each request surviving a level-1 sleep, each result the one it has alone."""

from __future__ import annotations

import pytest
import torch

from omni_core.runners import diffusers_runner
from omni_core.runners.diffusers_runner import RequestLostError
from omni_core.runners.diffusion_trajectory import from_wire

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
    progress = runner.execute_batch([{"op": "step", "request_id": i, "steps": n} for i, n in zip(ids, (2, 3, 1))])
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
