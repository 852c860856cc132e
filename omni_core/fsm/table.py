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
from typing import Any, Generic, TypeVar

from transitions import Machine, MachineError

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
            transitions=[{"trigger": t.trigger, "source": list(t.sources), "dest": t.dest} for t in table],
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
        )
        # The relation as the machine holds it: state -> trigger -> dest (None: internal).
        self._next: dict[S, dict[str, S | None]] = {state: {} for state in states}
        for trigger, event in self._machine.events.items():
            for source_name, candidates in event.transitions.items():
                dest_name = candidates[0].dest
                self._next[states[source_name]][trigger] = None if dest_name is None else states[dest_name]

    @property
    def state(self) -> S:
        return self._model.state  # type: ignore[return-value]

    def allows(self, trigger: str) -> bool:
        return trigger in self._next[self.state]

    def fire(self, trigger: str) -> S:
        """Take one transition of the machine; raises `transitions.MachineError` when it has
        none for this state (callers check `allows` first, so reaching that is a bug).

        The tables declare no callbacks or conditions, so the library's trigger dispatch
        (about 50 us per call, half a worker's whole command) would only re-derive what
        `_next` holds; the state itself is set through the machine."""
        dest = self._next[self.state].get(trigger, _MISSING)
        if dest is _MISSING:
            raise MachineError(f"Can't trigger event {trigger} from state {self.state.name}!")
        if dest is not None:
            self._machine.set_state(dest, model=self._model)
        return self.state

    def place(self, state: S) -> None:
        """Put the machine in `state` without a transition: a core restored from a snapshot
        (its `restore`), never a step of the lifecycle."""
        if not isinstance(state, self.states):
            raise TypeError(f"a {self.states.__name__} lifecycle cannot be placed in {state!r}")
        self._machine.set_state(state, model=self._model)


_MISSING: Any = object()


def table_as_dict(table: Iterable[Transition[Any]]) -> dict[str, dict[str, str | None]]:
    """`{trigger: {source: dest}}` with state names; dest None means internal."""
    out: dict[str, dict[str, str | None]] = {}
    for t in table:
        for source in t.sources:
            out.setdefault(t.trigger, {})[source.value] = t.dest.value if t.dest else None
    return out


def table_as_mermaid(table: Iterable[Transition[Any]], initial: enum.Enum) -> str:
    """A Mermaid `stateDiagram-v2`; internal transitions are drawn as self-loops."""
    lines = ["stateDiagram-v2", f"    [*] --> {initial.value}"]
    for t in table:
        for source in t.sources:
            dest = t.dest if t.dest is not None else source
            lines.append(f"    {source.value} --> {dest.value}: {t.trigger}")
    return "\n".join(lines) + "\n"
