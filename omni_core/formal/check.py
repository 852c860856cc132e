"""`omni-core check`: model-check the protocol spec with TLC, every model and bug model.

What it runs is listed in `tla/manifest.json`:

- models (`tla/models/*.cfg`): the spec with no defect; TLC must find no error, and the
  number of distinct states must equal the manifest's (a change means the model changed:
  rerun with `--update-manifest` when that was intended);
- bug models (`tla/bugs/*.cfg`): the spec with one known defect (the `Bug` constant); TLC
  must reject each with the invariant (exit 12) or temporal property (exit 13) the
  manifest names. Each is also run as a control with `Bug = "none"`, which must pass: the
  violation comes from the defect, not from the model.

Models marked `"long": true` (crash3: three ranks with crashes and errors, minutes to tens
of minutes on two cores) are skipped unless `--long`, which runs
only them: a nightly job runs both. Each entry records the `seconds` its last run took
(`--update-manifest`), so the time of the formal stage is stated, not guessed.

Every model of OmniSleep and OmniAdmission runs instrumented (formal/reachability.py): what
it reached (stage and worker states, table rows, admission rows) must be what
`tla/reachability.md` says and include what tla/README.md claims for it.

`--coverage` runs the models with TLC's `-coverage` and reports the spec's dead branches
(formal/coverage.py); the guard-mutation report (formal/guard_mutation.py,
`--mutate-guards`) says which guard of the spec no invariant needs.

First, the agreement check (formal/agree.py, row "agree"): one step of the spec's actions
from every small case, replayed on WorkerCore and StageCore, must give the same result;
this covers what the tables do not (order of checks, settle, plan_sleep, expectations).

Before any of that, `tla/OmniTransitions.tla` must equal what `gen_transitions` renders
from the tables in `omni_core.fsm`; when it does not, nothing runs and the message says
which command regenerates it.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from omni_core.formal import (
    agree,
    gen_link_plans,
    gen_transfers,
    gen_transitions,
    gen_versions,
    reachability,
    reports,
)
from omni_core.formal.manifest import MANIFEST, Model, load_manifest, tla_dir
from omni_core.formal.tlc import EXIT_LIVENESS, EXIT_OK, EXIT_SAFETY, TlcNotFoundError, TlcResult, run_tlc
from omni_core.resources import MissingDataError

DEFAULT_TIMEOUT_S = 300.0
LONG_TIMEOUT_S = 4 * 3600.0  # a long model may run for an hour on a loaded machine


@dataclass
class Row:
    model: str
    expected: str
    got: str
    states: int | None
    seconds: float
    ok: bool
    note: str = ""


def select(models: list[Model], *, long: bool, only: list[str] | None) -> list[Model]:
    """The models one run checks: the default list or, with `long`, the long one; `only`
    (globs) narrows either."""
    return [m for m in models if m.long == long and _selected(m.name, only)]


def stated_seconds(models: list[Model]) -> float:
    """What the manifest says these models (and bug models' controls) take, as measured."""
    return sum((m.seconds or 0.0) for m in models)


_PROPERTIES = re.compile(r"^\s*PROPERT(?:Y|IES)\b(.*?)(?=^\s*[A-Z_]{4,}\b|\Z)", re.MULTILINE | re.DOTALL)
_BUG_LINE = re.compile(r'^(\s*Bug\s*=\s*)"[^"]*"', re.MULTILINE)


def config_properties(text: str) -> list[str]:
    """Names after PROPERTY/PROPERTIES in a TLC config (comments dropped)."""
    names: list[str] = []
    for block in _PROPERTIES.findall(text):
        for line in block.splitlines():
            names += line.split("\\*")[0].split()
    return names


def control_config(text: str) -> str:
    """The same config with the defect switched off."""
    if not _BUG_LINE.search(text):
        raise ValueError('bug model config has no `Bug = "..."` line')
    return _BUG_LINE.sub(r'\1"none"', text)


def judge(model: Model, result: TlcResult, properties: list[str]) -> tuple[str, bool, str]:
    """(got, matches, note) for one run against the model's expectation."""
    got = result.got
    if result.outcome == "temporal" and len(properties) == 1:
        got = properties[0]  # TLC 2.15 does not name it; the config checks only this one
    if model.expect == "ok":
        ok = result.outcome == "ok" and result.exit_code == EXIT_OK
    elif model.kind == "temporal":
        ok = result.outcome == "temporal" and result.exit_code == EXIT_LIVENESS and got == model.expect
    elif result.outcome == "action_property":  # a PROPERTIES entry [][A]_v: TLC names it, exits 13
        ok = result.exit_code == EXIT_LIVENESS and got == model.expect
    else:
        ok = result.outcome == "invariant" and result.exit_code == EXIT_SAFETY and got == model.expect
    note = "" if ok else (result.error or f"exit {result.exit_code}")
    return got, ok, note


def _states_note(expected: int | None, got: int | None, update: bool) -> tuple[bool, str]:
    if update or expected is None or expected == got:
        return True, ""
    return False, (
        f"distinct states changed: manifest {expected}, TLC {got} (if the model changed "
        "on purpose: omni-core check --update-manifest)"
    )


def run_models(
    models: list[Model],
    root: Path,
    *,
    workers: int | None,
    timeout_s: float,
    update: bool,
    controls: bool,
    echo=print,
    coverage: dict[str, str] | None = None,
    reach: dict[str, reachability.Reach] | None = None,
) -> tuple[list[Row], dict[str, dict]]:
    """Run each model (and each bug model's control); with `coverage` (a dict), the models
    run with TLC's -coverage and their transcripts are kept there by model name; else, with
    `reach` (a dict), the models of OmniSleep and OmniAdmission run instrumented
    (formal/reachability.py) and what each reached is kept there, checked against the
    committed report (unless `update`) and the README's claims."""
    rows: list[Row] = []
    counts: dict[str, dict] = {}
    claimed = reachability.claims(root / "README.md") if reach is not None else {}
    for model in models:
        spec = root / (model.spec or "OmniSleep.tla")
        config = root / model.config
        text = config.read_text()
        cover = coverage is not None and not model.is_bug
        tlc_workers = workers or model.workers
        if reach is not None and not cover and not model.is_bug and reachability.instrumentable(spec.name):
            result, reach[model.name] = reachability.run_instrumented(
                root, spec.name, config, workers=tlc_workers, timeout_s=timeout_s
            )
        else:
            extra_args = ("-coverage", "60") if cover else ()
            result = run_tlc(spec, config, extra_args=extra_args, workers=tlc_workers, timeout_s=timeout_s)
        if cover and coverage is not None:
            coverage[model.name] = result.output
        got, ok, note = judge(model, result, config_properties(text))
        if ok:
            ok, note = _states_note(model.distinct_states, result.distinct_states, update)
        if ok and reach is not None and model.name in reach:
            ok, note = _reach_note(root, model, reach[model.name], claimed, update)
        rows.append(Row(model.name, model.expect, got, result.distinct_states, result.seconds, ok, note))
        echo(_format_row(rows[-1]))
        counts[model.name] = {"distinct_states": result.distinct_states, "seconds": round(result.seconds, 1)}
        if model.is_bug and controls:
            with tempfile.TemporaryDirectory(prefix="omni-control-") as tmp:
                control = Path(tmp) / config.name
                control.write_text(control_config(text))
                cres = run_tlc(spec, control, workers=workers or 2, timeout_s=timeout_s)
            cok = cres.outcome == "ok"
            cnote = "" if cok else (cres.error or f"{cres.got} (exit {cres.exit_code})")
            if cok:
                cok, cnote = _states_note(model.control_states, cres.distinct_states, update)
            rows.append(Row(f"{model.name} [Bug=none]", "ok", cres.got, cres.distinct_states, cres.seconds, cok, cnote))
            echo(_format_row(rows[-1]))
            counts[model.name]["control_states"] = cres.distinct_states
            counts[model.name]["seconds"] = round(result.seconds + cres.seconds, 1)
    return rows, counts


def _reach_note(
    root: Path, model: Model, seen: reachability.Reach, claimed: dict[str, list[tuple[str, str]]], update: bool
) -> tuple[bool, str]:
    unmet = reachability.unmet_claims(model.name, seen, claimed)
    if unmet:
        return False, (
            f"{model.name} never reached {', '.join(unmet)}, which tla/README.md (Reachability) claims it "
            "reaches: widen the model or correct the claim"
        )
    report = root / reachability.REPORT
    if update or (model.long and model.name not in reachability.committed_sections(report)):
        return True, ""  # a long model's first run has nothing to compare with yet
    changed = reachability.differs_from_report(report, model.name, seen)
    return not changed, changed


_COLUMNS = ("model", "expected", "got", "states", "seconds", "")
_WIDTHS = (38, 32, 32, 9, 8, 4)
_RULE = "-" * (sum(_WIDTHS) + 2 * (len(_WIDTHS) - 1))


def _line(cells: tuple[str, ...]) -> str:
    padded = [c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, _WIDTHS, strict=True))]
    return "  ".join(padded).rstrip()


