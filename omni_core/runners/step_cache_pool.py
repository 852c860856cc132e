"""The step cache's own pool (tag `step_cache`): one slot per request slot, each holding that
request's cached modulated input and residual (omni_core/runners/step_cache.py) between two
step-wise ops, under a header naming the request (its canary) and the weights generation the
residual was computed with.

Without the tag the cache's tensors are parked with the request's latents in the `requests`
pool, so a level-1 sleep keeps them (the request finishes bit for bit as without the sleep).
With it they are memory of their own that the stage can give back: every sleep discards the
pool (it is not a tag kept at level 1, and the runner saves none of it), so the cache costs
nothing while the stage sleeps; the step after the wake finds the header gone, drops the
cache and runs the blocks (a miss, counted in `step_cache_dropped`), never a residual of
other bits. The header's generation is the weights' key: a residual parked under weights that
a reload or an update has since replaced is dropped the same way, whatever became of the
request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from omni_core.runners.step_cache import StepCacheState

STEP_CACHE_TAG = "step_cache"
ALIGN_BYTES = 64
HEADER_BYTES = ALIGN_BYTES  # canary, weights generation (int64 each)
NAMES = ("previous", "residual")


def _align(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclass
class StepCachePool:
    """The slab of the `step_cache` pool and what each slot holds."""

    slots: int
    tensor_bytes: int  # one cached tensor of a request, at most
    slab: torch.Tensor | None = None
    layout: dict[int, list[tuple[str, int, tuple[int, ...], torch.dtype]]] = field(default_factory=dict)
    dropped: int = 0  # caches found discarded or made under other weights

    @property
    def slot_bytes(self) -> int:
        return HEADER_BYTES + len(NAMES) * _align(self.tensor_bytes)

    def allocate(self, device: torch.device) -> None:
        self.slab = torch.zeros(self.slots, self.slot_bytes, dtype=torch.uint8, device=device)
        self.layout.clear()

    def tensors(self) -> list[torch.Tensor]:
        return [self.slab] if self.slab is not None else []

    def _resident(self) -> bool:
        return self.slab is not None and self.slab.untyped_storage().nbytes() >= self.slab.numel()

    def _view(self, slot: int, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        assert self.slab is not None
        nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
        return self.slab[slot, offset : offset + nbytes].view(dtype).view(shape)

    def park(self, slot: int, canary: int, generation: int, state: StepCacheState) -> None:
        """The state's tensors into the slot (dropped from the state), under its key."""
        layout, offset = [], HEADER_BYTES
        for name in NAMES:
            tensor = getattr(state, name)
            if tensor is None:
                continue
            if tensor.numel() * tensor.element_size() > self.tensor_bytes:
                raise RuntimeError(
                    f"a step-cache tensor of {tensor.numel() * tensor.element_size()} bytes exceeds the "
                    f"'{STEP_CACHE_TAG}' pool's {self.tensor_bytes} per tensor; this is a bug in the runner's sizing"
                )
            self._view(slot, offset, tuple(tensor.shape), tensor.dtype).copy_(tensor)
            layout.append((name, offset, tuple(tensor.shape), tensor.dtype))
            offset += _align(self.tensor_bytes)
            setattr(state, name, None)
        self._view(slot, 0, (2,), torch.int64).copy_(torch.tensor([canary, generation]))
        self.layout[slot] = layout

    def unpark(self, slot: int, canary: int, generation: int, state: StepCacheState) -> None:
        """The slot's tensors back into the state; a slot discarded by a sleep, or written
        under other weights, leaves the state empty: the next step runs the blocks."""
        layout = self.layout.pop(slot, [])
        if not layout:
            return
        if not self._resident() or self._view(slot, 0, (2,), torch.int64).tolist() != [canary, generation]:
            self.dropped += 1
            state.previous, state.residual, state.accumulated = None, None, 0.0
            return
        for name, offset, shape, dtype in layout:
            setattr(state, name, self._view(slot, offset, shape, dtype).clone())

    def clear(self, slot: int) -> None:
        """A freed request slot: its header can match no later request."""
        self.layout.pop(slot, None)
        if self._resident():
            self._view(slot, 0, (2,), torch.int64).zero_()

    def close(self) -> None:
        self.slab = None
        self.layout.clear()
