"""A stage's LoRA adapters as `Engine.status()` shows them (P-20): what its lowest rank listed
last, in an Ack of an adapter command or of a command that changes the adapters (a sleep, a
wake, a reload, an update), with where each is now. The ranks' tables are the truth; this is
the engine's latest word from them, so the status page and the metrics need no command."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_core.fsm.tags import ADAPTERS_TAG, WEIGHTS_TAG
from omni_core.protocol import Ack, AdapterInfo

ADAPTER_COMMAND_NAMES = frozenset({"AddAdapter", "RemoveAdapter", "PinAdapter", "ListAdapters"})
LISTING_COMMAND_NAMES = ADAPTER_COMMAND_NAMES | {"Sleep", "Wake", "ReloadWeights", "UpdateWeights"}
RESIDENCIES = ("resident", "offloaded", "gone", "stale")


def residency(info: AdapterInfo, asleep: frozenset[str], home_tag: str) -> str:
    """`gone` (a level-2 sleep discarded it), `stale` (made for other base weights),
    `offloaded` (its pool sleeps: a level-1 sleep keeps it on the host), else `resident`."""
    if info.status in ("gone", "stale"):
        return info.status
    return "offloaded" if home_tag in asleep else "resident"


@dataclass
class AdapterView:
    epoch: int = -1  # the epoch of the listing: a restart's ranks start with none
    listed: tuple[AdapterInfo, ...] = ()

    def observe(self, ack: Ack, epoch: int) -> None:
        """An Ack of the stage's lowest rank: an adapter command's always lists them all; a
        sleep's, wake's, reload's or update's lists them when the worker says (a worker of
        another make may leave them off, and its listing stands)."""
        if ack.epoch != epoch or ack.rank != 0 or ack.command not in LISTING_COMMAND_NAMES:
            return
        if ack.command in ADAPTER_COMMAND_NAMES or ack.adapters:
            self.epoch, self.listed = epoch, tuple(ack.adapters)

    def rows(self, epoch: int, asleep: frozenset[str], tags: tuple[str, ...]) -> list[dict[str, Any]]:
        if epoch != self.epoch:
            return []
        home = ADAPTERS_TAG if ADAPTERS_TAG in tags else WEIGHTS_TAG
        return [
            {
                "name": a.name,
                "adapter_id": a.adapter_id,
                "version": a.version,
                "base_version": a.base_version,
                "rank": a.rank,
                "pinned": a.pinned,
                "status": a.status,
                "residency": residency(a, asleep, home),
            }
            for a in self.listed
        ]
