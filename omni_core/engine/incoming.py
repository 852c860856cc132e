"""One incoming wake per device at a time (P-16): the orchestrator's swap slots, no IO.

Two incoming stages waking on one device each keep what they mapped while they wait for
the rest: both can wait with neither able to finish, and when their deadlines pass within
one poll of each other both are refused (tla/OmniSwap.tla, `NotBothRefused`). So a swap
whose incoming wake waits for memory (memory_wait_s > 0) holds each device its
incoming stage runs on until that wake's task ends; a swap into a held device waits here,
first come first served, and is issued when the devices are free, or refused when its
deadline passes first. The queue is bounded: past `MAX_QUEUED_SWAPS` a swap is refused at
once.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from omni_core.engine.errors import TaskAbandonedError
from omni_core.engine.link_plan import rank_view
from omni_core.engine.report import LifecycleReport
from omni_core.engine.spec import StageSpec
from omni_core.fsm import inputs as I

MAX_QUEUED_SWAPS = 16

Item = TypeVar("Item")
Key = tuple[str, str]  # (incoming stage, its wake's task id): what ends a slot


def rank_device(spec: StageSpec, rank: int, engine_visible: str | None) -> str | None:
    """The device a stage's rank runs on: its simulated device's directory on CPU, else the
    rank's GPU (its `devices` entry's first item, else the engine's CUDA_VISIBLE_DEVICES, at
    the index `device` names). A CPU rank without a simulated device has none."""
    if spec.simulated_device is not None:
        return f"simulated:{os.path.normpath(spec.simulated_device.directory)}"
    if not spec.device.startswith("cuda"):
        return None
    return f"gpu:{rank_view(spec.devices[rank] if spec.devices else None, engine_visible, spec.device).own_gpu}"


def stage_devices(spec: StageSpec, engine_visible: str | None) -> frozenset[str]:
    """The devices a stage's ranks run on (`rank_device`); none for a CPU stage without a
    simulated device."""
    devices = (rank_device(spec, r, engine_visible) for r in range(spec.ranks))
    return frozenset(d for d in devices if d is not None)


def incoming_bytes(
    out_spec: StageSpec, in_spec: StageSpec, in_wake_bytes: Mapping[int, int], engine_visible: str | None
) -> dict[int, int]:
    """Sleep.incoming_bytes for each rank of a swap's outgoing stage: what the incoming
    stage's ranks on that rank's device wake (`in_wake_bytes`: per incoming rank). Ranks
    whose device takes nothing (or that have none) are left out."""
    per_device: dict[str, int] = {}
    for rank, nbytes in in_wake_bytes.items():
        device = rank_device(in_spec, rank, engine_visible)
        if device is not None:
            per_device[device] = per_device.get(device, 0) + nbytes
    out: dict[int, int] = {}
    for rank in range(out_spec.ranks):
        device = rank_device(out_spec, rank, engine_visible)
        if device is not None and per_device.get(device, 0) > 0:
            out[rank] = per_device[device]
    return out


@dataclass(frozen=True)
class SwapCall:
    """A swap as Engine.swap asked for it; `future` settles once both halves are sent."""

    future: Future[None]
    out_name: str
    sleep: I.SleepCall
    out_future: Future[LifecycleReport]
    in_name: str
    wake: I.WakeCall
    in_future: Future[LifecycleReport]

    def shortened(self, remaining_s: float) -> SwapCall:
        """The swap issued after waiting: the caller's deadline still holds, so both halves get
        what is left of it, and the wake's wait for memory keeps its share (below the deadline,
        as the protocol requires; 0 stays 0)."""
        share = self.wake.memory_wait_s / self.wake.deadline_s
        wake = replace(self.wake, deadline_s=remaining_s, memory_wait_s=share * remaining_s)
        return replace(self, sleep=replace(self.sleep, deadline_s=remaining_s), wake=wake)


@dataclass
class WaitingSwap(Generic[Item]):
    key: Key
    swap_id: str
    devices: frozenset[str]
    queued_at_s: float
    deadline_at_s: float
    item: Item
    behind: str = ""  # the swap it last waited for, and on which device (for the messages)


class IncomingSlots(Generic[Item]):
    """Which swap's incoming wake holds each device, and the swaps waiting for one (FIFO)."""

    def __init__(self, limit: int = MAX_QUEUED_SWAPS) -> None:
        self.limit = limit
        self._holder: dict[str, tuple[Key, str]] = {}  # device -> (key, swap id) of its incoming wake
        self._held: dict[Key, frozenset[str]] = {}
        self._queue: deque[WaitingSwap[Item]] = deque()

    def offer(
        self, key: Key, swap_id: str, devices: frozenset[str], now_s: float, deadline_s: float, item: Item
    ) -> bool:
        """True: the devices are this swap's now, issue it (and `release(key)` when its wake
        ends). False: it waits (`advance` hands it back). Raises TaskAbandonedError when
        `limit` swaps wait already."""
        if not devices:  # a CPU stage without a simulated device: nothing to run out of
            return True
        entry = WaitingSwap(key, swap_id, devices, now_s, now_s + deadline_s, item)
        entry.behind = self._blocker(devices, ahead=self._queue)
        if not entry.behind:
            self._take(entry)
            return True
        if len(self._queue) >= self.limit:
            raise TaskAbandonedError(
                f"swap {swap_id!r} refused: {len(self._queue)} swaps already wait for a device and it would wait "
                f"for {entry.behind}; nothing was sent, both stages are unchanged; retry once that swap ended"
            )
        self._queue.append(entry)
        return False

    def held(self, key: Key) -> frozenset[str]:
        """The devices the incoming wake of `key` holds (none: it holds nothing)."""
        return self._held.get(key, frozenset())

    def release(self, key: Key) -> None:
        """The wake of `key` ended (or was never sent): its devices are free. Unknown keys
        are ignored (every lifecycle outcome is offered here)."""
        for device in self._held.pop(key, frozenset()):
            del self._holder[device]

    def advance(self, now_s: float) -> tuple[list[WaitingSwap[Item]], list[WaitingSwap[Item]]]:
        """(due, expired): the waiting swaps whose devices are free now, in arrival order,
        each holding them already (issue each, then `release` as for `offer`); and those
        whose deadline passed first, removed (refuse each: `expired_error`)."""
        due: list[WaitingSwap[Item]] = []
        expired: list[WaitingSwap[Item]] = []
        kept: deque[WaitingSwap[Item]] = deque()
        for entry in self._queue:
            blocker = self._blocker(entry.devices, ahead=kept)
            if now_s >= entry.deadline_at_s:
                expired.append(entry)
            elif not blocker:
                self._take(entry)
                due.append(entry)
            else:
                entry.behind = blocker
                kept.append(entry)
        self._queue = kept
        return due, expired

    @staticmethod
    def expired_error(entry: WaitingSwap[Item]) -> TaskAbandonedError:
        return TaskAbandonedError(
            f"swap {entry.swap_id!r} did not start within its deadline of "
            f"{entry.deadline_at_s - entry.queued_at_s:.3f} s: it waited for {entry.behind} (one incoming wake per "
            "device at a time); nothing was sent, both stages are unchanged; retry it, or give it a longer timeout_s"
        )

    def drain(self) -> list[WaitingSwap[Item]]:
        """Every waiting swap, removed (the engine is shutting down)."""
        entries, self._queue = list(self._queue), deque()
        return entries

    def waiting(self, in_stage: str) -> list[dict[str, object]]:
        """The swaps into `in_stage` that wait, for status()."""
        return [{"swap": e.swap_id, "behind": e.behind} for e in self._queue if e.key[0] == in_stage]

    def _blocker(self, devices: frozenset[str], ahead: deque[WaitingSwap[Item]]) -> str:
        for device in sorted(devices):
            if device in self._holder:
                key, swap_id = self._holder[device]
                return f"device {device}, held by the incoming wake of swap {swap_id!r} into stage {key[0]!r}"
        for entry in ahead:  # first come, first served on a shared device
            shared = devices & entry.devices
            if shared:
                return f"device {min(shared)}, for which swap {entry.swap_id!r} waits already"
        return ""

    def _take(self, entry: WaitingSwap[Item]) -> None:
        self._held[entry.key] = entry.devices
        for device in entry.devices:
            self._holder[device] = (entry.key, entry.swap_id)
