"""Which stage and worker states, table rows and admission rows each TLC model reaches.

A model that never reaches PARTIAL checks nothing about PARTIAL, whatever its comment says.
So every run of a model of OmniSleep or OmniAdmission is instrumented, its state count
unchanged: a copy of the specs gets a wrapper module that EXTENDS the spec and defines

- `ReachState`, a state CONSTRAINT that is always TRUE and prints each stage state and each
  rank's worker state the first time a TLC worker thread sees it (a per-thread register,
  `TLCSet`, holds what it printed);
- `ReachStageNext`, `ReachWorkerNext` and (OmniAdmission) `ReachDecision`, which the config
  substitutes for the generated `StageNext`, `WorkerNext` and `Decision`: the same value,
  printing (state, trigger) or (state, policy, decision) the first time. The spec reads a
  next state only after the table allowed the trigger (`SNext`, `WNext`), while computing a
  successor; so a row counts as reached when TLC evaluated it in a successor it generated.

`omni-core check` compares what each model reached with the committed report
(`tla/reachability.md`: a change fails, `--update-manifest` rewrites the models' sections)
and with the claims of `tla/README.md` (the table between `CLAIMS_BEGIN` and `CLAIMS_END`:
each model and what it must reach), so a model that stops reaching a state it claims fails CI.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from omni_core.formal.tlc import TlcResult, run_tlc
from omni_core.fsm import STAGE_TRANSITIONS, WORKER_TRANSITIONS
from omni_core.fsm.admission import ADMISSION
from omni_core.protocol import StageState, WorkerState

REPORT = "reachability.md"
# The specs whose variables the wrapper reads: spec -> (its stage state variable, the
# operators that give a row's next state: the stage's, the worker's; the config substitutes
# the wrapper's for them). OmniVersions fires rows as S(state, trigger) and W(state, trigger).
HOOKS: dict[str, tuple[str, str, str]] = {
    "OmniSleep.tla": ("sstate", "StageNext", "WorkerNext"),
    "OmniAdmission.tla": ("sstate", "StageNext", "WorkerNext"),
    "OmniVersions.tla": ("stage", "S", "W"),
}
SPECS = tuple(HOOKS)
CLAIMS_BEGIN = "<!-- reach-claims -->"
CLAIMS_END = "<!-- /reach-claims -->"
_REGISTER = 42  # the TLC register the wrapper keeps its printed observations in
_WRAPPER = "ReachOf"

# One category per kind of observation: (report label, the universe of its keys).
CATEGORIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "stage": ("stage states", tuple(s.value for s in StageState)),
    "worker": ("worker states", tuple(s.value for s in WorkerState)),
    "srow": (
        "stage rows (state/trigger)",
        tuple(f"{s.value}/{t.trigger}" for t in STAGE_TRANSITIONS if t.dest is not None for s in t.sources),
    ),
    "wrow": (
        "worker rows (state/trigger)",
        tuple(f"{s.value}/{t.trigger}" for t in WORKER_TRANSITIONS if t.dest is not None for s in t.sources),
    ),
    "admit": (
        "admission rows (state/policy)",
        tuple(f"{s.value}/{p.value}" for row in ADMISSION for s in row.states for p in row.policies),
    ),
}
# Rows are those that change the state: the spec reads an internal row's legality only
# (`execute`, `status`, ...), which a guard evaluates whether or not its action then fires.
# A claim names a category by a prefix: `SLEEPING` (a stage state), `worker:PARTIAL`,
# `srow:PARTIAL/restart`, `wrow:...`, `admit:NEEDS_RELOAD/queue`.
_DEFAULT_CATEGORY = "stage"


def wrapper_module(spec: str) -> str:
    module = spec.removesuffix(".tla")
    admission = module == "OmniAdmission"
    state, _, _ = HOOKS[spec]
    if module == "OmniVersions":  # its rows' next states, read around the S and W it substitutes
        stage_next, worker_next = "TS(s, g)", "TW(s, g)"
    else:
        stage_next, worker_next = "StageTable[g][s]", "WorkerTable[g][s]"
    lines = [
        f"---- MODULE {_WRAPPER}{module} ----",
        f"EXTENDS {module}, TLC",
        f"ASSUME TLCSet({_REGISTER}, {{}})",
        f"ReachSeen(o) == o \\in TLCGet({_REGISTER}) \\/ "
        f'(PrintT(<<"reach", o>>) /\\ TLCSet({_REGISTER}, TLCGet({_REGISTER}) \\cup {{o}}))',
        f'ReachState == ReachSeen(<<"stage", {state}>>) /\\ \\A r \\in Ranks : ReachSeen(<<"worker", wstate[r]>>)',
        f'ReachStageNext(s, g) == IF ReachSeen(<<"srow", s, g>>) THEN {stage_next} ELSE {stage_next}',
        f'ReachWorkerNext(s, g) == IF ReachSeen(<<"wrow", s, g>>) THEN {worker_next} ELSE {worker_next}',
    ]
    if admission:
        lines.append(
            "ReachDecision == LET d == (CHOOSE a \\in Admission : a[1] = sstate /\\ a[2] = spolicy)[3] IN "
            'IF ReachSeen(<<"admit", sstate, spolicy>>) THEN d ELSE d'
        )
    return "\n".join([*lines, "====", ""])


def instrumented_config(text: str, spec: str) -> str:
    _, stage_next, worker_next = HOOKS[spec]
    overrides = [f"{stage_next} <- ReachStageNext", f"{worker_next} <- ReachWorkerNext"]
    if spec == "OmniAdmission.tla":
        overrides.append("Decision <- ReachDecision")
    return text.rstrip("\n") + "\nCONSTRAINT ReachState\nCONSTANT\n" + "".join(f"    {o}\n" for o in overrides)


_LINE = re.compile(r'^<<"reach", <<"(\w+)", (.*)>>>>\s*$', re.MULTILINE)


@dataclass
class Reach:
    """What one model reached: per category, the keys (`STATE`, `STATE/trigger`, ...).
    `categories`: those its spec has (admission rows only in OmniAdmission)."""

    categories: tuple[str, ...] = tuple(CATEGORIES)
    seen: dict[str, set[str]] = field(default_factory=lambda: {c: set() for c in CATEGORIES})

    def missing(self, category: str) -> list[str]:
        return [k for k in dict.fromkeys(CATEGORIES[category][1]) if k not in self.seen[category]]


def categories_of(spec: str) -> tuple[str, ...]:
    return tuple(c for c in CATEGORIES if c != "admit" or spec == "OmniAdmission.tla")


def parse_reach(output: str, spec: str = "OmniAdmission.tla") -> Reach:
    reach = Reach(categories_of(spec))
    for kind, rest in _LINE.findall(output):
        if kind in reach.seen:
            reach.seen[kind].add("/".join(re.findall(r'"([^"]*)"', rest)))
    return reach


def instrumentable(spec: str) -> bool:
    return spec in SPECS


def run_instrumented(root: Path, spec: str, config: Path, **tlc_args) -> tuple[TlcResult, Reach]:
    """TLC on a copy of the specs with the wrapper; the model's own config plus the hooks."""
    with tempfile.TemporaryDirectory(prefix="omni-reach-") as tmp:
        work = Path(tmp)
        for module in root.glob("*.tla"):
            shutil.copy2(module, work / module.name)
        wrapper = work / f"{_WRAPPER}{spec}"
        wrapper.write_text(wrapper_module(spec))
        cfg = work / config.name
        cfg.write_text(instrumented_config(config.read_text(), spec))
        result = run_tlc(wrapper, cfg, **tlc_args)
    return result, parse_reach(result.output, spec)


