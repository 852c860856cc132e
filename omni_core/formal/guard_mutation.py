"""Guard mutation: does every guard of the spec matter to some invariant?

A guard is a conjunct of an action's enabling condition: in the body of an operator that
primes a variable (an action), an item of a conjunction list (`/\\` bullets, also inside a
top-level disjunction's branches, and the `/\\`-separated parts of a one-line item) that
primes nothing and is no UNCHANGED. Each is found mechanically (`find_guards`), replaced by
TRUE in a copy of the spec (`mutate`), and the models are run on the copy until one fails:

- killed: an invariant or property is violated, or TLC stops on an Assert of the spec (a
  table's trigger fired where the generated table forbids it) or an evaluation error;
- survived: every model passes (the guard is dead for these models: either an invariant is
  missing, or the guard only prunes the state space; the report's notes say which);
- timeout: a model ran past its limit (inconclusive).

`omni-core check --mutate-guards [--only GLOB] [--guard-report PATH]`: GLOB matches
`Action#n` names (`IssueSleep#2`). The committed report is tla/guard_mutation.md.
"""

from __future__ import annotations

import argparse
import fnmatch
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omni_core.formal.manifest import load_manifest
from omni_core.formal.reports import summary_line, write_keeping_notes
from omni_core.formal.tlc import run_tlc

REPORT = "guard_mutation.md"
MODULES = ("OmniSleep.tla", "OmniAdmission.tla")
# The models a mutant runs, in order (the first failure ends it): CI models of 10-40 s that
# together take every path but profiles and liveness (no faults; a crash or an error; early
# deadlines and restarts from serving states; duplicates with an asynchronous shell;
# undecodable bytes; a refused reload source; the admission queue). A survivor runs them all,
# so the list is what a full run costs. OmniAdmission's guards matter to admission only.
MODELS = {
    "OmniSleep.tla": ("happy", "crash", "restart", "duplicates", "corrupt", "admission"),
    "OmniAdmission.tla": ("admission",),
}
# A mutant whose state space explodes is stopped and reported "timeout": after this many times
# what the unmutated model took in the same session (so a loaded machine does not turn slow
# runs into timeouts), and never before MIN_TIMEOUT_S.
TIMEOUT_FACTOR = 3.0
MIN_TIMEOUT_S = 30.0
# Conjuncts that choose the model's scope (a config switch, the fault budget), not a rule of
# the protocol: removing one enables what the model left out on purpose. Listed, not run.
SCOPE = re.compile(r'^(Requests|Profiles|(keep => )?FaultOk\("\w+"\)|Bug # "\w+"|"\w+" \\in Faults)$')

_DEF = re.compile(r"^([A-Za-z_]\w*)(\([^)]*\))?\s*==")
_BULLET = re.compile(r"(/\\|\\/)")


@dataclass(frozen=True)
class Guard:
    module: str
    action: str
    index: int  # 1-based within the action
    line: int  # 1-based, first line of the guard
    col: int  # 0-based start column of the guard's text
    end_line: int
    end_col: int  # 0-based, exclusive, on end_line
    text: str

    @property
    def name(self) -> str:
        return f"{self.action}#{self.index}"


def _blank_comments(text: str) -> str:
    """Comments replaced by spaces (line breaks kept), so columns and lines stay put."""
    out = list(text)
    i, depth = 0, 0
    while i < len(text):
        if depth == 0 and text.startswith("\\*", i):
            j = text.find("\n", i)
            j = len(text) if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        elif text.startswith("(*", i):
            depth += 1
            out[i : i + 2] = "  "
            i += 2
        elif depth and text.startswith("*)", i):
            depth -= 1
            out[i : i + 2] = "  "
            i += 2
        else:
            if depth and text[i] != "\n":
                out[i] = " "
            i += 1
    if depth:
        raise ValueError("unterminated (* comment")
    return "".join(out)


def _definitions(lines: list[str]) -> list[tuple[str, int, int]]:
    """(name, first line index, end line index exclusive) of each top-level definition."""
    starts = [(m.group(1), i) for i, line in enumerate(lines) if (m := _DEF.match(line))]
    found = []
    for k, (name, i) in enumerate(starts):
        end = starts[k + 1][1] if k + 1 < len(starts) else len(lines)
        for j in range(i + 1, end):  # a separator or a module's end closes it too
            if lines[j].startswith(("----", "====")):
                end = j
                break
        found.append((name, i, end))
    return found


