"""Layer-wise offload of the diffusers runner's denoiser: its blocks on the host, streamed through
one slab of the `offload` pool. On CPU the device is the host too, so these tests check the
bookkeeping (what points into the slab when, what each pool holds) and the images; the GPU test
measures the device-memory ceiling."""

from __future__ import annotations

import contextlib

import pytest
import torch

from omni_core.runners.block_offload import OFFLOAD_TAG, denoiser_blocks
from omni_core.runners.diffusers_runner import DiffusersRunner

from .conftest import CPU, Pools
from .test_diffusers_runner import DIT, DPM_SOLVER, SD

OFFLOAD_TAGS = ("weights", OFFLOAD_TAG, "kv_cache", "requests")
PLAIN_TAGS = ("weights", "kv_cache", "requests")
DDPM = {"seed": 1, "steps": 6}


def offloaded(directory, **args) -> Pools:
    return Pools(DiffusersRunner(CPU, model=str(directory), max_requests=4, offload="layerwise", **args), OFFLOAD_TAGS)


def plain(directory, **args) -> Pools:
    return Pools(DiffusersRunner(CPU, model=str(directory), max_requests=4, **args), PLAIN_TAGS)


def in_slab(offload, tensor: torch.Tensor) -> bool:
    start = offload.slab.data_ptr()
    return start <= tensor.data_ptr() < start + offload.slab_bytes


def watch_residency(runner: DiffusersRunner) -> list[int]:
    """During every block's forward: the bytes of streamed tensors that point into the slab;
    and asserts they are that block's alone."""
    offload = runner.offload
    resident_bytes: list[int] = []
    blocks = offload.blocks

    def check(index: int) -> None:
        inside = [[in_slab(offload, s.tensor) for s in block] for block in blocks]
        assert all(inside[index]) and not any(any(other) for i, other in enumerate(inside) if i != index)
        resident_bytes.append(sum(s.host.numel() * s.host.element_size() for s in blocks[index]))

    denoiser = runner.modules["transformer" if runner.kind == "dit" else "unet"]
    for index, module in enumerate(denoiser_blocks(runner.kind, denoiser)[0]):
        module.register_forward_pre_hook(lambda *_, i=index: check(i))  # after the offload's own
    return resident_bytes


@pytest.mark.parametrize(("family", "request_"), [("dit", DIT), ("ddpm", DDPM), ("sd", SD)])
def test_an_offloaded_denoiser_keeps_one_block_on_the_device_and_gives_the_same_image(family, request_, checkpoints):
    reference = plain(checkpoints[family])
    pools = offloaded(checkpoints[family])
    runner = pools.runner
    offload = runner.offload
    sizes = offload.block_bytes()
    assert len(sizes) > 1 and offload.slab_bytes >= max(sizes) and offload.slab_bytes < sum(sizes)
    resident_bytes = watch_residency(runner)
    assert runner.execute(dict(request_))["sha256"] == reference.runner.execute(dict(request_))["sha256"]
    assert resident_bytes and max(resident_bytes) <= offload.slab_bytes
    assert offload.block_loads == len(resident_bytes)
    # Between forwards nothing points into the slab; the pools hold the resident part and the slab.
    assert not any(in_slab(offload, s.tensor) for block in offload.blocks for s in block)
    usage, whole = pools.backend.usage(), reference.backend.usage()
    assert usage[OFFLOAD_TAG] == offload.slab_bytes
    streamed_bytes = sum(sizes)
    assert usage["weights"] == whole["weights"] - streamed_bytes


