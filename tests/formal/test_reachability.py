"""The reachability report: what each model reaches, checked against tla/README.md's claims."""

from __future__ import annotations

import argparse
import re
import shutil

import pytest

from omni_core.formal import check, reachability
from omni_core.formal.manifest import load_manifest, tla_dir
from tests.formal.test_trace_validation import needs_tlc

SAMPLE = """\
Computing initial states...
<<"reach", <<"stage", "STARTING">>>>
<<"reach", <<"worker", "LOADING">>>>
<<"reach", <<"srow", "STARTING", "started">>>>
<<"reach", <<"admit", "NEEDS_RELOAD", "queue">>>>
<<"reach", <<"stage", "STARTING">>>>
Model checking completed. No error has been found.
"""


def _models(*, long: bool) -> dict[str, str]:
    """Model name -> spec, of the CI models (and with `long`, the long ones too)."""
    _, models = load_manifest(tla_dir())
    return {m.name: m.spec or "OmniSleep.tla" for m in models if not m.is_bug and (long or not m.long)}


def test_the_printed_observations_are_read_per_category():
    reach = reachability.parse_reach(SAMPLE, "OmniAdmission.tla")
    assert reach.seen["stage"] == {"STARTING"}
    assert reach.seen["worker"] == {"LOADING"}
    assert reach.seen["srow"] == {"STARTING/started"}
    assert reach.seen["admit"] == {"NEEDS_RELOAD/queue"}
    assert "admit" not in reachability.parse_reach(SAMPLE, "OmniSleep.tla").categories


def test_every_claim_names_a_model_of_the_two_specs_and_a_key_that_exists():
    claimed = reachability.claims(tla_dir() / "README.md")
    models = _models(long=True)
    assert {"restart", "restart_settled", "crash", "admission", "admission_faults"} <= set(claimed)
    for model, pairs in claimed.items():
        assert reachability.instrumentable(models[model]), model
        for category, key in pairs:
            assert key in reachability.CATEGORIES[category][1], (model, category, key)


def test_the_committed_report_has_every_instrumented_ci_model():
    sections = reachability.committed_sections(tla_dir() / reachability.REPORT)
    wanted = {name for name, spec in _models(long=False).items() if reachability.instrumentable(spec)}
    assert wanted <= set(sections)
    assert set(sections) <= set(_models(long=True))  # a long model once it ran; nothing else
    claimed = reachability.claims(tla_dir() / "README.md")
    assert set(claimed) <= set(sections)


def test_each_committed_section_meets_its_claims():
    """The same judgement `omni-core check` makes, read back from the report."""
    sections = reachability.committed_sections(tla_dir() / reachability.REPORT)
    for model, pairs in reachability.claims(tla_dir() / "README.md").items():
        missing: dict[str, set[str]] = {}
        for line in sections[model].splitlines():
            label, _, rest = line.removeprefix("- ").partition(": ")
            missing[label] = set(rest.partition("; not reached: ")[2].split(", "))
        for category, key in pairs:
            assert key not in missing[reachability.CATEGORIES[category][0]], (model, category, key)


def test_a_claim_not_reached_and_a_changed_reach_are_named():
    reach = reachability.parse_reach(SAMPLE, "OmniSleep.tla")
    claimed = {"m": [("stage", "STARTING"), ("srow", "PARTIAL/restart")]}
    assert reachability.unmet_claims("m", reach, claimed) == ["srow:PARTIAL/restart"]


def test_a_report_that_differs_names_the_change(tmp_path):
    report = tmp_path / reachability.REPORT
    reach = reachability.parse_reach(SAMPLE, "OmniSleep.tla")
    reachability.write_report(report, {"m": reach})
    assert reachability.differs_from_report(report, "m", reach) == ""
    reach.seen["stage"].add("RUNNING")
    changed = reachability.differs_from_report(report, "m", reach)
    assert "stage states: 2/" in changed and "--update-manifest" in changed
    assert "no section" in reachability.differs_from_report(report, "other", reach)


@needs_tlc
@pytest.mark.timeout(900)
def test_omni_core_check_fails_when_a_model_does_not_reach_its_claim(tmp_path):
    root = tmp_path / "tla"
    shutil.copytree(tla_dir(), root)
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    args = parser.parse_args(["--tla-dir", str(root), "--only", "restart_settled"])
    lines: list[str] = []
    assert check.run(args, echo=lines.append) == 0, lines
    readme = root / "README.md"
    # restart_settled has no faults, so the stage never fails: a claim of FAILED is not met.
    readme.write_text(
        readme.read_text().replace("| `restart_settled` | PARTIAL,", "| `restart_settled` | FAILED, PARTIAL,")
    )
    lines.clear()
    assert check.run(args, echo=lines.append) == 1
    assert any("never reached stage:FAILED" in line for line in lines), lines
    # The committed section is what the run must match: an edited one fails too.
    shutil.copy2(tla_dir() / "README.md", readme)
    report = root / reachability.REPORT
    text = report.read_text()
    edited = re.sub(r"(### `restart_settled`\n\n- stage states: )(\d+)/", lambda m: f"{m[1]}{int(m[2]) + 1}/", text)
    assert edited != text  # the section is there to edit
    report.write_text(edited)
    lines.clear()
    assert check.run(args, echo=lines.append) == 1
    assert any("reachability changed" in line for line in lines), lines


def test_omni_versions_is_wrapped_around_the_operators_its_actions_fire_rows_through():
    wrapper = reachability.wrapper_module("OmniVersions.tla")
    assert '<<"stage", stage>>' in wrapper and "THEN TS(s, g) ELSE TS(s, g)" in wrapper
    config = reachability.instrumented_config("SPECIFICATION Spec\n", "OmniVersions.tla")
    assert "S <- ReachStageNext" in config and "W <- ReachWorkerNext" in config
    assert "admit" not in reachability.parse_reach(SAMPLE, "OmniVersions.tla").categories


@needs_tlc
@pytest.mark.timeout(600)
def test_the_versions_model_reaches_the_stop_the_updates_and_paused(tmp_path):
    """The instrumented run of `versions` (its ASSUMEs read the rows around S and W, so
    nothing is printed before the wrapper's register is set, which TLC would refuse)."""
    root = tla_dir()
    result, reach = reachability.run_instrumented(
        root, "OmniVersions.tla", root / "models" / "versions.cfg", workers=1, timeout_s=500
    )
    assert result.outcome == "ok", result.output[-2000:]
    assert {"PAUSED", "STOPPED", "FAILED"} <= reach.seen["stage"]
    assert {"PAUSED/update", "WAKING/woke_paused", "RUNNING/stop", "STOPPED/restart"} <= reach.seen["srow"]
    assert {"ACTIVE/update", "SLEEPING/shutdown"} <= reach.seen["wrow"]
