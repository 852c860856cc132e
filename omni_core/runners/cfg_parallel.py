"""Parallel denoising over a stage's ranks: CFG-parallel over two (vLLM-Omni's
`cfg_parallel_size=2`, the default) or a tensor-parallel DiT (`parallel="tensor"`).

Classifier-free guidance runs the denoiser over two halves of every guided request's rows:
the conditional and the unconditional one. On a stage of two ranks each rank runs one half
(rank 0 the first rows, rank 1 the second) and one all-gather per step brings both halves
to both ranks, which then make the same guidance and scheduler step: their state stays
identical (same seeds, same ops in the same order, as the engine sends every request to
every rank) and the stage's result is rank 0's. Each rank holds the whole model, so each
sleeps, wakes and reloads its own copy as a single rank does.

A request without guidance has one half: both ranks compute it whole (the same result, no
split). Every rank joins the stage's process group at start (gloo on CPU, NCCL on CUDA).

Tensor-parallel (`shard_dit`): each DiT block's attention and MLP sharded Megatron-style over
the ranks, as the transformers runner's plan shards an LLM's (query, key, value and the MLP's
first projection split by output rows, the attention's output and the MLP's second projection
by input columns, one all-reduce after each): every rank holds its shard of the blocks (the
rest replicated), sleeps and wakes it, and a reload or update cuts its shard from the full
tensors (`weights.rank_shard`), so the weights are DTensors the rest of the runner already
handles. Every rank computes every row.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from omni_core.runners.diffusion_steps import DenoiserCall, run_together

CFG_WORLD = 2  # the guidance halves
PARALLEL_MODES = ("cfg", "tensor", "ulysses", "ring")  # the last two: omni_core/runners/diffusion_parallel.py


def stage_world(kind: str, parallel: str) -> int:
    """The stage's WORLD_SIZE (set by the engine for every rank), refused where this runner
    cannot split the work: each rank would compute the same image (replicas)."""
    if parallel not in PARALLEL_MODES:
        raise ValueError(
            f"parallel must be one of {list(PARALLEL_MODES)} ('cfg': a guidance half per rank, over 2 ranks; "
            "'tensor': the DiT's attention and MLP sharded over the ranks; 'ulysses', 'ring': the DiT's tokens "
            f"split over the ranks, sequence-parallel), got {parallel!r}"
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 1
    if parallel != "cfg":
        if kind != "dit":
            raise ValueError(
                f"parallel={parallel!r} splits a DiT's blocks; this pipeline is {kind!r}: use parallel='cfg'"
            )
        return world
    if world != CFG_WORLD or kind == "ddpm":
        what = "DDPM has no guidance to split" if kind == "ddpm" else f"a stage of {world} ranks has no such split"
        raise ValueError(
            f"the diffusers runner splits a stage's work CFG-parallel: the conditional and the unconditional "
            f"pass on {CFG_WORLD} ranks, for DiT and Stable Diffusion pipelines; {what}. Use ranks=1 "
            f"(or ranks={CFG_WORLD} for a guided pipeline)"
        )
    return world


def _half(call: DenoiserCall, rank: int) -> DenoiserCall:
    rows = len(call.inputs) // CFG_WORLD
    part = slice(rank * rows, (rank + 1) * rows)
    condition = call.condition[part] if call.condition is not None else None
    return DenoiserCall(call.inputs[part], call.row_timesteps()[part], condition, call.finish, guided=False)


def run_cfg_parallel(kind: str, denoiser: object, calls: list[DenoiserCall]) -> list[torch.Tensor]:
    """`run_together` with every guided call's halves on the two ranks: this rank's half of
    each, then one all-gather of all of them; each call's whole output, in order."""
    rank = dist.get_rank()
    local = [_half(call, rank) if call.guided else call for call in calls]
    outputs = run_together(kind, denoiser, local)
    guided = [i for i, call in enumerate(calls) if call.guided]
    if not guided:
        return outputs
    mine = torch.cat([outputs[i] for i in guided]).contiguous()
    gathered = [torch.empty_like(mine) for _ in range(CFG_WORLD)]
    dist.all_gather(gathered, mine)
    offset = 0
    for i in guided:
        rows = len(outputs[i])
        outputs[i] = torch.cat([part[offset : offset + rows] for part in gathered])
        offset += rows
    return outputs


def shard_dit(transformer: Any, world: int, device: torch.device) -> None:
    """Shard every block's attention and MLP over the stage's ranks, in place."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from omni_core.runners.weights import check_placements, local_tensor

    heads = int(transformer.config.num_attention_heads)
    inner = heads * int(transformer.config.attention_head_dim)
    if heads % world or 4 * inner % world:
        raise ValueError(
            f"parallel='tensor' over {world} ranks splits the DiT's {heads} attention heads: use a number of "
            "ranks that divides them"
        )
    mesh = init_device_mesh(device.type, (world,))
    plan = {
        "attn1.to_q": ColwiseParallel(),
        "attn1.to_k": ColwiseParallel(),
        "attn1.to_v": ColwiseParallel(),
        "attn1.to_out.0": RowwiseParallel(),
        "ff.net.0.proj": ColwiseParallel(),
        "ff.net.2": RowwiseParallel(),
    }
    for block in transformer.transformer_blocks:
        parallelize_module(block, mesh, plan)
        block.attn1.heads = heads // world  # the attention reshapes by its local heads
    check_placements(transformer)
    with torch.no_grad():  # a shard that views the whole tensor would keep all of it
        for tensor in transformer.parameters():
            local = local_tensor(tensor)
            if local.untyped_storage().nbytes() > local.numel() * local.element_size():
                local.data = local.data.clone()
