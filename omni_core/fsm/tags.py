"""Tag arithmetic shared by the worker and the stage lifecycles.

A worker's memory is split into tagged pools. `weights` and `adapters` (the LoRA adapters'
tensors, P-20, a tag a stage opts into) are the tags whose content must survive a sleep:
level 1 offloads them to host, level 2 discards them (the runner reloads the weights; the
adapters are gone until added again). `cuda_graph` (the memory of captured CUDA graphs, vLLM's
graph pool) is offloaded at level 1 too, as vLLM's own `sleep_mode_offload_cudagraph` does:
the graphs replay at the same addresses after the wake. Every other tag (`kv_cache`, `comm`:
collective communicators' buffers, activations) is scratch and is always discarded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from omni_core.fsm.settle import Settled

WEIGHTS_TAG = "weights"
KV_CACHE_TAG = "kv_cache"
ADAPTERS_TAG = "adapters"
CUDA_GRAPH_TAG = "cuda_graph"  # captured CUDA graphs' pool, allocated by the framework inside the backend's allocator
COMM_TAG = "comm"  # NCCL communicators' buffers: released and restored by the runner itself (vLLM's comm suspend)
KEPT_AT_LEVEL_1 = frozenset({WEIGHTS_TAG, ADAPTERS_TAG, CUDA_GRAPH_TAG})  # offloaded, never discarded, by level 1
DEFAULT_TAGS: tuple[str, ...] = (WEIGHTS_TAG, KV_CACHE_TAG)


class UnknownTagError(ValueError):
    pass


def resolve_tags(requested: Iterable[str] | None, known: tuple[str, ...]) -> frozenset[str]:
    """`None` means every known tag; unknown names raise with the list of valid ones."""
    if requested is None:
        return frozenset(known)
    wanted = frozenset(requested)
    unknown = sorted(wanted - set(known))
    if unknown:
        raise UnknownTagError(f"unknown tag(s) {unknown}; this worker has tags {list(known)}")
    return wanted


@dataclass(frozen=True)
class SleepPlan:
    """What a sleep does to each tag: `offload` keeps a host copy, `discard` keeps nothing."""

    offload: frozenset[str]
    discard: frozenset[str]

    @property
    def invalidates_weights(self) -> bool:
        return WEIGHTS_TAG in self.discard


def plan_sleep(level: int, tags: frozenset[str], *, weights_valid: bool = True) -> SleepPlan:
    """Level 1 keeps a host copy of valid weights (and the adapters made for them) only:
    weights a level-2 sleep already discarded (NEEDS_RELOAD) hold garbage, and copying garbage
    to the host buys nothing."""
    if level == 1 and weights_valid:
        return SleepPlan(offload=tags & KEPT_AT_LEVEL_1, discard=tags - KEPT_AT_LEVEL_1)
    if level == 1:
        return SleepPlan(offload=frozenset(), discard=tags)
    if level == 2:
        return SleepPlan(offload=frozenset(), discard=tags)
    raise ValueError(f"sleep level must be 1 or 2, got {level!r}")


class Residency:
    """Which tags are asleep and whether the resident weights hold valid values.

    The settled state after a wake or reload is a function of these two facts alone, which
    is why the worker and the stage share this class: the stage mirrors what its ranks hold.
    """

    def __init__(self, tags: tuple[str, ...]) -> None:
        self.tags = tags
        self.asleep: frozenset[str] = frozenset()
        self.weights_valid = True

    def apply_sleep(self, plan: SleepPlan) -> None:
        self.asleep |= plan.offload | plan.discard
        if plan.invalidates_weights:
            self.weights_valid = False

    def apply_wake(self, tags: frozenset[str]) -> None:
        self.asleep -= tags

    def apply_reload(self) -> None:
        self.weights_valid = True

    @property
    def weights_resident(self) -> bool:
        return WEIGHTS_TAG not in self.asleep

    def settled(self) -> Settled:
        """Where a wake or reload ends (the rows of fsm/settle.py say what that means)."""
        if not self.asleep and self.weights_valid:
            return Settled.ACTIVE
        if WEIGHTS_TAG in self.tags and self.weights_resident and not self.weights_valid:
            return Settled.NEEDS_RELOAD
        return Settled.PARTIAL
