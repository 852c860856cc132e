"""Issue 17 item 4: the 3-rank and long models in the manifest, the coverage reader, guard
extraction and mutation, and the admission queue's bug models."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from omni_core.formal import check, coverage, guard_mutation
from omni_core.formal.tlc import EXIT_SAFETY, run_tlc

DATA = Path(__file__).parent / "data"


def _ranks(config: Path) -> int:
    match = re.search(r"^\s*Ranks = \{([^}]*)\}", config.read_text(), re.MULTILINE)
    assert match, config
    return len(match.group(1).split(","))


def _constant(config: Path, name: str) -> str:
    match = re.search(rf"^\s*{name} = (.+)$", config.read_text(), re.MULTILINE)
    assert match, (config, name)
    return match.group(1).strip()


# ---------------------------------------------------------------- manifest: default and long


def test_long_models_are_apart_from_the_default_list():
    _, models = check.load_manifest(check.tla_dir())
    default = check.select(models, long=False, only=None)
    long = check.select(models, long=True, only=None)
    assert long and default
    assert not {m.name for m in default} & {m.name for m in long}
    assert {m.name for m in default} | {m.name for m in long} == {m.name for m in models}
    assert check.select(models, long=True, only=["crash*"]) == [m for m in long if m.name.startswith("crash")]


def test_three_rank_core_safety_models_run_in_the_default_list():
    _, models = check.load_manifest(check.tla_dir())
    default = {m.name: m for m in check.select(models, long=False, only=None)}
    for name in ("happy3", "duplicates3"):
        assert _ranks(check.tla_dir() / default[name].config) == 3, name
        assert default[name].distinct_states, name


def test_the_admission_queue_across_restarts_is_a_model_that_finishes():
    """admission_long (three ranks, epochs 0..2, six tasks) never finished; the model that
    replaces it runs in CI with a recorded state count: restarts of a serving stage, queue."""
    _, models = check.load_manifest(check.tla_dir())
    found = []
    for m in check.select(models, long=False, only=None):
        config = check.tla_dir() / m.config
        if (
            m.spec == "OmniAdmission.tla"
            and int(_constant(config, "MaxEpoch")) >= 1
            and '"kill"' in _constant(config, "Faults")
            and m.distinct_states
        ):
            found.append(m.name)
    assert found == ["admission_restart"]
    assert "admission_long" not in {m.name for m in models}


def test_the_new_models_state_their_measured_seconds_so_the_ci_time_is_stated():
    data, models = check.load_manifest(check.tla_dir())
    assert "measured_on" in data
    by_name = {m.name: m for m in models}
    for name in ("happy3", "duplicates3", "admission", "bug/queue_unbounded", "bug/queue_dropped_on_wake"):
        assert by_name[name].seconds and by_name[name].distinct_states, name
    assert all(m.seconds is None or m.seconds > 0 for m in models)
    assert check.stated_seconds(check.select(models, long=False, only=None)) > 0


def test_manifest_entry_defaults(tmp_path):
    m = check.Model.from_json({"name": "x", "config": "c.cfg", "expect": "ok"}, "Spec.tla")
    assert (m.spec, m.long, m.seconds) == ("Spec.tla", False, None)
    m = check.Model.from_json(
        {"name": "x", "config": "c.cfg", "expect": "ok", "long": True, "spec": "OmniAdmission.tla", "seconds": 12.5}
    )
    assert (m.spec, m.long, m.seconds) == ("OmniAdmission.tla", True, 12.5)


# ---------------------------------------------------------------- coverage


def test_coverage_block_of_a_captured_tlc_215_run_is_read():
    cov = coverage.parse_coverage((DATA / "tlc215_coverage.txt").read_text())
    assert cov.actions[("Refused", coverage.Loc("OmniSleep", 357, 1, 357, 10))] == 0
    assert cov.actions[("Done", coverage.Loc("OmniSleep", 385, 1, 385, 7))] == 10
    # an unnamed disjunct of Next is keyed by where it stands, not by Next's name
    assert cov.actions[("Next", coverage.Loc("OmniSleep", 780, 8, 780, 43))] == 0
    # "count:cost" expressions and nested ones (|) are read; invariant headers carry no counts
    assert cov.expressions[coverage.Loc("OmniSleep", 411, 30, 411, 36)] == 10
    assert cov.expressions[coverage.Loc("OmniSleep", 386, 8, 386, 12)] == 59
    assert cov.expressions[coverage.Loc("OmniSleep", 362, 14, 362, 48)] == 0
    assert not any(name == "TypeOK" for name, _ in cov.actions)


def test_dead_branches_list_never_enabled_actions_and_outermost_unevaluated_expressions(tmp_path):
    cov = coverage.parse_coverage((DATA / "tlc215_coverage.txt").read_text())
    dead = coverage.dead_branches(cov, tmp_path)  # no source there: texts are empty
    kinds = {(d.kind, d.action, d.loc.line) for d in dead}
    assert ("action never enabled", "Refused", 357) in kinds
    assert ("action never enabled", "EffectError", 420) in kinds
    # Refused's body is not listed line by line: the action's row says it all
    assert not any(d.kind == "never evaluated" and d.action == "Refused" for d in dead)
    # evaluated somewhere, so not dead
    assert not any(d.loc.line == 386 for d in dead)


def test_merging_two_runs_revives_a_branch_one_of_them_took():
    text = (DATA / "tlc215_coverage.txt").read_text()
    other = text.replace(
        "<Refused line 357, col 1 to line 357, col 10 of module OmniSleep>: 0:0",
        "<Refused line 357, col 1 to line 357, col 10 of module OmniSleep>: 3:4",
    )
    merged = coverage.merge([coverage.parse_coverage(text), coverage.parse_coverage(other)])
    assert merged.actions[("Refused", coverage.Loc("OmniSleep", 357, 1, 357, 10))] == 4


def test_coverage_report_keeps_its_notes(tmp_path):
    report = tmp_path / "coverage.md"
    dead = [coverage.Dead("never evaluated", coverage.Loc("OmniSleep", 5, 1, 5, 9), "Crash", "FaultOk")]
    coverage.write_report(report, dead, ["happy"])
    report.write_text(report.read_text() + "\nwhy: no model crashes here\n")
    coverage.write_report(report, dead, ["happy", "crash"])
    text = report.read_text()
    assert "why: no model crashes here" in text and "`crash`" in text
    assert coverage.summary_of_report(report).startswith("coverage: 1 dead branches")


# ---------------------------------------------------------------- guard mutation

SNIPPET = r"""---- MODULE Snip ----
VARIABLES x, y
Helper == x > 0       \* not an action: it primes nothing
Step(a) ==
    /\ x < 3 /\ a \in {1, 2}   \* two guards on one line
    /\ \/ /\ y = 0
          /\ x' = x + a
       \/ /\ y = 1 /\ (x = 0 \/ x = 2)
          /\ x' = x
    /\ LET z == x IN
       /\ z # 5
       /\ y' = y
