"""A weight group's store layout, shared by the trainer's side (`WeightSender.init_group`) and
the rank's (`WeightReceiver.join`): the one SGLang's `init_custom_process_group` makes, which
slime, OpenRLHF, AReaL and SGLang's own tests call, so that their trainers join omni-core's
ranks unchanged and `WeightSender` joins an SGLang server's.

That function rendezvouses at `tcp://address:port` (a `TCPStore` that group rank 0 serves),
wraps the store in `PrefixStore(group_name)` and hands it to torch's
`_new_process_group_helper`, which prefixes `f"{group_name}/"` again and then `f"{device}/"`
with the first device of the backend's map (`BackendConfig`: gloo `cpu`, nccl `cuda`); where
every device of the map has the same backend, as for these two, it builds that one backend
and registers it for every device (a gloo group carries CPU and CUDA tensors alike). A
`ProcessGroupGloo` rendezvouses in its constructor, a `ProcessGroupNCCL` exchanges its id
through the store at its first collective. The backend then sets its sequence number (gloo:
rank 0 writes it to the store, the others read it). The same steps here, by torch's public
constructors, give the same keys.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch


def device_store(store: Any, group: str, device: str) -> Any:
    """The store one device's backend of `group` talks through, as torch's helper nests it."""
    import torch.distributed as dist

    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group}/", dist.PrefixStore(group, store)))


def backend_device(backend: str) -> str:
    """The device whose prefix torch's helper gives a single-backend group: the first of its map."""
    from torch.distributed.distributed_c10d import Backend, BackendConfig

    return next(iter(BackendConfig(Backend(backend)).get_device_backend_map()))


class WeightGroup:
    """One joined group: its backend, over the store's prefix torch's helper would give it."""

    def __init__(self, store: Any, group: str, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        prefixed = device_store(store, group, backend_device(backend))
        self.backend: Any
        if backend == "gloo":
            self.backend = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            self.backend = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        self.backend._set_sequence_number_for_group()

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Broadcast `tensor` from group rank `root` (the trainer is 0)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = root
        self.backend.broadcast([tensor], options).wait()
