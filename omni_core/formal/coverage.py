"""Dead branches of the spec, from TLC's `-coverage` statistics.

TLC 2.15 with `-coverage N` prints, at the end of a run (and every N minutes), a block that
starts with `The coverage statistics at ...`, then per action of the next-state relation

    <Done line 385, col 1 to line 385, col 7 of module OmniSleep>: 10:10
      line 386, col 8 to line 386, col 15 of module OmniSleep: 10
      |line 386, col 8 to line 386, col 12 of module OmniSleep: 59

the action's header with its distinct and generated successor states, then each expression
evaluated in it with how often (a `|` per level of nesting). An action with no state
generated was never enabled; an expression with count 0 was never evaluated. The same
expression appears once per action that uses it; a branch is dead when no occurrence in no
model evaluated it. A dead expression inside a dead one is not listed again.

TLC 2.15 counts the operands of a conjunction written on one line (`/\\ x' = 0 /\\ y' = 1`)
as never evaluated even where the line ran (the stage's start, `"started"`, shows it: every
model starts, yet its one-line conjunction reads 0). Such zeros are dropped: a primed
assignment or UNCHANGED on a line with a second `/\\` is not reported; the line's guard,
where it has one on its own bullet, is.

`omni-core check --coverage` runs the (non-bug) models with `-coverage` and prints the table;
`--coverage-report tla/coverage.md` rewrites the committed report, keeping the notes that
explain each dead branch (formal/reports.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from omni_core.formal.reports import summary_line, write_keeping_notes

REPORT = "coverage.md"
_BLOCK = "The coverage statistics at"
_LOC = r"line (\d+), col (\d+) to line (\d+), col (\d+) of module (\w+)"
# An action's header; an unnamed disjunct of Next carries its place in parentheses; an
# invariant's or property's header has no counts.
_ACTION = re.compile(rf"^<(\w+) {_LOC}(?: \((\d+) (\d+) (\d+) (\d+)\))?>(?:: (\d+):(\d+))?\s*$")
_EXPR = re.compile(rf"^\s*(\|*){_LOC}: (\d+)(?::\d+)?\s*$")


@dataclass(frozen=True, order=True)
class Loc:
    module: str
    line: int
    col: int
    end_line: int
    end_col: int

    def contains(self, other: Loc) -> bool:
        return (
            self.module == other.module
            and self != other
            and (self.line, self.col) <= (other.line, other.col)
            and (other.end_line, other.end_col) <= (self.end_line, self.end_col)
        )

    def __str__(self) -> str:
        return f"{self.module}:{self.line}"


@dataclass
class Coverage:
    """Per location: times evaluated (expressions) or states generated (actions, by name)."""

    expressions: dict[Loc, int]
    actions: dict[tuple[str, Loc], int]
    action_of: dict[Loc, str]  # the first action an expression was seen under


def _loc(groups: tuple[str, ...]) -> Loc:
    line, col, end_line, end_col, module = groups
    return Loc(module, int(line), int(col), int(end_line), int(end_col))


def parse_coverage(output: str) -> Coverage:
    """The last coverage block of a TLC transcript (the one printed when the run ended)."""
    cut = output.rfind(_BLOCK)
    cov = Coverage({}, {}, {})
    if cut < 0:
        return cov
    action = ""
    for line in output[cut:].splitlines()[1:]:
        if (m := _ACTION.match(line)) is not None:
            action = m.group(1)
            loc = _loc(m.groups()[1:6])
            if m.group(7) is not None:  # the disjunct of `action` that starts there
                loc = Loc(loc.module, int(m.group(7)), int(m.group(8)), int(m.group(9)), int(m.group(10)))
            if m.group(12) is not None:  # an action: states generated; invariants have none
                key = (action, loc)
                cov.actions[key] = cov.actions.get(key, 0) + int(m.group(12))
        elif (m := _EXPR.match(line)) is not None:
            loc = _loc(m.groups()[1:6])
            cov.expressions[loc] = cov.expressions.get(loc, 0) + int(m.group(7))
            cov.action_of.setdefault(loc, action)
        elif line.strip() and not line.startswith(("Progress", "Checkpointing")):
            break  # the block ends at TLC's next message
    return cov


def merge(parts: Iterable[Coverage]) -> Coverage:
    total = Coverage({}, {}, {})
    for part in parts:
        for loc, n in part.expressions.items():
            total.expressions[loc] = total.expressions.get(loc, 0) + n
            total.action_of.setdefault(loc, part.action_of.get(loc, ""))
        for key, n in part.actions.items():
            total.actions[key] = total.actions.get(key, 0) + n
    return total


@dataclass(frozen=True)
class Dead:
    kind: str  # "action never enabled" or "never evaluated"
    loc: Loc
    action: str
    text: str  # the source, first line of it


def _source(root: Path, loc: Loc, cache: dict[str, list[str]]) -> str:
    if loc.module not in cache:
        path = root / f"{loc.module}.tla"
        cache[loc.module] = path.read_text().splitlines() if path.is_file() else []
    lines = cache[loc.module]
    if not 0 < loc.line <= len(lines):
        return ""
    line = lines[loc.line - 1]
    end = loc.end_col if loc.end_line == loc.line else len(line)
    return " ".join(line[loc.col - 1 : end].split())


def _uncounted(root: Path, loc: Loc, cache: dict[str, list[str]]) -> bool:
    """A primed assignment or UNCHANGED inside a one-line conjunction: TLC 2.15 reads it 0."""
    text = _source(root, loc, cache)
    line = cache.get(loc.module, [""] * loc.line)[loc.line - 1] if loc.line <= len(cache.get(loc.module, [])) else ""
    return ("'" in text or text.startswith("UNCHANGED")) and line.count("/\\") >= 2


def dead_branches(cov: Coverage, root: Path) -> list[Dead]:
    """Never-enabled actions and never-evaluated expressions (outermost only), in file order."""
    cache: dict[str, list[str]] = {}
    found = [
        Dead("action never enabled", loc, name, _source(root, loc, cache))
        for (name, loc), n in cov.actions.items()
        if n == 0
    ]
    never = {d.action for d in found}  # their bodies are dead as a whole: one row says so
    zero = sorted(
        loc
        for loc, n in cov.expressions.items()
        if n == 0 and cov.action_of.get(loc) not in never and not _uncounted(root, loc, cache)
    )
    outer = [loc for loc in zero if not any(o.contains(loc) for o in zero)]
    # One row per source line and action: TLC lists each element of a tuple (an UNCHANGED
    # list, a definition like stageVars) apart, which says nothing more than the line does.
    by_line: dict[tuple[str, int, str], Loc] = {}
    for loc in outer:
        key = (loc.module, loc.line, cov.action_of.get(loc, ""))
        first = by_line.setdefault(key, loc)
        if (loc.col, loc.end_line, loc.end_col) > (first.col, first.end_line, first.end_col):
            by_line[key] = Loc(
                loc.module,
                first.line,
                min(first.col, loc.col),
                max(first.end_line, loc.end_line),
                max(first.end_col, loc.end_col) if loc.end_line == first.end_line else loc.end_col,
            )
    found += [
        Dead("never evaluated", loc, action, _source(root, loc, cache)) for (_, _, action), loc in by_line.items()
    ]
    return sorted(found, key=lambda d: d.loc)


def format_table(dead: list[Dead], models: list[str]) -> str:
    head = f"coverage over {len(models)} models ({', '.join(models)}): {len(dead)} dead branches"
    rows = [f"  {d.loc!s:22} {d.kind:21} {d.action:16} {d.text[:70]}" for d in dead]
    return "\n".join([head, *rows])


def write_report(path: Path, dead: list[Dead], models: list[str]) -> None:
    write_keeping_notes(
        path,
        [
            "# Coverage of the spec: dead branches",
            "",
            "Generated by `omni-core check --coverage --coverage-report tla/coverage.md` (TLC 2.15 `-coverage`)",
            f"over the models {', '.join(f'`{m}`' for m in models)}: the actions no model ever enabled and",
            "the expressions no model ever evaluated (outermost only). Line numbers are those of the",
            "committed spec; the notes below say why each is dead.",
            "",
            f"Dead branches: {len(dead)}.",
            "",
            "| where | kind | action | source |",
            "|---|---|---|---|",
            *[f"| {d.loc} | {d.kind} | {d.action} | `{d.text[:90].replace('|', '/')}` |" for d in dead],
            "",
        ],
    )


_COUNT = re.compile(r"^Dead branches: (\d+)\.", re.MULTILINE)


def summary_of_report(path: Path) -> str:
    """One line for `omni-core check`: what the committed report says."""
    m = summary_line(path, _COUNT, "coverage", f"omni-core check --coverage --coverage-report {path}")
    if isinstance(m, str):
        return m
    return f"coverage: {m.group(1)} dead branches, each explained in {path} (rerun: omni-core check --coverage)"


_ROW = re.compile(r"^\| (\w+):(\d+) \| [^|]+ \| [^|]* \| `(.*)` \|$", re.MULTILINE)


def stale_rows(path: Path, root: Path) -> list[str]:
    """Rows of the committed report whose line no longer holds the source they cite (the spec
    moved since the report was written: rerun the command in its header)."""
    if not path.is_file():
        return []
    stale = []
    cache: dict[str, list[str]] = {}
    for module, line, text in _ROW.findall(path.read_text()):
        if module not in cache:
            spec = root / f"{module}.tla"
            cache[module] = spec.read_text().splitlines() if spec.is_file() else []
        lines = cache[module]
        here = " ".join(lines[int(line) - 1].split()).replace("|", "/") if 0 < int(line) <= len(lines) else ""
        if not text or text not in here:
            stale.append(f"{module}:{line} does not hold `{text[:60]}`")
    return stale