def _format_row(row: Row) -> str:
    cells = (
        row.model,
        row.expected,
        row.got,
        "-" if row.states is None else str(row.states),
        f"{row.seconds:.1f}",
        "ok" if row.ok else "FAIL",
    )
    return _line(cells) + (f"\n    {row.note}" if row.note else "")


def header() -> str:
    return _line(_COLUMNS) + "\n" + _RULE


def write_manifest(root: Path, data: dict, counts: dict[str, dict]) -> None:
    for entry in data["models"]:
        entry.update(counts.get(entry["name"], {}))
    (root / MANIFEST).write_text(json.dumps(data, indent=2) + "\n")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--regen",
        action="store_true",
        help="rewrite the generated modules (OmniTransitions, LinkPlanTable, VersionTable) first",
    )
    parser.add_argument(
        "--update-manifest", action="store_true", help="record the state counts TLC reports in tla/manifest.json"
    )
    parser.add_argument(
        "--only", action="append", metavar="PATTERN", help="run only models whose name matches (glob, repeatable)"
    )
    parser.add_argument("--no-controls", action="store_true", help="skip the Bug=none control run of each bug model")
    parser.add_argument(
        "--workers", type=int, default=None, help="TLC worker threads (default: per model, from the manifest)"
    )
    parser.add_argument(
        "--timeout-s", type=float, default=DEFAULT_TIMEOUT_S, help="limit per TLC run (default %(default)s)"
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="run the long models instead (crash3, three ranks: minutes to tens of minutes)",
    )
    parser.add_argument(
        "--coverage", action="store_true", help="run the models with TLC -coverage and report the spec's dead branches"
    )
    parser.add_argument(
        "--coverage-report",
        metavar="PATH",
        type=Path,
        help="with --coverage: also write the report here (tla/coverage.md keeps its notes)",
    )
    parser.add_argument(
        "--mutate-guards",
        action="store_true",
        help="instead: remove each guard of the spec in turn and run the models (formal/guard_mutation.py)",
    )
    parser.add_argument(
        "--mutation-models",
        action="append",
        metavar="NAME",
        help="with --mutate-guards: run only these of the mutation models (repeatable)",
    )
    parser.add_argument(
        "--guard-report",
        metavar="PATH",
        type=Path,
        help="with --mutate-guards: also write the report here (tla/guard_mutation.md keeps its notes)",
    )
    parser.add_argument(
        "--relocate",
        action="store_true",
        help="with --mutate-guards: only move the report's rows to the spec's current lines (no TLC run)",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the models (with --mutate-guards: the guards) and exit"
    )
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results (with --trace: each stage's verdict) "
        "as JSON here; `-`: on stdout, the text on stderr",
    )
    parser.add_argument("--tla-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="instead: validate this JSON-lines trace (omni-core demo --synthetic --trace) against the spec",
    )
    parser.add_argument("--stage", metavar="NAME", help="with --trace: only this stage (default: every stage)")
    parser.add_argument(
        "--chunk-events",
        type=int,
        default=400,
        metavar="N",
        help="with --trace: replay a long stage in chunks of about N events (0: one run)",
    )
    parser.add_argument("--keep-trace-spec", metavar="DIR", help=argparse.SUPPRESS)  # keep the generated files