_OPEN, _CLOSE = "([{", ")]}"


def _split_inline(text: str) -> list[tuple[int, int]]:
    """Spans of the `/\\`-separated parts of a one-line item, at bracket depth 0."""
    spans, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if text.startswith("<<", i):
            depth, i = depth + 1, i + 2
            continue
        if text.startswith(">>", i):
            depth, i = depth - 1, i + 2
            continue
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
        elif depth == 0 and text.startswith("/\\", i):
            spans.append((start, i))
            start = i + 2
            i += 2
            continue
        elif depth == 0 and (text.startswith("\\/", i) or re.match(r"\b(IF|LET|CASE|\\E|\\A)\b", text[i:])):
            return [(0, len(text))]  # a disjunction or a binder at depth 0: one guard, not parts
        i += 1
    spans.append((start, len(text)))
    return [(a, b) for a, b in spans if text[a:b].strip()]


def _items(clean: list[str], first: int, end: int, col: int, op: str) -> list[tuple[int, int]]:
    """The items of the junction list whose bullets (`op`) stand at `col` from line `first`:
    (first line, end line exclusive) of each."""
    items: list[tuple[int, int]] = []
    i = first
    while i < end:
        line = clean[i]
        # the first bullet may follow its parent's on the same line
        if line[col : col + 2] != op or (i > first and line[:col].strip()):
            break
        j = i + 1
        while j < end and (not clean[j].strip() or len(clean[j]) - len(clean[j].lstrip()) > col):
            j += 1
        items.append((i, j))
        i = j
    return items


# Set per module by find_guards: a call of an action is an action, not a guard.
_ACTIONS_CALLED = re.compile(r"(?!x)x")
_BINDER = re.compile(r"^(LET\b.*\bIN|\\E\b[^:]*:(?:\s*LET\b.*\bIN)?)\s*")


def _list_after_binder(clean: list[str], a: int, b: int, body_col: int) -> tuple[int, int] | None:
    """Where the junction list after `LET ... IN` or `\\E x \\in S :` starts, if one does."""
    rest = clean[a][body_col:]
    m = _BINDER.match(rest)
    if m is None:
        return None
    after = rest[m.end() :]
    if after.startswith(("/\\", "\\/")):
        return a, body_col + m.end()
    if not after.strip() and a + 1 < b:
        nxt = clean[a + 1].lstrip()
        if nxt.startswith(("/\\", "\\/")):
            return a + 1, len(clean[a + 1]) - len(nxt)
    return None


def _guards_in(
    clean: list[str], raw: list[str], first: int, end: int, col: int, op: str, found: list[tuple[int, int, int, int]]
) -> None:
    for a, b in _items(clean, first, end, col, op):
        body_col = col + 2
        while body_col < len(clean[a]) and clean[a][body_col] == " ":
            body_col += 1
        text = "\n".join([clean[a][body_col:], *clean[a + 1 : b]])
        head = clean[a][body_col : body_col + 2]
        if (head in ("/\\", "\\/") and op == "/\\") or (head == "/\\" and op == "\\/"):
            _guards_in(clean, raw, a, b, body_col, head, found)  # a nested list: its own items
            continue
        if op == "\\/":
            continue  # a disjunct that is not a conjunction list holds no guard of its own
        inner = _list_after_binder(clean, a, b, body_col)
        if inner is not None:  # LET ... IN or \E ... : followed by a junction list
            line_no, inner_col = inner
            _guards_in(clean, raw, line_no, b, inner_col, clean[line_no][inner_col : inner_col + 2], found)
            continue
        if "'" in text or "UNCHANGED" in text or _ACTIONS_CALLED.search(text):
            continue
        last = max(k for k in range(a, b) if clean[k].strip())
        if last == a:
            for s, e in _split_inline(clean[a][body_col:].rstrip()):
                lead = len(clean[a][body_col + s :]) - len(clean[a][body_col + s :].lstrip())
                stop = (
                    body_col
                    + e
                    - (len(clean[a][body_col + s : body_col + e]) - len(clean[a][body_col + s : body_col + e].rstrip()))
                )
                found.append((a, body_col + s + lead, a, stop))
        else:
            found.append((a, body_col, last, len(clean[last].rstrip())))


