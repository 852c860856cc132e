"""Generate `tla/OmniTransitions.tla` from the transition tables in `omni_core.fsm`.

The tables are the single source of truth (docs/design.md): the TLA+ spec takes every legality
check and next state of a worker or stage action from this generated module, never from a
second hand-written table. `omni-core check` and `tests/formal/test_generated_fresh.py`
fail while the committed file differs from what this module renders.

    python -m omni_core.formal.gen_transitions          # rewrite the file
    python -m omni_core.formal.gen_transitions --check  # exit 1 when stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from omni_core.formal.manifest import tla_dir
from omni_core.fsm import STAGE_TRANSITIONS, WORKER_TRANSITIONS, Transition
from omni_core.fsm.admission import ADMISSION, QUEUE_RULES, AdmissionPolicy
from omni_core.fsm.settle import SETTLE_ROWS
from omni_core.fsm.tags import DEFAULT_TAGS
from omni_core.protocol import StageState, WorkerState

MODULE = "OmniTransitions"
REGEN_COMMAND = "omni-core check --regen (or: python -m omni_core.formal.gen_transitions)"
NO_TRANSITION = "NoTransition"


def default_path() -> Path:
    """`tla/OmniTransitions.tla` of the checkout this package lives in, or of the wheel's copy."""
    return tla_dir() / f"{MODULE}.tla"


def _q(value: str) -> str:
    return f'"{value}"'


def _set(name: str, values: list[str]) -> str:
    """`name == {...}` wrapped at 100 columns, continuation lines aligned after the brace."""
    indent = " " * (len(name) + len(" == {"))
    if not values:
        return f"{name} == {{}}"
    lines, line = [], ""
    for item in (_q(v) for v in values):
        piece = item if not line else f", {item}"
        if len(indent) + len(line) + len(piece) > 96:
            lines.append(line + ",")
            line = item
        else:
            line += piece
    lines.append(line)
    return f"{name} == {{" + f"\n{indent}".join(lines) + "}"


def _lifecycle(prefix: str, states: list[str], initial: str, table: tuple[Transition, ...]) -> str:
    """Operators of one lifecycle; `prefix` is Worker or Stage."""
    triggers = list(dict.fromkeys(t.trigger for t in table))
    rows: list[tuple[str, str, str, str]] = []  # (src, trigger, dst, why)
    for t in table:
        for src in t.sources:
            dst = t.dest.value if t.dest is not None else src.value
            rows.append((src.value, t.trigger, dst, t.why))
    width = max(len(f"<<{_q(s)}, {_q(g)}, {_q(d)}>>") for s, g, d, _ in rows)
    rel_lines = []
    for i, (src, trig, dst, why) in enumerate(rows):
        tup = f"<<{_q(src)}, {_q(trig)}, {_q(dst)}>>"
        sep = "," if i < len(rows) - 1 else " "
        rel_lines.append(f"    {tup}{sep}{' ' * (width - len(tup))} \\* {why}" if why else f"    {tup}{sep}")
    internal = sorted({t.trigger for t in table if t.dest is None})
    out = [
        f"\\* ---- {prefix.lower()} lifecycle: {len(rows)} rows from {len(triggers)} triggers",
        _set(f"{prefix}States", states),
        "",
        f"{prefix}Initial == {_q(initial)}",
        "",
        _set(f"{prefix}Triggers", triggers),
        "",
        "\\* Internal transitions (dest None in Python): legal, state unchanged.",
        _set(f"{prefix}InternalTriggers", internal),
        "",
        "\\* <<source, trigger, destination>>; an internal transition has destination = source.",
        f"{prefix}Relation == {{",
        *rel_lines,
        "}",
        "",
        f"{prefix}Table == [g \\in {prefix}Triggers |-> [s \\in {prefix}States |->",
        f"    IF \\E row \\in {prefix}Relation : row[1] = s /\\ row[2] = g",
        f"    THEN (CHOOSE row \\in {prefix}Relation : row[1] = s /\\ row[2] = g)[3]",
        f"    ELSE {NO_TRANSITION}]]",
        "",
        f"{prefix}Legal(s, g) == g \\in {prefix}Triggers /\\ {prefix}Table[g][s] # {NO_TRANSITION}",
        "",
        f"{prefix}Next(s, g) == {prefix}Table[g][s]",
    ]
    return "\n".join(out)


def _record(name: str, pairs: list[tuple[str, str]]) -> str:
    """`name == [key |-> "value", ...]` for a settle outcome -> value mapping."""
    return f"{name} == [" + ", ".join(f"{k} |-> {_q(v)}" for k, v in pairs) + "]"


