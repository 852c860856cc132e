"""OmniSwap's behaviours as an incoming stage's memory gate sees them.

TLC writes the whole state graph of a swap model (`-dump dot`); each edge that moves an
incoming stage is read, from its two states, as what the gate observed and did:

    ("admit",)               the running budget covered the next allocation: no query
    ("query", free, how)     it read `free` chunks of free memory; `how` is "admit" or "wait"
    ("map", ok)              the admitted allocation's map: done, or the driver's OOM
    ("expire",)              the wait is over: roll back, NACK NO_MEMORY
    ("fail",)                the stage failed (only bug models do this)
    ("stuck",)               nothing can move any more and the stage still waits
    ("loop",)                the behaviour comes back to a state it passed (bug models spin)

Every behaviour from the initial state to the stage's end gives one such sequence per
incoming stage; `behaviours` returns the distinct ones. A query that saw what the one
before it saw changes no state and leaves no edge: the sequences keep only queries that
changed something (tests/formal/test_swap_gate.py replays them through
omni_core/workers/memory_gate.py, whose polling makes the same queries).

memory_wait_s = 0 (`MayWait = FALSE`): a refusal at once is a query that found too
little (or an OOM) followed by ("expire",), since that is what the gate does: look, find
the wait already over, refuse.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from omni_core.formal.tlc import run_tlc

MAX_BEHAVIOURS = 100_000  # distinct sequences per stage; the models give a few hundred

_NODE = re.compile(r'^(-?\d+) \[label="(.*)"(,style = filled)?\];?$')
_EDGE = re.compile(r"^(-?\d+) -> (-?\d+) ")
_CONSTANT = re.compile(r"^\s*(\w+)\s*(=|<-)\s*(\S+)\s*$")
_RECORD_FIELD = re.compile(r'(\w+) \|-> ("[^"]*"|-?\d+|TRUE|FALSE)')
_STAGE_VARS = ("pc", "next", "mapped", "budget", "waiting")
State = dict[str, object]


class SwapGraphError(ValueError):
    """The dump or the config is not what this reader knows: names the line."""


@dataclass(frozen=True)
class SwapModel:
    """The constants of a swap config that the gate's view depends on."""

    cap: int
    reserve: int
    may_wait: bool
    allocs: dict[str, tuple[int, ...]]  # per incoming stage, its allocations in chunks

    @classmethod
    def from_config(cls, text: str) -> SwapModel:
        values: dict[str, str] = {}
        for line in text.splitlines():
            if (m := _CONSTANT.match(line.split("\\*")[0])) is not None:
                values[m.group(1)] = m.group(3)
        try:
            allocs = {"B": _alloc(values["AllocB"])}
            if _alloc(values["AllocC"]):
                allocs["C"] = _alloc(values["AllocC"])
            return cls(int(values["Cap"]), int(values["Reserve"]), values["MayWait"] == "TRUE", allocs)
        except (KeyError, ValueError) as exc:
            raise SwapGraphError(f"not an OmniSwap config (constant {exc} missing or malformed)") from None


def _alloc(name: str) -> tuple[int, ...]:
    if not name.startswith("Alloc_"):
        raise ValueError(name)
    rest = name.removeprefix("Alloc_")
    return () if rest == "none" else tuple(int(x) for x in rest.split("_"))


def _value(text: str) -> object:
    if text.startswith("["):
        return {k: _value(v) for k, v in _RECORD_FIELD.findall(text)}
    if text.startswith('"'):
        return text.strip('"')
    if text in ("TRUE", "FALSE"):
        return text == "TRUE"
    return int(text)


def parse_dot(text: str) -> tuple[dict[str, State], list[tuple[str, str]], list[str]]:
    """(states by id, edges, initial ids) of TLC's `-dump dot` output."""
    states: dict[str, State] = {}
    edges: list[tuple[str, str]] = []
    initial: list[str] = []
    for line in text.splitlines():
        if (m := _EDGE.match(line)) is not None:
            edges.append((m.group(1), m.group(2)))
        elif (m := _NODE.match(line)) is not None:
            state: State = {}
            for part in m.group(2).replace('\\"', '"').split("\\n"):
                name, _, value = part.removeprefix("/\\\\ ").partition(" = ")
                state[name.strip()] = _value(value.strip())
            states[m.group(1)] = state
            if m.group(3):
                initial.append(m.group(1))
    if not states or not initial:
        raise SwapGraphError("no states or no initial state in the dot dump")
    return states, edges, initial