# ---------------------------------------------------------------- the committed report


def section(model: str, reach: Reach) -> list[str]:
    """The report's lines for one model: per category, reached/all and what is not reached."""
    lines = [f"### `{model}`", ""]
    for category in reach.categories:
        label, universe = CATEGORIES[category]
        total = len(dict.fromkeys(universe))
        missing = reach.missing(category)
        tail = f"; not reached: {', '.join(missing)}" if missing else ""
        lines.append(f"- {label}: {total - len(missing)}/{total}{tail}")
    return [*lines, ""]


_SECTION = re.compile(r"^### `([^`]+)`\n(.*?)(?=^### |\Z)", re.MULTILINE | re.DOTALL)
_HEADER = [
    "# Reachability of the models",
    "",
    "Generated by `omni-core check --update-manifest` (omni_core/formal/reachability.py): for each",
    "model of OmniSleep, OmniAdmission and OmniVersions, how many stage states, worker states, rows",
    "of the stage and worker tables (state/trigger) and admission rows (state/policy) TLC reached,",
    "and which it did not. `omni-core check` fails when a model reaches other than this, or less",
    "than tla/README.md's claims (section Reachability). Rows are those that change the state;",
    "OmniSleep has no stop and no weight updates (OmniVersions has both); weight groups and shares",
    "are in no model here.",
    "",
    "",
]


def committed_sections(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    return {m.group(1): m.group(0).rstrip("\n") for m in _SECTION.finditer(path.read_text())}


def write_report(path: Path, reaches: dict[str, Reach]) -> None:
    """Rewrite the sections of the models in `reaches`, keeping the others."""
    sections = committed_sections(path)
    for model, reach in reaches.items():
        sections[model] = "\n".join(section(model, reach)).rstrip("\n")
    body = "\n\n".join(sections[name] for name in sorted(sections))
    path.write_text("\n".join(_HEADER) + body + "\n")


def differs_from_report(path: Path, model: str, reach: Reach) -> str:
    """Why this run's reach is not the committed one ("" when it is)."""
    now = "\n".join(section(model, reach)).rstrip("\n")
    old = committed_sections(path).get(model)
    if old == now:
        return ""
    if old is None:
        return f"reachability: {model} has no section in {path} (omni-core check --update-manifest writes it)"
    changed = [line for line in now.splitlines() if line not in old.splitlines()]
    return f"reachability changed (if intended: omni-core check --update-manifest): now {'; '.join(changed)[:400]}"


# ---------------------------------------------------------------- the claims in tla/README.md

_CLAIM_ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|([^|]*)\|", re.MULTILINE)


def claims(readme: Path) -> dict[str, list[tuple[str, str]]]:
    """Per model, (category, key) pairs it claims to reach, from the README's claims table."""
    text = readme.read_text() if readme.is_file() else ""
    if CLAIMS_BEGIN not in text or CLAIMS_END not in text:
        return {}
    block = text.split(CLAIMS_BEGIN, 1)[1].split(CLAIMS_END, 1)[0]
    found: dict[str, list[tuple[str, str]]] = {}
    for model, cell in _CLAIM_ROW.findall(block):
        for token in (t.strip() for t in cell.split(",")):
            if token:
                category, _, key = token.rpartition(":")
                found.setdefault(model, []).append((category or _DEFAULT_CATEGORY, key))
    return found


def unmet_claims(model: str, reach: Reach, claimed: dict[str, list[tuple[str, str]]]) -> list[str]:
    """The claims of `model` this run did not reach (a claim naming an unknown key is unmet too)."""
    return [
        f"{category}:{key}"
        for category, key in claimed.get(model, [])
        if category not in reach.categories or key not in reach.seen[category]
    ]
