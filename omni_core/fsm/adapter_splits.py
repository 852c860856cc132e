"""A stage's split adapters (P-20): all or none across its ranks.

An adapter command goes to every rank and each answers on its own, so an `AddAdapter` (a
refit from tensors above all) or a `RemoveAdapter` may be taken by some ranks and refused by
others. The ranks then disagree on what the name means: some hold the new tensors, some the
old, some none; and a rank that refused a refit holds the version before it beside ranks
that took it. Ranks of one stage compute one result
together, so no request may run on such a mix, and comparing the versions the Results name
is not enough. This table is the stage's memory of it: an adapter whose last add or remove
was taken by some ranks only is split, and the stage refuses every request naming it, sending
nothing to the ranks, until an add or a remove of it is taken by every rank.

It mirrors a base weights update that some ranks wrote and others did not (the stage stops
serving those weights); here only the adapter's requests stop: the base weights are untouched
by an adapter command and serve on. No IO, no clock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from omni_core.protocol import MAX_ADAPTERS, Ack, AddAdapter, Command, RemoveAdapter

# Each split name is held by some rank (it took the add, or refused the remove), so a stage
# has at most MAX_ADAPTERS of them per rank; the bound keeps the table finite all the same.
MAX_SPLIT_ADAPTERS = 4 * MAX_ADAPTERS


class AdapterSplits:
    """Adapter name -> why it is split (the ranks that took its last command, and those that
    refused it), oldest first."""

    def __init__(self, max_split: int = MAX_SPLIT_ADAPTERS) -> None:
        self.max_split = max_split
        self.split: OrderedDict[str, str] = OrderedDict()

    def settled(self, command: Command, acks: Mapping[int, Ack], refusals: Mapping[int, str]) -> str:
        """An adapter command's task ended, every rank answered. Taken by every rank: the
        adapter is whole again. Taken by some and refused by others: it is split, and what
        this returns (else "") says so, for the caller's error."""
        if not isinstance(command, AddAdapter | RemoveAdapter):
            return ""
        name = command.name
        if not refusals:
            self.split.pop(name, None)
            return ""
        if not acks:
            return ""  # refused by every rank: nothing changed on any
        took = {rank: _version_held(ack, name) for rank, ack in sorted(acks.items())}
        self.split[name] = (
            f"adapter {name!r} is split across the ranks: its last {type(command).__name__} was taken by ranks "
            f"{_named(took)} and refused by ranks {sorted(refusals)}"
        )
        self.split.move_to_end(name)
        while len(self.split) > self.max_split:
            self.split.popitem(last=False)
        return (
            f"the stage now refuses requests naming adapter {name!r} until an AddAdapter of it (or a "
            "RemoveAdapter) is taken by every rank"
        )

    def request_problem(self, stage: str, name: str | None) -> str | None:
        """Why a request naming adapter `name` is refused before it goes to any rank, or None."""
        why = self.split.get(name) if name is not None else None
        if why is None:
            return None
        return (
            f"stage {stage!r}: {why}; no request runs on a mix of its versions: add it again "
            "(add_adapter, on every rank) or remove it"
        )

    def clear(self) -> None:
        """Fresh ranks hold no adapters (a restart)."""
        self.split.clear()


def _version_held(ack: Ack, name: str) -> int | None:
    """The version of adapter `name` a rank's Ack lists (None: the rank holds none)."""
    return next((a.version for a in ack.adapters if a.name == name and a.status != "gone"), None)


def _named(took: dict[int, int | None]) -> str:
    return ", ".join(f"{rank} ({'none' if v is None else f'version {v}'})" for rank, v in took.items())