def graph_config(text: str, bug: str | None = None) -> str:
    """The config for a dump: the safety spec and nothing to check (a bug model's graph is
    wanted whole, not up to its violation); `bug` replaces Bug."""
    text = text.replace("SPECIFICATION FairSpec", "SPECIFICATION Spec")
    text = re.sub(r"^\s*(INVARIANT|PROPERT).*", "", text, flags=re.MULTILINE | re.DOTALL)
    if bug is not None:
        text = re.sub(r'^(\s*Bug\s*=\s*)"[^"]*"', rf'\1"{bug}"', text, flags=re.MULTILINE)
    return text


def dump(spec: Path, config: Path, *, bug: str | None = None, timeout_s: float = 120.0) -> str:
    """TLC's state graph of the model (dot), with the Bug constant replaced when asked."""
    with tempfile.TemporaryDirectory(prefix="omni-swapgraph-") as tmp:
        cfg = Path(tmp) / config.name
        cfg.write_text(graph_config(config.read_text(), bug))
        out = Path(tmp) / "graph"
        result = run_tlc(spec, cfg, workers=1, timeout_s=timeout_s, extra_args=("-dump", "dot", str(out)))
        if result.outcome != "ok":
            raise SwapGraphError(f"TLC on {config.name} gave {result.got}: {result.error or result.outcome}")
        return (Path(tmp) / "graph.dot").read_text()


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise SwapGraphError(f"expected an integer in the dump, got {value!r}")
    return value


def _used(model: SwapModel, s: State) -> int:
    mapped = s["mapped"]
    if not isinstance(mapped, dict):
        raise SwapGraphError(f"expected `mapped` to be a record in the dump, got {mapped!r}")
    return _int(s["a"]) + _int(s["other"]) + sum(_int(mapped[k]) for k in model.allocs)


def step_events(model: SwapModel, stage: str, pre: State, post: State) -> tuple[tuple, ...]:
    """What stage `stage`'s gate saw and did on the edge pre -> post (empty: not its step)."""
    view = {v: (pre[v][stage], post[v][stage]) for v in _STAGE_VARS}  # type: ignore[index]
    if all(a == b for a, b in view.values()):
        return ()
    (pc0, pc1), budget0 = view["pc"], int(view["budget"][0])
    need = model.allocs[stage][int(view["next"][0]) - 1]
    free = model.cap - _used(model, pre)
    if pc0 == "acquire":
        if pc1 == "map":
            return (("admit",),) if budget0 >= need else (("query", free, "admit"),)
        if pc1 == "acquire":
            return (("query", free, "wait"),)
        if pc1 == "refused":
            return (("expire",),) if view["waiting"][0] else (("query", free, "wait"), ("expire",))
    elif pc0 == "map":
        if view["mapped"][1] != view["mapped"][0]:
            return (("map", True),)
        ends = {"acquire": (), "refused": (("expire",),), "failed": (("fail",),)}
        if pc1 in ends:
            return (("map", False), *ends[pc1])
    raise SwapGraphError(f"an edge of stage {stage} this reader does not know: {pre} -> {post}")


def behaviours(model: SwapModel, dot: str, stage: str) -> set[tuple[tuple, ...]]:
    """Every distinct sequence of `stage`'s gate events, from an initial state to its end."""
    states, edges, initial = parse_dot(dot)
    succ: dict[str, list[str]] = {k: [] for k in states}
    for a, b in edges:
        if a != b:  # a self-loop is a stuttering step
            succ[a].append(b)
    memo: dict[str, frozenset[tuple[tuple, ...]]] = {}
    on_path: set[str] = set()

    def ends(node: str) -> frozenset[tuple[tuple, ...]]:
        if node in memo:
            return memo[node]
        if node in on_path:  # only a bug model spins (oom_refund): the sequence ends there
            return frozenset({(("loop",),)})
        on_path.add(node)
        found: set[tuple[tuple, ...]] = set()
        if states[node]["pc"][stage] in ("awake", "refused", "failed"):  # type: ignore[index]
            found.add(())
        elif not succ[node]:
            found.add((("stuck",),))  # it waits for ever: nothing else can move
        for nxt in succ[node]:
            head = step_events(model, stage, states[node], states[nxt])
            found.update(head + rest for rest in ends(nxt))
            if len(found) > MAX_BEHAVIOURS:
                raise SwapGraphError(f"more than {MAX_BEHAVIOURS} behaviours of stage {stage}: use a smaller model")
        on_path.discard(node)
        memo[node] = frozenset(found)
        return memo[node]

    out: set[tuple[tuple, ...]] = set()
    for node in initial:
        out |= ends(node)
    return out
