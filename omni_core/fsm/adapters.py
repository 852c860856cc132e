"""The LoRA adapters one rank holds (P-20): their rules, as a sans-IO table.

The worker core owns one `AdapterTable` and consults it before any adapter command or
adapter-bound request goes to the shell; the shell loads and unloads the tensors. The rules:

- capacity: at most `max_loras` adapters hold memory (`loaded` or `stale`), each of rank at
  most `max_lora_rank`; at capacity an add evicts the least recently used unpinned adapter
  (named in the Ack), and is refused naming `max_loras` when every one is pinned;
- base version: an adapter is made for one base weights version and is added only against
  it (or rebound explicitly); an update or a reload to another version makes it `stale`;
- memory: adapters live in the pool of `home_tag` (`adapters`, else `weights`); a sleep that
  discards that tag (level 2) leaves each `gone`, and a level-1 sleep keeps them;
- a request names a `loaded` adapter, else it is refused naming the adapter and why;
- refit: an add from tensors of an adapter held `loaded` raises its version (the rank runs
  requests and commands one at a time, so none straddles it), and is never ALREADY.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import count

from msgspec.structs import replace

from omni_core.protocol import MAX_ADAPTERS, AdapterInfo, AddAdapter
from omni_core.protocol.messages import ADAPTER_NAME_PATTERN, MAX_ADAPTER_NAME_CHARS

DEFAULT_MAX_LORAS = 4
DEFAULT_MAX_LORA_RANK = 64
_NAME = re.compile(ADAPTER_NAME_PATTERN)


def adapter_name_problem(name: object) -> str | None:
    """Why `name` cannot name an adapter on the wire, or None."""
    if not (isinstance(name, str) and 1 <= len(name) <= MAX_ADAPTER_NAME_CHARS and _NAME.match(name)):
        return f"adapter name {name!r:.200} must be 1-{MAX_ADAPTER_NAME_CHARS} characters of [A-Za-z0-9_.:/-]"
    return None


@dataclass
class _Held:
    info: AdapterInfo
    source: str
    used: int  # the table's clock at the last add or request: the LRU order


def _status(info: AdapterInfo, status: str) -> AdapterInfo:
    return replace(info, status=status) if info.status != status else info


class AdapterTable:
    """Every adapter of one rank, by name, with its status and its place in the LRU order."""

    def __init__(self, max_loras: int, max_lora_rank: int, home_tag: str) -> None:
        if not 1 <= max_loras <= MAX_ADAPTERS:
            raise ValueError(f"max_loras must be 1..{MAX_ADAPTERS}, got {max_loras!r}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.home_tag = home_tag  # the pool the adapters' tensors live in
        self._held: dict[str, _Held] = {}
        self._clock = count(1)

    def infos(self) -> tuple[AdapterInfo, ...]:
        return tuple(self._held[name].info for name in sorted(self._held))

    def get(self, name: str) -> AdapterInfo | None:
        held = self._held.get(name)
        return held.info if held is not None else None

    def holding(self) -> list[str]:
        """The adapters that hold memory (loaded or stale), least recently used first."""
        kept = [h for h in self._held.values() if h.info.status != "gone"]
        return [h.info.name for h in sorted(kept, key=lambda h: h.used)]

    # ------------------------------------------------------------------ AddAdapter

    @staticmethod
    def bound_to(command: AddAdapter, weights_version: int) -> int:
        """The base version the adapter is served on: the command's, or (None, or rebound)
        the version held now."""
        return weights_version if command.base_version is None or command.rebind else command.base_version

    def is_already(self, command: AddAdapter, weights_version: int) -> bool:
        held = self._held.get(command.name)
        if held is None or command.tensors is not None:  # a refit must raise the version: never ALREADY
            return False
        return held.info == self._info(command, weights_version) and held.source == command.source

    def add_problem(self, command: AddAdapter, weights_version: int) -> str | None:
        """Why the add is refused before anything is loaded, or None."""
        name = command.name
        if command.rank > self.max_lora_rank:
            return (
                f"adapter {name!r} has rank {command.rank}, above this stage's max_lora_rank "
                f"{self.max_lora_rank}: raise max_lora_rank or add an adapter of lower rank"
            )
        if self.bound_to(command, weights_version) != weights_version:
            return (
                f"adapter {name!r} was made for base weights version {command.base_version}, and this "
                f"rank holds version {weights_version}: add one made for {weights_version}, or pass "
                "rebind to serve it on these weights"
            )
        held = self._held.get(name)
        refit = command.tensors is not None and held is not None and held.info.status == "loaded"
        if refit and held is not None and command.version <= held.info.version:
            return (
                f"adapter {name!r} is loaded at version {held.info.version}; a refit from tensors "
                f"must raise it, and this one says {command.version}: send version "
                f"{held.info.version + 1} or above"
            )
        # One version, one content: a Result's adapter_version names which adapter made it.
        same_version = held is not None and held.info.version == command.version
        if same_version and held is not None and command.tensors is None and held.source != command.source:
            return (
                f"adapter {name!r} version {command.version} was loaded from {held.source!r}; another "
                f"source ({command.source!r}) under the same version would make two adapters' "
                f"results indistinguishable: send version {held.info.version + 1} or above"
            )
        for other in self._held.values():
            if other.info.adapter_id == command.adapter_id and other.info.name != name:
                return (
                    f"adapter id {command.adapter_id} is taken by adapter {other.info.name!r}: "
                    "give each adapter its own id"
                )
        holding = [n for n in self.holding() if n != name]
        if len(holding) >= self.max_loras and all(self._held[n].info.pinned for n in holding):
            return (
                f"max_loras {self.max_loras} adapters are loaded and all are pinned ({holding}): "
                f"unpin or remove one before adding {name!r}, or raise max_loras"
            )
        return None

    def evictions(self, command: AddAdapter) -> tuple[str, ...]:
        """The least recently used unpinned adapter, when adding this one needs its room."""
        holding = [n for n in self.holding() if n != command.name]
        if len(holding) < self.max_loras:
            return ()
        unpinned = [n for n in holding if not self._held[n].info.pinned]
        return tuple(unpinned[: len(holding) - self.max_loras + 1])

    def commit_add(self, command: AddAdapter, weights_version: int, evicted: tuple[str, ...]) -> None:
        for name in evicted:
            self._held.pop(name, None)
        self._held[command.name] = _Held(self._info(command, weights_version), command.source, next(self._clock))
        gone = [h.info.name for h in sorted(self._held.values(), key=lambda h: h.used) if h.info.status == "gone"]
        for name in gone[: max(0, len(self._held) - MAX_ADAPTERS)]:  # the listing stays bounded
            del self._held[name]

    @staticmethod
    def _info(command: AddAdapter, weights_version: int) -> AdapterInfo:
        return AdapterInfo(
            name=command.name,
            adapter_id=command.adapter_id,
            version=command.version,
            # Rebound: the adapter is served on the weights held now, and goes stale with them.
            base_version=AdapterTable.bound_to(command, weights_version),
            rank=command.rank,
            target_modules=command.target_modules,
            pinned=command.pinned,
        )

    # ------------------------------------------------------------------ the other commands

    def remove(self, name: str) -> None:
        self._held.pop(name, None)

    def pin(self, name: str, pinned: bool) -> None:
        held = self._held[name]
        held.info = replace(held.info, pinned=pinned)

    # ------------------------------------------------------------------ lifecycle

    def discarded(self, tags: frozenset[str]) -> None:
        """A sleep discarded `tags`: when the adapters' pool is among them, each is gone."""
        if self.home_tag in tags:
            for held in self._held.values():
                held.info = _status(held.info, "gone")

    def rebased(self, weights_version: int) -> None:
        """The base weights are `weights_version` now: each adapter made for another is stale."""
        for held in self._held.values():
            if held.info.status == "loaded" and held.info.base_version != weights_version:
                held.info = _status(held.info, "stale")

    # ------------------------------------------------------------------ requests

    def request_problem(self, name: str, weights_version: int) -> str | None:
        """Why a request naming adapter `name` cannot run, or None."""
        held = self._held.get(name)
        if held is None:
            return f"adapter {name!r} is not loaded on this rank: add it (AddAdapter) before naming it"
        info = held.info
        if info.status == "gone":
            return f"adapter {name!r} was discarded by a level-2 sleep: add it again before naming it"
        if info.status == "stale":
            return (
                f"adapter {name!r} was made for base weights version {info.base_version}, and this rank "
                f"holds version {weights_version}: add it again for these weights (or with rebind)"
            )
        return None

    def touch(self, name: str) -> None:
        self._held[name].used = next(self._clock)