def action_names(text: str, known: set[str] | None = None) -> set[str]:
    """The definitions that are actions: they prime a variable, or use one that does."""
    clean = _blank_comments(text).splitlines()
    bodies = {name: "\n".join(clean[first:end]).split("==", 1)[1] for name, first, end in _definitions(clean)}
    actions = set(known or ())
    actions |= {name for name, body in bodies.items() if "'" in body}
    while True:
        called = re.compile(r"\b(" + "|".join(sorted(actions)) + r")\b") if actions else None
        more = {n for n, b in bodies.items() if n not in actions and called is not None and called.search(b)}
        if not more:
            return actions
        actions |= more


def find_guards(text: str, module: str = "OmniSleep.tla", known_actions: set[str] | None = None) -> list[Guard]:
    """Every guard of every action in a module's text, in file order. `known_actions`: the
    actions of the modules it extends (a call of one is an action, not a guard)."""
    raw = text.splitlines()
    clean = _blank_comments(text).splitlines()
    guards: list[Guard] = []
    global _ACTIONS_CALLED
    defs = _definitions(clean)
    actions = action_names(text, known_actions)
    _ACTIONS_CALLED = re.compile(r"\b(" + "|".join(sorted(actions)) + r")\b") if actions else re.compile(r"(?!x)x")
    for name, first, end in defs:
        if name not in actions or name in (known_actions or set()):
            continue
        spans: list[tuple[int, int, int, int]] = []
        start = first
        after = clean[first].split("==", 1)[1]
        if after.strip():  # the list starts on the definition's line
            m = _BULLET.search(after)
            if m is None or after[: m.start()].strip():
                continue
            col = len(clean[first]) - len(after) + m.start()
            op = m.group(1)
        else:
            start = next((k for k in range(first + 1, end) if clean[k].strip()), end)
            if start == end:
                continue
            stripped = clean[start].lstrip()
            if not stripped.startswith(("/\\", "\\/")):
                continue
            col, op = len(clean[start]) - len(stripped), stripped[:2]
        _guards_in(clean, raw, start, end, col, op, spans)
        for k, (a, c, b, e) in enumerate(spans, 1):
            piece = "\n".join(raw[a : b + 1])
            lines = piece.splitlines()
            lines[-1] = lines[-1][:e]
            lines[0] = lines[0][c:] if a < b else raw[a][c:e]
            guard_text = " ".join(" ".join(lines).split())
            guards.append(Guard(module, name, k, a + 1, c, b + 1, e, guard_text))
    return guards


def mutate(text: str, guard: Guard) -> str:
    """The module with `guard` replaced by TRUE (its other lines blanked; bullets keep their
    columns, so the junction lists around it parse as before)."""
    lines = text.splitlines()
    a, b = guard.line - 1, guard.end_line - 1
    if a == b:
        pad = " " * max(0, guard.end_col - guard.col - 4)  # what follows keeps its column
        lines[a] = lines[a][: guard.col] + "TRUE" + pad + lines[a][guard.end_col :]
    else:
        lines[a] = lines[a][: guard.col] + "TRUE"
        for k in range(a + 1, b + 1):
            lines[k] = ""
    return "\n".join(lines) + "\n"


@dataclass
class Verdict:
    guard: Guard
    result: str  # "killed", "survived", "timeout"
    by: str  # the invariant, property or error that killed it; for a survivor, the models run
    model: str
    seconds: float


def _killed_by(result) -> str | None:
    if result.outcome in ("invariant", "action_property"):
        return result.violated or result.outcome
    if result.outcome == "temporal":
        return "a temporal property"
    if result.outcome == "error":
        if "Assert" in result.error and "forbids" in result.error:
            return "Assert: a trigger the generated table forbids"
        return f"TLC error: {result.error[:120]}"
    return None


def _spec_of(root: Path, config: str) -> str:
    return "OmniAdmission.tla" if "AdmSpec" in (root / config).read_text() else "OmniSleep.tla"


def baselines(root: Path, models: dict[str, str]) -> dict[str, float]:
    """Seconds each unmutated model takes now: the yardstick of a mutant's time limit."""
    out = {}
    for name, config in models.items():
        result = run_tlc(root / _spec_of(root, config), root / config, workers=2, timeout_s=3600)
        if result.outcome != "ok":
            raise RuntimeError(f"the unmutated model {name} does not pass ({result.got}): fix it first")
        out[name] = result.seconds
    return out


