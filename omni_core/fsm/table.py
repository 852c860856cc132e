"""Transition tables as data, and the one wrapper that turns a table into a machine.

A lifecycle is declared once as a tuple of `Transition`s. `Lifecycle` builds a
`transitions.Machine` from it (auto-transitions off, invalid triggers raise), and the same
tuple is exported as a dict, a Mermaid diagram and (in `omni_core.formal`) a TLA+ module.
A transition whose `dest` is None is internal: the command is legal there but the state
stays (Execute in ACTIVE, an ALREADY no-op).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from transitions import Machine

# `transitions` logs every state change at INFO. Our cores run on the message hot path and
# trace what matters themselves, so only its warnings are worth a line.
logging.getLogger("transitions").setLevel(logging.WARNING)

S = TypeVar("S", bound=enum.Enum)


@dataclass(frozen=True)
class Transition(Generic[S]):
    trigger: str
    sources: tuple[S, ...]
    dest: S | None  # None: internal transition (legal, state unchanged)
    why: str = ""


class _Model:
    """Holds the machine's state; kept apart from the cores so `transitions` does not add
    trigger methods to their namespace."""

    state: enum.Enum


class Lifecycle(Generic[S]):
    """A `transitions.Machine` over one declared table."""

    def __init__(self, states: type[S], table: tuple[Transition[S], ...], initial: S) -> None:
        self.states = states
        self.table = table
        self._model = _Model()
        self._machine = Machine(
            model=self._model,
            states=list(states),
            transitions=[
                {"trigger": t.trigger, "source": list(t.sources), "dest": t.dest} for t in table
            ],
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )
        self._legal: dict[S, frozenset[str]] = {
            state: frozenset(self._machine.get_triggers(state)) for state in states
        }

    @property
    def state(self) -> S:
        return self._model.state  # type: ignore[return-value]

    def allows(self, trigger: str) -> bool:
        return trigger in self._legal[self.state]

    def fire(self, trigger: str) -> S:
        """Take one transition; raises `transitions.MachineError` when the table forbids it
        (callers check `allows` first, so reaching that is a bug)."""
        self._model.trigger(trigger)  # type: ignore[attr-defined]
        return self.state


def table_as_dict(table: Iterable[Transition]) -> dict[str, dict[str, str | None]]:
    """`{trigger: {source: dest}}` with state names; dest None means internal."""
    out: dict[str, dict[str, str | None]] = {}
    for t in table:
        for source in t.sources:
            out.setdefault(t.trigger, {})[source.value] = t.dest.value if t.dest else None
    return out


def table_as_mermaid(table: Iterable[Transition], initial: enum.Enum) -> str:
    """A Mermaid `stateDiagram-v2`; internal transitions are drawn as self-loops."""
    lines = ["stateDiagram-v2", f"    [*] --> {initial.value}"]
    for t in table:
        for source in t.sources:
            dest = t.dest if t.dest is not None else source
            lines.append(f"    {source.value} --> {dest.value}: {t.trigger}")
    return "\n".join(lines) + "\n"
