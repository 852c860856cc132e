"""Layer-wise offload of a denoiser (vLLM-Omni's `offload_backend`): its blocks kept on the host
and streamed through one device slab, block by block, while serving.

The blocks (a DiT's `transformer_blocks`, a UNet's down, mid and up blocks) hold most of the
weights. Their tensors live in host memory (pinned where the device is CUDA) outside every
pool; a forward pre-hook copies a block's tensors into the slab and points them there, a
forward hook points them back to the host, so at most one block is on the device at a time.
The slab is the only device memory streaming takes: one pool of its own (tag `offload`), its
size the largest block's, so the rank's Hello declares it (`pool_bytes`), budgets and the
wake's memory gate (P-16) count it, and the `weights` pool holds only what stays resident.

The slab holds no state between two forwards: a sleep discards it (every level) and a wake
maps it again. The host copies are what the weights are: a reload or an update writes into
them (the blocks point there between forwards), and a level-2 sleep keeps them (host memory).
Whatever a denoiser reads of a block outside that block's own forward stays resident
(`keep`): DiT's forward reads block 0's conditioning embedding after the blocks, and a step
cache reads block 0's whole first norm before them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

OFFLOAD_TAG = "offload"
OFFLOAD_MODES = ("none", "layerwise")
ALIGN_BYTES = 256  # each tensor of a block starts at such an offset in the slab


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def denoiser_blocks(
    kind: str, denoiser: Any, *, cached: bool = False
) -> tuple[list[torch.nn.Module], list[torch.nn.Module]]:
    """The blocks to stream, and the modules inside them to keep resident. `cached`: a DiT
    step cache (runners/step_cache.py) runs block 0's whole norm1 before deciding whether the
    blocks run, so all of it stays resident, and a skipped step streams no block."""
    if kind == "dit":
        blocks = list(denoiser.transformer_blocks)
        # norm1.emb: read by DiTTransformer2DModel.forward after the blocks.
        return blocks, [blocks[0].norm1 if cached else blocks[0].norm1.emb]
    blocks = [*denoiser.down_blocks, denoiser.mid_block, *denoiser.up_blocks]
    return [block for block in blocks if block is not None], []


@dataclass
class _Streamed:
    tensor: torch.Tensor  # the parameter or buffer the module holds
    host: torch.Tensor  # its values, on the host
    offset: int  # in the slab


@dataclass
class BlockOffload:
    """The streamed blocks of one denoiser and the slab they pass through."""

    device: torch.device
    blocks: list[list[_Streamed]] = field(default_factory=list)
    slab: torch.Tensor | None = None
    slab_bytes: int = 0
    resident: int | None = None  # the block whose tensors point into the slab now
    block_loads: int = 0  # copies of a block into the slab
    streamed_bytes: int = 0
    handles: list[Any] = field(default_factory=list)

    @classmethod
    def attach(
        cls, device: torch.device, blocks: list[torch.nn.Module], keep: Iterable[torch.nn.Module]
    ) -> BlockOffload:
        """Move the blocks' tensors to the host and hook each block to stream through the slab."""
        offload = cls(device)
        kept = {id(t) for module in keep for t in [*module.parameters(), *module.buffers()]}
        seen: set[int] = set(kept)
        pin = device.type == "cuda"
        for index, block in enumerate(blocks):
            streamed, offset = [], 0
            for tensor in [*block.parameters(), *block.buffers()]:
                if id(tensor) in seen:
                    continue
                seen.add(id(tensor))
                host = tensor.detach().to("cpu", copy=True)
                host = host.pin_memory() if pin else host
                tensor.data = host
                streamed.append(_Streamed(tensor, host, offset))
                offset += _align(host.numel() * host.element_size())
            offload.blocks.append(streamed)
            offload.slab_bytes = max(offload.slab_bytes, offset)
            offload.handles.append(block.register_forward_pre_hook(lambda *_, i=index: offload.bring(i)))
            offload.handles.append(block.register_forward_hook(lambda *_, i=index: offload.evict(i)))
        return offload

    def allocate(self) -> None:
        self.slab = torch.empty(self.slab_bytes, dtype=torch.uint8, device=self.device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.slab] if self.slab is not None else []

    def streamed_ids(self) -> set[int]:
        return {id(s.tensor) for block in self.blocks for s in block}

    def block_bytes(self) -> list[int]:
        return [sum(s.host.numel() * s.host.element_size() for s in block) for block in self.blocks]

    def bring(self, index: int) -> None:
        """The block's tensors into the slab (the pre-hook); another block's there is released."""
        if self.slab is None or self.slab.untyped_storage().nbytes() < self.slab_bytes:
            raise RuntimeError(
                f"the '{OFFLOAD_TAG}' pool is not resident: a denoiser block cannot be streamed in; wake the stage"
            )
        if self.resident is not None:
            self.evict(self.resident)
        for s in self.blocks[index]:
            nbytes = s.host.numel() * s.host.element_size()
            view = self.slab[s.offset : s.offset + nbytes].view(s.host.dtype).view(s.host.shape)
            view.copy_(s.host, non_blocking=True)
            s.tensor.data = view
            self.streamed_bytes += nbytes
        self.resident = index
        self.block_loads += 1

    def evict(self, index: int) -> None:
        """The block's tensors back to their host copies (the forward hook): nothing is copied,
        the weights are read-only while serving."""
        for s in self.blocks[index]:
            s.tensor.data = s.host
        if self.resident == index:
            self.resident = None

    def release(self) -> None:
        """Before a sleep: no block points into the slab that the sleep discards."""
        if self.resident is not None:
            self.evict(self.resident)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.slab = None