def check_guard(guard: Guard, root: Path, models: dict[str, str], limits_s: dict[str, float]) -> Verdict:
    """Run the mutant of `guard` on the models (name -> config) until one fails; each run is
    limited to limits_s[name]."""
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="omni-mutant-") as tmp:
        work = Path(tmp)
        for path in root.glob("*.tla"):
            shutil.copy(path, work / path.name)
        for sub in ("models", "bugs"):
            if (root / sub).is_dir():
                shutil.copytree(root / sub, work / sub)
        (work / guard.module).write_text(mutate((root / guard.module).read_text(), guard))
        for name, config in models.items():
            result = run_tlc(work / _spec_of(root, config), work / config, workers=2, timeout_s=limits_s[name])
            if result.outcome == "timeout":
                return Verdict(
                    guard,
                    "timeout",
                    f"past {limits_s[name]:.0f} s ({TIMEOUT_FACTOR:.0f}x the model)",
                    name,
                    time.monotonic() - start,
                )
            by = _killed_by(result)
            if by is not None:
                return Verdict(guard, "killed", by, name, time.monotonic() - start)
    return Verdict(guard, "survived", ", ".join(models), "", time.monotonic() - start)


def _models_for(module: str, root: Path, only: list[str] | None = None) -> dict[str, str]:
    """The models a mutant of `module` runs (MODELS), narrowed to `only` where given."""
    _, entries = load_manifest(root)
    configs = {m.name: m.config for m in entries}
    return {name: configs[name] for name in MODELS[module] if name in configs and (not only or name in only)}


def all_guards(root: Path) -> list[Guard]:
    guards: list[Guard] = []
    known: set[str] = set()
    for module in MODULES:  # in EXTENDS order: each knows the actions of those before it
        if (root / module).is_file():
            text = (root / module).read_text()
            guards += find_guards(text, module, known)
            known |= action_names(text, known)
    return guards


def write_report(path: Path, verdicts: list[Verdict], total_s: float, models: list[str] | None = None) -> None:
    killed = sum(v.result == "killed" for v in verdicts)
    survived = [v for v in verdicts if v.result == "survived"]
    scope = sum(v.result == "scope" for v in verdicts)
    write_keeping_notes(
        path,
        [
            "# Guard mutation",
            "",
            "Generated by `omni-core check --mutate-guards --guard-report tla/guard_mutation.md`",
            "(omni_core/formal/guard_mutation.py): each guard of an action of the spec replaced by TRUE",
            "in a copy, the models run on the copy until one fails. Models run: "
            + (", ".join(f"`{m}`" for m in models) if models else "see MODELS in guard_mutation.py")
            + ".",
            "",
            f"Guards: {len(verdicts)}; killed: {killed}; survived: {len(survived)}; "
            f"timeout: {len(verdicts) - killed - len(survived) - scope}; scope switches: {scope}; "
            f"{total_s:.0f} s in all.",
            "",
            "| guard | where | text | result | by | model | s |",
            "|---|---|---|---|---|---|---|",
            *[
                f"| {v.guard.name} | {v.guard.module.removesuffix('.tla')}:{v.guard.line} | "
                f"`{v.guard.text[:80].replace('|', '/')}` | {v.result} | {v.by if v.result != 'survived' else ''} | "
                f"{v.model} | {v.seconds:.0f} |"
                for v in verdicts
            ],
            "",
        ],
    )


_COUNTS = re.compile(
    r"^Guards: (\d+); killed: (\d+); survived: (\d+); timeout: (\d+); scope switches: \d+; "
    r"(\d+) s",
    re.MULTILINE,
)


def summary_of_report(path: Path) -> str:
    m = summary_line(path, _COUNTS, "guard mutation", f"omni-core check --mutate-guards --guard-report {path}")
    if isinstance(m, str):
        return m
    n, killed, survived, timeout, secs = m.groups()
    return (
        f"guard mutation: {n} guards, {killed} killed, {survived} survived (each explained), {timeout} "
        f"timed out; {path} ({secs} s; rerun: omni-core check --mutate-guards)"
    )