def _selected(name: str, only: list[str] | None) -> bool:
    return not only or any(fnmatch.fnmatch(name, p) for p in only)


def _agreement(name: str, compute, echo) -> Row:
    """Run one agreement check: `compute()` gives (cases, disagreements, counts line)."""
    start = time.monotonic()
    try:
        cases, found, counts = compute()
    except agree.AgreeParseError as exc:
        row = Row(name, "ok", "error", None, time.monotonic() - start, False, str(exc))
    else:
        row = Row(
            name,
            "ok",
            "ok" if not found else f"{len(found)} disagree",
            cases,
            time.monotonic() - start,
            not found,
            f"first: {found[0]}" if found else "",
        )
        if not found:
            echo(f"{name}: {counts}")
    echo(_format_row(row))
    return row


def agreement_row(root: Path, timeout_s: float, echo=print) -> Row:
    """The Python cores against one step of the spec's actions from every small case
    (formal/agree.py): the order of the worker's checks, settle, plan_sleep, the stage's
    expectations. Reports the first disagreement and how many there are."""

    def compute():
        table = agree.spec_table(root, timeout_s=timeout_s)
        cases = len(table.worker_cases) + len(table.done) + len(set(table.stage_cases)) + len(table.reply)
        return cases, agree.compare(table), agree.counts(table)

    return _agreement("agree", compute, echo)