def test_sleep_and_wake_with_offload_on(checkpoints):
    pools = offloaded(checkpoints["dit"], scheduler=DPM_SOLVER)
    runner = pools.runner
    whole = plain(checkpoints["dit"], scheduler=DPM_SOLVER).runner.execute(dict(DIT))["sha256"]
    started = runner.execute({"op": "start", **DIT})["request_id"]
    runner.execute({"op": "step", "request_id": started, "steps": 3})
    pools.sleep(1)
    assert pools.backend.usage()[OFFLOAD_TAG] == 0  # the slab is scratch: discarded
    pools.wake(("weights", "kv_cache", "requests"))
    with pytest.raises(RuntimeError, match="holds no memory: its pool is asleep"):
        runner.execute(dict(DIT))
    with pytest.raises(RuntimeError, match="'offload' pool is not resident"):
        runner.offload.bring(0)  # a forward outside execute's checks
    pools.wake((OFFLOAD_TAG,))
    assert runner.execute({"op": "finish", "request_id": started})["sha256"] == whole
    pools.sleep(2)
    pools.wake()
    pools.reload()  # writes the host copies too: the blocks point there between forwards
    assert runner.execute(dict(DIT))["sha256"] == whole


def test_a_reload_from_another_checkpoint_reaches_the_streamed_blocks(checkpoints):
    pools = offloaded(checkpoints["dit"])
    pools.reload(str(checkpoints["dit-seed1"]))
    other = plain(checkpoints["dit-seed1"]).runner.execute(dict(DIT))["sha256"]
    assert pools.runner.execute(dict(DIT))["sha256"] == other


def test_the_offload_tag_and_the_argument_must_agree(checkpoints):
    def load(runner: DiffusersRunner, tags: tuple[str, ...]) -> None:
        runner.load(lambda tag: contextlib.nullcontext(), tags, None)

    with pytest.raises(ValueError, match="list that tag exactly when offload='layerwise'"):
        load(DiffusersRunner(CPU, model=str(checkpoints["ddpm"]), offload="layerwise"), PLAIN_TAGS)
    with pytest.raises(ValueError, match="list that tag exactly when offload='layerwise'"):
        load(DiffusersRunner(CPU, model=str(checkpoints["ddpm"])), OFFLOAD_TAGS)
    runner = DiffusersRunner(CPU, model=str(checkpoints["ddpm"]), offload="layerwise")
    load(runner, (OFFLOAD_TAG, "weights"))  # the slab is sized once the weights are there
    assert runner.offload.slab is not None and runner.offload.slab.numel() == runner.offload.slab_bytes
    with pytest.raises(ValueError, match="offload must be one of"):
        DiffusersRunner(CPU, model=str(checkpoints["ddpm"]), offload="cpu")
    # With the step cache it combines: tests/runners/test_step_cache.py.


@pytest.mark.gpu
def test_offload_bounds_the_device_memory_for_real(checkpoints):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: the device-memory ceiling of a streamed denoiser")
    from omni_core.workers.backends import PortableBackend

    device = torch.device("cuda")
    peaks = {}
    for mode in ("none", "layerwise"):
        runner = DiffusersRunner(device, model=str(checkpoints["dit"]), offload=mode)
        backend = PortableBackend(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        runner.load(backend.pool, OFFLOAD_TAGS if mode == "layerwise" else PLAIN_TAGS, None)
        runner.execute(dict(DIT))
        peaks[mode] = torch.cuda.max_memory_allocated(device) - base
        if mode == "layerwise":
            streamed, slab = sum(runner.offload.block_bytes()), runner.offload.slab_bytes
        runner.close()
        del runner, backend
    # The loaded blocks leave the device (the load's own peak aside: the pipeline is read to
    # the device first); serving takes the resident part, the slab and the activations.
    assert peaks["layerwise"] <= peaks["none"] - (streamed - slab) // 2, (peaks, streamed, slab)


def test_a_forward_that_failed_inside_a_block_leaves_nothing_in_the_slab_a_sleep_discards(checkpoints):
    pools = offloaded(checkpoints["ddpm"])
    runner, offload = pools.runner, pools.runner.offload
    block = denoiser_blocks("ddpm", runner.modules["unet"])[0][1]

    def broken(*_args, **_kwargs):
        raise RuntimeError("out of memory")

    block.forward = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.execute(dict(DDPM))
    assert offload.resident == 1  # its forward hook never ran
    pools.sleep(1)
    assert offload.resident is None and not any(in_slab(offload, s.tensor) for s in offload.blocks[1])
    del block.forward
    pools.wake()
    assert runner.execute(dict(DDPM))["sha256"] == plain(checkpoints["ddpm"]).runner.execute(dict(DDPM))["sha256"]