Other ==
    /\ Helper
    /\ Step(1)          \* a call of an action: no guard
    /\ UNCHANGED y
====
"""


def test_guards_are_found_mechanically_in_junction_lists():
    guards = guard_mutation.find_guards(SNIPPET, "Snip.tla")
    assert [(g.name, g.text) for g in guards] == [
        ("Step#1", "x < 3"),
        ("Step#2", "a \\in {1, 2}"),
        ("Step#3", "y = 0"),
        ("Step#4", "y = 1"),
        ("Step#5", "(x = 0 \\/ x = 2)"),
        ("Step#6", "z # 5"),
        ("Other#1", "Helper"),
    ]


def test_a_mutant_replaces_exactly_one_guard_by_true():
    guards = {g.name: g for g in guard_mutation.find_guards(SNIPPET, "Snip.tla")}
    mutant = guard_mutation.mutate(SNIPPET, guards["Step#2"])
    line = mutant.splitlines()[guards["Step#2"].line - 1]
    assert line.startswith("    /\\ x < 3 /\\ TRUE") and "\\in" not in line
    assert mutant.count("\n") == SNIPPET.count("\n")
    # the other guards are where they were
    again = {g.name: g.text for g in guard_mutation.find_guards(mutant, "Snip.tla")}
    assert again["Step#1"] == "x < 3" and again["Step#2"] == "TRUE" and again["Step#6"] == "z # 5"


def test_the_spec_has_guards_in_every_action_kind():
    names = {g.name.split("#")[0] for g in guard_mutation.all_guards(check.tla_dir())}
    assert {
        "WorkerReceive",
        "Done",
        "IssueSleep",
        "Deadline",
        "RestartWith",
        "Submit",
        "DispatchQueued",
        "AutoWake",
        "RejectQueued",
    } <= names


def test_only_selects_guards_by_action_and_number(capsys):
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    assert check.run(parser.parse_args(["--mutate-guards", "--list", "--only", "IssueSleep#6"])) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("IssueSleep#6 ") and 'SLegal(sstate, "drain")' in out[0]


@pytest.mark.slow
def test_removing_the_drain_guard_of_a_sleep_is_killed():
    """One guard through the whole path: copy, mutate, run happy: a Sleep in any state fires a
    trigger the generated table forbids."""
    root = check.tla_dir()
    guard = next(g for g in guard_mutation.all_guards(root) if g.name == "IssueSleep#6")
    verdict = guard_mutation.check_guard(guard, root, {"happy": "models/happy.cfg"}, {"happy": 900.0})
    assert (verdict.result, verdict.model) == ("killed", "happy"), verdict
    assert "forbids" in verdict.by or verdict.by.startswith("P"), verdict


# ---------------------------------------------------------------- admission bug models


@pytest.mark.parametrize("name", ["bug/queue_unbounded", "bug/queue_dropped_on_wake"])
def test_admission_bug_models_are_rejected_with_their_invariant(name):
    _, models = check.load_manifest(check.tla_dir())
    model = next(m for m in models if m.name == name)
    root = check.tla_dir()
    result = run_tlc(root / model.spec, root / model.config, workers=1, timeout_s=300)
    assert (result.exit_code, result.violated) == (EXIT_SAFETY, model.expect), result.error
    assert model.spec == "OmniAdmission.tla"


# ---------------------------------------------------------------- admission agreement


@pytest.fixture(scope="module")
def admission_steps():
    from omni_core.formal import agree_admission

    return agree_admission.spec_steps(check.tla_dir())


def test_stage_core_admission_agrees_with_the_spec_in_every_small_case(admission_steps):
    from omni_core.formal import agree_admission

    assert len(admission_steps) >= 100
    kinds = set(admission_steps.values())
    assert {
        ("submit", "run"),
        ("submit", "queue"),
        ("submit", "refuse"),
        ("pump", "dispatch"),
        ("pump", "auto_wake"),
        ("pump", "reject_all"),
    } <= kinds
    assert agree_admission.compare(admission_steps) == []


def test_a_core_that_ignores_the_queue_limit_disagrees(admission_steps):
    from omni_core.formal import agree_admission
    from omni_core.fsm.stage import StageCore

    class Unbounded(StageCore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.requests.queue_limit = 10**6  # the core forgets the bound it was given

    found = agree_admission.compare(admission_steps, Unbounded)
    assert found and all(d.spec == ("submit", "refuse") and d.code == ("submit", "queue") for d in found)


def test_a_core_whose_pump_keeps_the_queue_after_a_level_2_sleep_disagrees(admission_steps):
    from omni_core.formal import agree_admission
    from omni_core.fsm.stage import StageCore, StageStep
    from omni_core.protocol import StageState

    class Keeping(StageCore):
        def _pump(self, now):
            if self.state is StageState.NEEDS_RELOAD:
                return StageStep()  # the queue waits for a reload that may never come
            return super()._pump(now)

    found = agree_admission.compare(admission_steps, Keeping)
    assert found and {d.case[0] for d in found} == {"NEEDS_RELOAD"}
    assert all(d.spec == ("pump", "reject_all") and d.code == ("pump", "none") for d in found)


def test_scope_switches_are_listed_not_mutated():
    scope = [g.text for g in guard_mutation.all_guards(check.tla_dir()) if guard_mutation.SCOPE.match(g.text)]
    assert "Requests" in scope and 'FaultOk("crash")' in scope and 'Bug # "no_deadline"' in scope
    # protocol guards are not scope switches, even where they mention a constant
    assert not guard_mutation.SCOPE.match('sstate # "FAILED" => "kill" \\in Faults')
    assert not guard_mutation.SCOPE.match("SerialShell => ~Busy(r)")


def test_guard_report_summary_line(tmp_path):
    report = tmp_path / "guard_mutation.md"
    g = guard_mutation.Guard("OmniSleep.tla", "Crash", 1, 10, 4, 10, 12, "alive[r]")
    verdicts = [
        guard_mutation.Verdict(g, "killed", "P9_FailedNamesRanks", "crash", 3.0),
        guard_mutation.Verdict(g, "survived", "happy", "", 9.0),
    ]
    guard_mutation.write_report(report, verdicts, 12.0)
    line = guard_mutation.summary_of_report(report)
    assert "2 guards, 1 killed, 1 survived" in line, line


def test_tlc_215_zeros_for_one_line_conjunctions_of_assignments_are_not_reported(tmp_path):
    (tmp_path / "M.tla").write_text("---- MODULE M ----\nA ==\n    /\\ x > 0\n    /\\ x' = 0 /\\ y' = 1\n====\n")
    cov = coverage.Coverage(
        {coverage.Loc("M", 3, 8, 3, 12): 0, coverage.Loc("M", 4, 8, 4, 13): 0, coverage.Loc("M", 4, 18, 4, 23): 0},
        {("A", coverage.Loc("M", 2, 1, 2, 1)): 3},
        {},
    )
    dead = coverage.dead_branches(cov, tmp_path)
    assert [(d.loc.line, d.text) for d in dead] == [(3, "x > 0")]