def _settle() -> str:
    """fsm/settle.py's SETTLE_ROWS: where a wake or a reload ends, and what fires there."""
    rows = SETTLE_ROWS
    return "\n".join(
        [
            "\\* ---- settled outcomes (fsm/settle.py SETTLE_ROWS): what a wake or reload ends in",
            _set("SettledOutcomes", [r.settled.value for r in rows]),
            _record("RankState", [(r.settled.value, r.rank_state.value) for r in rows]),
            _record("Restored", [(r.settled.value, r.after_wake) for r in rows]),
            _record("Reloaded", [(r.settled.value, r.after_reload) for r in rows if r.after_reload]),
            _record("WakeCommit", [(r.settled.value, r.stage_commit) for r in rows]),
            _record("StageOfSettled", [(r.settled.value, r.stage_state.value) for r in rows]),
        ]
    )


def _rows3(name: str, rows: list[tuple[str, str, str]]) -> str:
    body = ",\n".join(f"    <<{_q(a)}, {_q(b)}, {_q(c)}>>" for a, b, c in rows)
    return f"{name} == {{\n{body}\n}}"


def _admission() -> str:
    """fsm/admission.py's tables, with what TLC checks of them at every run (ASSUME)."""
    policies = [p.value for p in AdmissionPolicy]
    admission = [(s.value, p.value, row.decision.value) for row in ADMISSION for s in row.states for p in row.policies]
    queue = [(s.value, p.value, row.action.value) for row in QUEUE_RULES for s in row.states for p in row.policies]
    return "\n".join(
        [
            "\\* ---- admission (fsm/admission.py): <<stage state, policy, decision>>",
            _set("AdmissionPolicies", policies),
            _rows3("Admission", admission),
            _rows3("QueueRules", queue),
            "",
            "\\* Both tables are total and disjoint over (state, policy), and a request runs exactly",
            '\\* where the stage table allows "execute" (P-7). TLC evaluates these before any model.',
            "ASSUME \\A s \\in StageStates, p \\in AdmissionPolicies :",
            "    /\\ Cardinality({a \\in Admission : a[1] = s /\\ a[2] = p}) = 1",
            "    /\\ Cardinality({q \\in QueueRules : q[1] = s /\\ q[2] = p}) = 1",
            'ASSUME \\A a \\in Admission : (a[3] = "run") <=> StageLegal(a[1], "execute")',
            'ASSUME \\A q \\in QueueRules : (q[3] = "dispatch") <=> StageLegal(q[1], "execute")',
        ]
    )


def render() -> str:
    worker = _lifecycle("Worker", [s.value for s in WorkerState], WorkerState.LOADING.value, WORKER_TRANSITIONS)
    stage = _lifecycle("Stage", [s.value for s in StageState], StageState.STARTING.value, STAGE_TRANSITIONS)
    header = f"---------------------------- MODULE {MODULE} ----------------------------"
    return "\n".join(
        [
            header,
            "(* GENERATED by `omni-core check --regen` (or `python -m omni_core.formal.gen_transitions`)",
            "   from omni_core/fsm (WORKER_TRANSITIONS in fsm/worker.py, STAGE_TRANSITIONS in",
            "   fsm/stage.py); do not edit. The transition relation of both lifecycles as data:",
            "   OmniSleep.tla takes every legality check and next state from here, and where",
            "   a wake or reload settles (fsm/settle.py); admission (fsm/admission.py) is checked",
            "   against the stage table by the ASSUMEs at the end.                              *)",
            "EXTENDS FiniteSets",
            "",
            f'{NO_TRANSITION} == "-"',
            "",
            "\\* A stage's tags when it names none (fsm/tags.py DEFAULT_TAGS): the models' Tags;",
            "\\* trace validation uses the traced stage's own.",
            _set("DefaultTags", list(DEFAULT_TAGS)),
            "",
            worker,
            "",
            stage,
            "",
            _settle(),
            "",
            _admission(),
            "",
            "=" * len(header),
            "",
        ]
    )


def stale_message(path: Path) -> str:
    """Why `path` is not fresh: missing (an install without the spec, a deleted file) is said
    as missing, since regenerating it would not bring back the rest of the spec."""
    if not path.is_file():
        return (
            f"{path} is missing: this install of omni-core has no generated transitions module "
            f"there. In a checkout: git checkout -- tla/ (or {REGEN_COMMAND}); an installed "
            "omni-core: reinstall it from a wheel, which carries the spec."
        )
    return (
        f"{path} is stale: the transition tables in omni_core/fsm changed since it was generated. Run: {REGEN_COMMAND}"
    )


def is_fresh(path: Path | None = None) -> bool:
    path = path or default_path()
    return path.is_file() and path.read_text() == render()


def write(path: Path | None = None) -> bool:
    """Write the module; True when the file changed."""
    path = path or default_path()
    text = render()
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_core.formal.gen_transitions", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when the file is stale")
    parser.add_argument("--path", type=Path, default=None)
    args = parser.parse_args(argv)
    path = args.path or default_path()
    if args.check:
        if is_fresh(path):
            print(f"{path}: up to date")
            return 0
        print(stale_message(path), file=sys.stderr)
        return 1
    print(f"{path}: {'written' if write(path) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
