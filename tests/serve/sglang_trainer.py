"""The trainer's side of SGLang's weight group, step by step as SGLang's
`init_custom_process_group` (`python/sglang/srt/utils`; the same function in slime,
OpenRLHF and AReaL) takes it, recorded from its source: a `tcp://` rendezvous (group rank 0
serves the store), `PrefixStore(group_name)`, torch's own `_new_process_group_helper` with no
global ranks, and the group's ranks registered as themselves. A server rank joins by the same
steps with its rank; its broadcasts are `torch.distributed.broadcast(tensor, src=0,
group=group)`. No omni-core code is used here: this is what omni-core must be compatible with."""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import torch


def init_custom_process_group(
    *, backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float = 60.0
) -> Any:
    import torch.distributed.distributed_c10d as c10d

    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = c10d.PrefixStore(group_name, store)
    # torch renamed pg_options to backend_options; SGLang passes whichever its torch has.
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    group, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        c10d.Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def broadcast_all(group: Any, tensors: dict[str, torch.Tensor]) -> None:
    """SGLang's trainer loop of an update: each tensor whole, in the order of the names sent."""
    import torch.distributed as dist

    for tensor in tensors.values():
        dist.broadcast(tensor, src=0, group=group)


def receive_all(group: Any, specs: dict[str, tuple[list[int], torch.dtype]]) -> dict[str, torch.Tensor]:
    """An SGLang server rank's side of `update_weights_from_distributed`."""
    import torch.distributed as dist

    out = {}
    for name, (shape, dtype) in specs.items():
        out[name] = torch.empty(shape, dtype=dtype)
        dist.broadcast(out[name], src=0, group=group)
    return out
