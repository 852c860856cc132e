"""Text-encoder outputs reused across requests, in a pool of their own (tag `prompt_cache`).

vLLM-Omni's diffusion runner keeps such a cache; here it is memory the lifecycle knows about:
one slab of `capacity_bytes`, allocated inside the `prompt_cache` pool, cut into slots of one
embedding each (the text encoder's longest output with both guidance halves). A sleep
discards the pool like any scratch tag, and the runner empties the index before it does
(`discard`), so no entry ever points at released memory.

Every entry remembers the weights it was computed with (`weights_generation`, which the runner
bumps at every write of its weights: an update of any version, a reload). A lookup under other
weights is a miss and drops the entry: an embedding of older weights is never served, whether
the update came over IPC, a broadcast or from disk, and even when a reload returns to weights
version 0 from another directory (the protocol's version alone would repeat there).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

PROMPT_CACHE_TAG = "prompt_cache"
SLOT_ALIGN_BYTES = 64  # every embedding starts here: views of any dtype stay aligned

# (prompt, negative prompt, guided): guided embeddings carry the unconditional half too.
PromptKey = tuple[str, "str | None", bool]


@dataclass(frozen=True)
class _Entry:
    slot: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    weights_generation: int


def slot_bytes_for(max_tokens: int, hidden_size: int, dtype: torch.dtype) -> int:
    """The bytes of the largest embedding a text encoder gives: both guidance halves."""
    nbytes = 2 * max_tokens * hidden_size * dtype.itemsize
    return -(-nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


class PromptCache:
    """Embeddings by prompt, least recently used first, bounded by the slab's bytes."""

    def __init__(self, capacity_bytes: int, slot_bytes: int) -> None:
        self.capacity_bytes, self.slot_bytes = capacity_bytes, slot_bytes
        self.slab: torch.Tensor | None = None
        self.entries: OrderedDict[PromptKey, _Entry] = OrderedDict()
        self.hits = self.misses = self.stale = self.evictions = self.too_large = 0

    @property
    def slots(self) -> int:
        return 0 if self.slab is None else self.slab.shape[0]

    def allocate(self, device: torch.device) -> None:
        """Runs inside the `prompt_cache` pool: the slab is that pool's memory."""
        slots = self.capacity_bytes // self.slot_bytes
        if slots < 1:
            raise ValueError(
                f"prompt_cache_bytes={self.capacity_bytes} holds no embedding of this text encoder "
                f"({self.slot_bytes} bytes each); give at least {self.slot_bytes}, or leave the "
                f"{PROMPT_CACHE_TAG!r} tag out of the stage"
            )
        self.slab = torch.empty(slots, self.slot_bytes, dtype=torch.uint8, device=device)

    def tensors(self) -> list[torch.Tensor]:
        return [self.slab] if self.slab is not None else []

    def _resident(self) -> bool:
        return self.slab is not None and self.slab.untyped_storage().nbytes() >= self.slab.numel()

    def get(self, key: PromptKey, weights_generation: int) -> torch.Tensor | None:
        """A host copy of the embedding of `key` under these weights, or None (a miss)."""
        entry = self.entries.get(key)
        if entry is not None and entry.weights_generation != weights_generation:
            del self.entries[key]  # computed with other weights: never served
            self.stale += 1
            entry = None
        if entry is None or not self._resident():
            self.misses += 1
            return None
        self.hits += 1
        self.entries.move_to_end(key)
        assert self.slab is not None
        nbytes = int(torch.Size(entry.shape).numel()) * entry.dtype.itemsize
        raw = self.slab[entry.slot, :nbytes].view(entry.dtype).view(entry.shape)
        return raw.to("cpu", copy=True)

    def put(self, key: PromptKey, weights_generation: int, embeddings: torch.Tensor) -> None:
        """Keep `embeddings` (computed under these weights), evicting the least recently used
        entry when every slot is taken. Nothing is kept without a resident slab."""
        if not self._resident():
            return
        assert self.slab is not None
        nbytes = embeddings.numel() * embeddings.element_size()
        if nbytes > self.slot_bytes:
            self.too_large += 1
            return
        for old in [k for k, e in self.entries.items() if e.weights_generation != weights_generation]:
            del self.entries[old]  # their slots are free for this one
            self.stale += 1
        self.entries.pop(key, None)
        used = {e.slot for e in self.entries.values()}
        slot = next((s for s in range(self.slots) if s not in used), None)
        if slot is None:
            _, evicted = self.entries.popitem(last=False)
            slot = evicted.slot
            self.evictions += 1
        flat = embeddings.detach().contiguous().reshape(-1).view(torch.uint8)
        self.slab[slot, :nbytes].copy_(flat)
        self.entries[key] = _Entry(slot, tuple(embeddings.shape), embeddings.dtype, weights_generation)

    def discard(self) -> int:
        """Forget every entry (before a sleep releases the slab, or to reset the cache); the
        slab stays as it is. Returns how many entries were dropped."""
        dropped = len(self.entries)
        self.entries.clear()
        return dropped

    def stats(self, weights_generation: int) -> dict[str, Any]:
        return {
            "entries": sum(e.weights_generation == weights_generation for e in self.entries.values()),
            "slots": self.slots,
            "slot_bytes": self.slot_bytes,
            "capacity_bytes": self.slots * self.slot_bytes,
            "hits": self.hits,
            "misses": self.misses,
            "stale_dropped": self.stale,
            "evictions": self.evictions,
            "too_large": self.too_large,
        }

    def counters(self) -> dict[str, int]:
        """The runner's counters (ModelRunner.counters): always these names."""
        return {
            "prompt_cache_hits": self.hits,
            "prompt_cache_misses": self.misses,
            "prompt_cache_stale_dropped": self.stale,
            "prompt_cache_evictions": self.evictions,
            "prompt_cache_too_large": self.too_large,
        }

    def close(self) -> None:
        self.entries.clear()
        self.slab = None