def ranks_agreement_row(root: Path, timeout_s: float, echo=print) -> Row:
    """StageCore against the spec over every short reply sequence at two ranks
    (formal/agree_ranks.py)."""
    from omni_core.formal import agree_ranks

    def compute():
        table = agree_ranks.spec_table(root, timeout_s=timeout_s)
        steps = sum(len(s) for s in table.values())
        return len(table), agree_ranks.compare(table), f"{len(table)} reply sequences, {steps} steps"

    return _agreement("agree/ranks", compute, echo)


def admission_agreement_row(root: Path, timeout_s: float, echo=print) -> Row:
    """StageCore's admission (on_submit, _pump) against OmniAdmission's first step from every
    small case (formal/agree_admission.py)."""
    from omni_core.formal import agree_admission

    def compute():
        steps = agree_admission.spec_steps(root, timeout_s=timeout_s)
        return len(steps), agree_admission.compare(steps), f"{len(steps)} cases (state, policy, queued, in flight)"

    return _agreement("agree/admission", compute, echo)


def run(args: argparse.Namespace, echo=print) -> int:
    echo = reports.text_echo(getattr(args, "json", None), echo)
    if getattr(args, "trace", None):
        from omni_core.formal import trace_check

        if args.timeout_s == DEFAULT_TIMEOUT_S:
            args.timeout_s = trace_check.DEFAULT_TIMEOUT_S
        return trace_check.run(args, echo)
    try:
        root = args.tla_dir or tla_dir()
    except MissingDataError as exc:
        echo(f"FAIL {exc}")
        return 2
    if not (root / MANIFEST).is_file():
        echo(
            f"FAIL {root / MANIFEST} is missing: the list of models to check is part of the spec; restore tla/ "
            "(git checkout -- tla/ in a checkout; reinstall omni-core otherwise)"
        )
        return 2
    generated = root / f"{gen_transitions.MODULE}.tla"
    plans = root / f"{gen_link_plans.MODULE}.tla"
    versions = root / f"{gen_versions.MODULE}.tla"
    transfers = root / f"{gen_transfers.MODULE}.tla"
    if args.regen:
        changed = gen_transitions.write(generated)
        echo(f"{generated}: {'regenerated' if changed else 'already up to date'}")
        echo(f"{plans}: {'regenerated' if gen_link_plans.write(plans) else 'already up to date'}")
        echo(f"{versions}: {'regenerated' if gen_versions.write(versions) else 'already up to date'}")
        echo(f"{transfers}: {'regenerated' if gen_transfers.write(transfers) else 'already up to date'}")
    elif not gen_transitions.is_fresh(generated):
        echo(f"FAIL {gen_transitions.stale_message(generated)}")
        return 2
    elif not gen_link_plans.is_fresh(plans):
        echo(f"FAIL {gen_link_plans.stale_message(plans)}")
        return 2
    elif not gen_versions.is_fresh(versions):
        echo(f"FAIL {gen_versions.stale_message(versions)}")
        return 2
    elif not gen_transfers.is_fresh(transfers):
        echo(f"FAIL {gen_transfers.stale_message(transfers)}")
        return 2
    if getattr(args, "mutate_guards", False):
        from omni_core.formal import guard_mutation

        return guard_mutation.run(args, root, echo)
    data, models = load_manifest(root)
    long = getattr(args, "long", False)
    if long and args.timeout_s == DEFAULT_TIMEOUT_S:
        args.timeout_s = LONG_TIMEOUT_S
    models = select(models, long=long, only=args.only)
    if args.list:
        for m in models:
            echo(f"{m.name:38} {m.expect:34} {m.config}  {m.about}")
        if args.json:
            reports.write_json(args.json, {"models": [dataclasses.asdict(m) for m in models]})
        return 0
    echo(f"{generated.name}: matches omni_core.fsm")
    echo(
        f"{'long' if long else 'default'} list: {len(models)} models, {stated_seconds(models):.0f} s "
        f"as measured ({data.get('measured_on', 'machine not stated')})"
    )
    echo(header())
    start = time.monotonic()
    coverage_out: dict[str, str] | None = {} if getattr(args, "coverage", False) else None
    reach_out: dict[str, reachability.Reach] = {}
    try:
        rows = [agreement_row(root, args.timeout_s, echo)] if not long and _selected("agree", args.only) else []
        if not long and _selected("agree/admission", args.only):
            rows.append(admission_agreement_row(root, args.timeout_s, echo))
        if not long and _selected("agree/ranks", args.only):
            rows.append(ranks_agreement_row(root, args.timeout_s, echo))
        more, counts = run_models(
            models,
            root,
            workers=args.workers,
            timeout_s=args.timeout_s,
            update=args.update_manifest,
            controls=not args.no_controls,
            echo=echo,
            coverage=coverage_out,
            reach=reach_out,
        )
        rows += more
    except TlcNotFoundError as exc:
        echo(f"FAIL {exc}")
        return 2
    rows += _stale_citations(root, coverage_out is None, echo)
    total_s = time.monotonic() - start
    bad = [r for r in rows if not r.ok]
    echo(_RULE)
    echo(f"{len(rows)} runs, {len(bad)} failed, {total_s:.1f} s")
    _report_coverage(root, coverage_out, getattr(args, "coverage_report", None), echo)
    _report_guard_mutation(root, echo)
    if args.json:
        reports.write_json(args.json, {"total_s": total_s, "rows": [r.__dict__ for r in rows]})
    if args.update_manifest:
        if bad:
            echo("manifest NOT updated: some runs did not give the expected result")
        else:
            write_manifest(root, data, counts)
            echo(f"wrote {root / MANIFEST}")
            if reach_out:
                reachability.write_report(root / reachability.REPORT, reach_out)
                echo(f"wrote {root / reachability.REPORT} ({', '.join(sorted(reach_out))})")
    return 1 if bad else 0


