"""What the code reaches that the models do not: tla/code_reach.md.

    python -m tests.formal.code_reach        # rewrite tla/code_reach.md

The probes are the cores themselves: every scenario of tests/testdata/ runs on the simulator
(the sans-IO stage and worker cores behind the one network) while every transition that
fires and every admission decision is recorded, as (state, trigger) and (state, policy) in
the categories of tla/reachability.md (`omni_core.formal.reachability.CATEGORIES`). What the
models reach is the union of that report's sections (TLC's own observations, which
`omni-core check` keeps fresh). Each key the code reaches and no model does must be
explained by one of `EXPLAINED`'s rules; tests/formal/test_code_reach.py fails on a key no
rule explains, on a rule that explains nothing (a gap closed: drop the rule), and on a stale
report.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from omni_core.formal import reachability as R
from omni_core.formal.manifest import tla_dir
from omni_core.fsm import STAGE_TRANSITIONS, WORKER_TRANSITIONS
from omni_core.fsm import admission as A

REPO = Path(__file__).resolve().parents[2]
TESTDATA = REPO / "tests" / "testdata"
REPORT = "code_reach.md"

Keys = dict[str, set[str]]  # category -> keys, as reachability.CATEGORIES names them


def _state(key: str) -> str:
    return key.partition("/")[0]


# name -> (why the models miss it, which keys: (category, key) -> bool)
EXPLAINED: dict[str, tuple[str, Callable[[str, str], bool]]] = {
    "stop": (
        "tla/OmniVersions.tla (model `versions`) stops the stage in every state it rests in and restarts "
        "it from STOPPED, each rank taking its Shutdown; but its start and its sleep are one step each, so "
        "it never rests in STARTING or TRANSITIONING to be stopped there, and none of its ranks is FAILED "
        "(a crash leaves the dead rank's state; a failed load is OmniSleep's, which has no stop). Those are "
        "P-11's conformance cases (`shutdown_while_asleep`, `second_shutdown`) and the scenarios' "
        "`stop_restart.txt`",
        lambda c, k: (
            (c == "srow" and k in ("STARTING/stop", "TRANSITIONING/stop")) or (c, k) == ("wrow", "FAILED/shutdown")
        ),
    ),
    "pause_admission": (
        "tla/OmniVersions.tla reaches PAUSED itself (a pause, a sleep and a wake while paused, an update, a "
        "resume, a crash, a stop, a restart); a request's admission to a PAUSED stage (held under `queue`) is "
        "tla/OmniPause.tla's (model `pause`, and `pause_long`), which keeps the pause as OmniSleep's RUNNING "
        "with `spaused` set, not a row of OmniAdmission's `Decision`, which the instrumentation wraps",
        lambda c, k: c == "admit" and _state(k) == "PAUSED",
    ),
}


def model_keys(report: Path | None = None) -> Keys:
    """What the models reach: the union over tla/reachability.md's sections."""
    path = report or tla_dir() / R.REPORT
    labels = {label: c for c, (label, _) in R.CATEGORIES.items()}
    reached: Keys = {c: set() for c in R.CATEGORIES}
    for text in R.committed_sections(path).values():
        for line in text.splitlines():
            label, _, rest = line.removeprefix("- ").partition(": ")
            if label in labels:
                category = labels[label]
                missing = set(rest.partition("; not reached: ")[2].split(", ")) - {""}
                reached[category] |= set(R.CATEGORIES[category][1]) - missing
    return reached


def code_keys(scenarios: list[Path] | None = None) -> Keys:
    """What the cores reach running the scenarios: rows that change the state (as the
    report counts them), the states they leave and enter, and the admission decisions."""
    from omni_testing.scenario import parse_blocks, run_blocks
    from tests.lifecycle_helpers import record_transitions

    dest = {
        (name, t.trigger, s.value): t.dest
        for name, table in (("stage", STAGE_TRANSITIONS), ("worker", WORKER_TRANSITIONS))
        for t in table
        for s in t.sources
    }
    decided: set[str] = set()
    admit = A.admit

    def recording(state, policy):  # type: ignore[no-untyped-def]
        decided.add(f"{state.value}/{policy.value}")
        return admit(state, policy)

    A.admit = recording  # the stage core looks it up on the module at each request
    try:
        with record_transitions() as fired:
            for path in scenarios or sorted(TESTDATA.glob("*.txt")):
                run_blocks(parse_blocks(path.read_text())[0])
    finally:
        A.admit = admit
    keys: Keys = {c: set() for c in R.CATEGORIES}
    keys["admit"] = decided
    for name, trigger, state in fired:
        to = dest.get((name, trigger, state))
        if to is not None:
            keys["srow" if name == "stage" else "wrow"].add(f"{state}/{trigger}")
            keys[name] |= {state, to.value}
    return keys


def gaps(code: Keys, models: Keys) -> dict[str, list[str]]:
    return {c: sorted(code[c] - models[c]) for c in R.CATEGORIES if code[c] - models[c]}


def explain(found: dict[str, list[str]]) -> tuple[dict[str, list[str]], list[str]]:
    """(rule -> the category:key it explains, the keys no rule explains)."""
    by_rule: dict[str, list[str]] = {name: [] for name in EXPLAINED}
    unexplained = []
    for category, keys in found.items():
        for key in keys:
            rule = next((name for name, (_, fits) in EXPLAINED.items() if fits(category, key)), None)
            if rule is None:
                unexplained.append(f"{category}:{key}")
            else:
                by_rule[rule].append(f"{category}:{key}")
    return by_rule, unexplained


def render(code: Keys, models: Keys) -> str:
    found = gaps(code, models)
    by_rule, unexplained = explain(found)
    lines = [
        "# Reached by the code, not by the models",
        "",
        "Generated by `python -m tests.formal.code_reach` (tests/formal/code_reach.py; checked by",
        "tests/formal/test_code_reach.py). The code's reach: every scenario of tests/testdata/ on the",
        "simulator, each transition fired and each admission decision recorded; the models' reach: the",
        "union of [`reachability.md`](reachability.md)'s sections. A key reached by the code and by no",
        "model fails the test unless a rule below explains it.",
        "",
        "| category | code | models | code, not models |",
        "|---|---|---|---|",
    ]
    for category, (label, _) in R.CATEGORIES.items():
        lines.append(f"| {label} | {len(code[category])} | {len(models[category])} | {len(found.get(category, []))} |")
    for name, (why, _) in EXPLAINED.items():
        lines += ["", f"### {name}", "", why, "", ", ".join(f"`{k}`" for k in by_rule[name]) or "(none)"]
    lines += ["", "### unexplained", "", ", ".join(f"`{k}`" for k in unexplained) or "(none)", ""]
    return "\n".join(lines)


def main() -> int:
    path = tla_dir() / REPORT
    path.write_text(render(code_keys(), model_keys()))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