def run(args: argparse.Namespace, root: Path, echo=print) -> int:
    if getattr(args, "relocate", False):
        report = Path(getattr(args, "guard_report", None) or root / REPORT)
        lost = relocate_report(report, root)
        echo(
            f"{report}: rows moved to the spec's lines; "
            + (f"not found, rerun: {'; '.join(lost)}" if lost else "all found")
        )
        return 1 if lost else 0
    guards = all_guards(root)
    if args.only:
        guards = [g for g in guards if any(fnmatch.fnmatch(g.name, p) for p in args.only)]
    if args.list:
        for g in guards:
            echo(f"{g.name:24} {g.module}:{g.line:<5} {g.text[:90]}")
        return 0
    start = time.monotonic()
    only_models = getattr(args, "mutation_models", None)
    wanted = {
        m: c for g in guards if not SCOPE.match(g.text) for m, c in _models_for(g.module, root, only_models).items()
    }
    base = baselines(root, wanted)
    limits = {m: max(MIN_TIMEOUT_S, TIMEOUT_FACTOR * s) for m, s in base.items()}
    echo("unmutated: " + ", ".join(f"{m} {s:.0f} s" for m, s in base.items()))
    verdicts = []
    # Last guards first: the admission queue's and the stage's, then the ranks' (whose
    # mutants are the likeliest to blow the state space up and run to their limit).
    for guard in reversed(guards):
        if SCOPE.match(guard.text):
            v = Verdict(guard, "scope", "a switch of the model's scope: not mutated", "", 0.0)
        else:
            v = check_guard(guard, root, _models_for(guard.module, root, only_models), limits)
        verdicts.append(v)
        by = v.by if v.result != "survived" else ""
        echo(
            f"{guard.name:24} {guard.module}:{guard.line:<5} {v.result:9} {by:50.50} "
            f"{v.model:12} {v.seconds:6.1f} s  {guard.text[:60]}"
        )
    total_s = time.monotonic() - start
    verdicts.reverse()  # file order again
    survived = [v for v in verdicts if v.result == "survived"]
    echo(
        f"{len(verdicts)} guards: {len(verdicts) - len(survived)} killed or inconclusive, "
        f"{len(survived)} survived, {total_s:.0f} s"
    )
    report_path = getattr(args, "guard_report", None)
    if report_path is not None:
        write_report(Path(report_path), verdicts, total_s, sorted(wanted))
        echo(f"wrote {report}")
    return 0


_ROW = re.compile(r"^\| (\w+)#(\d+) \| (\w+):(\d+) \| `(.*?)` \|", re.MULTILINE)


def _cited(guard: Guard) -> tuple[str, str]:
    return guard.name, f"{guard.module.removesuffix('.tla')}:{guard.line}"


def stale_rows(path: Path, root: Path) -> list[str]:
    """Rows of the committed report that name a guard the spec no longer has at that place
    with that text (the spec moved: `--relocate` updates the places, a changed guard needs a rerun)."""
    if not path.is_file():
        return []
    current = {(g.name, g.module.removesuffix(".tla"), g.line): g.text[:80].replace("|", "/") for g in all_guards(root)}
    return [
        f"{action}#{n} at {module}:{line}: the spec has no such guard `{text[:60]}`"
        for action, n, module, line, text in _ROW.findall(path.read_text())
        if current.get((f"{action}#{n}", module, int(line))) != text
    ]


def relocate_report(path: Path, root: Path) -> list[str]:
    """Rewrite each row's guard name and place to where the spec has that action's guard with
    that text now (in order, for a text that occurs twice); the verdicts are kept. Returns the
    rows it could not place (their guard changed or is gone: rerun them)."""
    free: dict[tuple[str, str], list[Guard]] = {}
    for g in all_guards(root):
        free.setdefault((g.action, g.text[:80].replace("|", "/")), []).append(g)
    lost: list[str] = []

    def place(m: re.Match[str]) -> str:
        action, _, _, _, text = m.groups()
        options = free.get((action, text))
        if not options:
            lost.append(f"{action}#{m.group(2)} `{text[:60]}`")
            return m.group(0)
        name, where = _cited(options.pop(0))
        return f"| {name} | {where} | `{text}` |"

    path.write_text(_ROW.sub(place, path.read_text()))
    return lost
