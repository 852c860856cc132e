"""Effects: what a worker core asks its shell to do. The shell performs one, then reports
back through `WorkerCore.step` (`EffectCompleted`, `EffectDeclined`, `EffectRaised`); the core
never does IO itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_core.protocol import LinkShare, WeightSource


@dataclass(frozen=True)
class SleepEffect:
    """Offload `offload` tags to host, discard `discard` tags (the command's level is in that
    plan, `plan_sleep`'s, and nowhere else), saving the runner's small buffers first (they
    are restored on wake). `links`: the command's link plan;
    `incoming_bytes`: what a swap's incoming stage maps on this device meanwhile (a hint:
    with room for it, release after the last copy instead of as each lands)."""

    task_id: str
    offload: frozenset[str]
    discard: frozenset[str]
    links: tuple[LinkShare, ...] = ()
    incoming_bytes: int = 0


@dataclass(frozen=True)
class WakeEffect:
    """Map `tags` back and restore whatever of them was offloaded. Each allocation waits for
    that much free device memory, up to `memory_wait_s` in all; when it is not there in
    time, unmap what was mapped and report `EffectDeclined` (NO_MEMORY, P-16)."""

    task_id: str
    tags: frozenset[str]
    memory_wait_s: float = 0.0
    links: tuple[LinkShare, ...] = ()


@dataclass(frozen=True)
class ReloadEffect:
    task_id: str
    source: str | None


@dataclass(frozen=True)
class UpdateEffect:
    """Write the weights of `source` in place as `version` (P-17): check every name, shape and
    dtype and open every handle first (a problem then: `RunnerArgumentError`, nothing written,
    `EffectDeclined`); any failure after writing began is `EffectRaised`, which
    leaves the rank NEEDS_RELOAD at its old version. Invalidate host copies of the weights.
    Then drop the runner's weight-derived caches (`flush_cache` False: keep those keyed by
    version, refusing before writing when another kind is held). `into_host`: the weights sleep
    at level 1 (HOST_REFIT): write the backend's host copy instead, touching nothing on the
    device; the next wake brings it."""

    task_id: str
    version: int
    source: WeightSource
    flush_cache: bool = True
    into_host: bool = False


@dataclass(frozen=True)
class WeightGroupEffect:
    """Join the trainer's weight group (`InitWeightGroup`): group rank `rank_offset + rank`."""

    task_id: str
    command: Any  # omni_core.protocol.InitWeightGroup


@dataclass(frozen=True)
class ShareEffect:
    """Copy the runner's weights into shared buckets of at most `bucket_bytes`; the Ack lists
    them (`EffectCompleted.shared`). Moves no pool memory, changes no state."""

    task_id: str
    bucket_bytes: int


@dataclass(frozen=True)
class ExecuteEffect:
    task_id: str
    payload: Any
    adapter: str | None = None  # the LoRA adapter to run it with (P-20), loaded on this rank


@dataclass(frozen=True)
class AdapterEffect:
    """Perform an adapter command (P-20) on the runner: for an AddAdapter, check the source
    (a problem: `RunnerArgumentError`, nothing done, `EffectDeclined`), unload `evict`, then
    load it into the adapters' pool; a RemoveAdapter unloads, a PinAdapter pins, a ListAdapters
    does nothing (the core's table answers it). Never changes the state; any failure is that
    command's NACK."""

    task_id: str
    command: Any  # AddAdapter | RemoveAdapter | PinAdapter | ListAdapters
    evict: tuple[str, ...] = ()


@dataclass(frozen=True)
class StatusEffect:
    """Measure memory (no state change); the Ack carries the figures."""

    task_id: str


@dataclass(frozen=True)
class ShutdownEffect:
    """Release every pool; the shell exits after sending the Ack."""

    task_id: str


@dataclass(frozen=True)
class ProfileEffect:
    """Start the rank's profiler (`start`), or stop it and write its trace; the stop's Ack
    lists the files (`EffectCompleted.trace_paths`). Touches no memory pool."""

    task_id: str
    start: bool
    prefix: str | None


@dataclass(frozen=True)
class CommandEffect:
    """Perform `command` itself: a command the worker takes by its generic row
    (`worker_table.WORKER_CALLS`). It never changes the state; the shell looks the command's
    type up in its one table of handlers."""

    task_id: str
    command: Any  # omni_core.protocol.Command


Effect = (
    SleepEffect
    | WakeEffect
    | ReloadEffect
    | ExecuteEffect
    | StatusEffect
    | ShutdownEffect
    | ProfileEffect
    | UpdateEffect
    | WeightGroupEffect
    | ShareEffect
    | CommandEffect
    | AdapterEffect
)

# What `omni_core.fsm` exports of this module (it star-imports it): a new effect is exported
# by its line here, beside its class.
__all__ = [
    "AdapterEffect",
    "CommandEffect",
    "Effect",
    "ExecuteEffect",
    "ProfileEffect",
    "ReloadEffect",
    "ShareEffect",
    "ShutdownEffect",
    "SleepEffect",
    "StatusEffect",
    "UpdateEffect",
    "WakeEffect",
    "WeightGroupEffect",
]