def _stale_citations(root: Path, coverage_too: bool, echo) -> list[Row]:
    """The committed reports must cite the spec as it is: each row's line holds its text."""
    from omni_core.formal import coverage, guard_mutation

    checks = [(guard_mutation.REPORT, guard_mutation.stale_rows, "omni-core check --mutate-guards --relocate")]
    if coverage_too:  # a --coverage run rewrites or prints its own report
        checks.append((coverage.REPORT, coverage.stale_rows, "omni-core check --coverage --coverage-report"))
    rows = []
    for report, stale_rows, fix in checks:
        stale = stale_rows(root / report, root)
        note = f"{len(stale)} rows cite a moved line, first: {stale[0]} (fix: {fix} tla/{report})" if stale else ""
        rows.append(Row(f"report/{report}", "current", "stale" if stale else "current", None, 0.0, not stale, note))
        echo(_format_row(rows[-1]))
    return rows


def _report_coverage(root: Path, outputs: dict[str, str] | None, report: Path | None, echo) -> None:
    from omni_core.formal import coverage

    if outputs is None:
        echo(coverage.summary_of_report(root / coverage.REPORT))
        return
    found = coverage.merge(coverage.parse_coverage(text) for text in outputs.values())
    dead = coverage.dead_branches(found, root)
    echo(coverage.format_table(dead, models=sorted(outputs)))
    if report is not None:
        coverage.write_report(report, dead, models=sorted(outputs))
        echo(f"wrote {report}")


def _report_guard_mutation(root: Path, echo) -> None:
    from omni_core.formal import guard_mutation

    echo(guard_mutation.summary_of_report(root / guard_mutation.REPORT))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-core check", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
