"""tla/coverage.md and tla/guard_mutation.md cite the spec by line: the citations must be current.

`omni-core check` runs the same check (rows `report/...`); these tests show it can fail.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import pytest

from omni_core.formal import check, coverage, guard_mutation
from omni_core.formal.manifest import tla_dir

REPORTS = [(coverage.REPORT, coverage.stale_rows), (guard_mutation.REPORT, guard_mutation.stale_rows)]


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    root = tmp_path / "tla"
    shutil.copytree(tla_dir(), root)
    return root


def _shift(spec: Path, at_line: int = 40) -> None:
    """One comment line inserted: every later line moves down by one."""
    lines = spec.read_text().splitlines(keepends=True)
    lines.insert(at_line, "\\* a line that moves the rest\n")
    spec.write_text("".join(lines))


@pytest.mark.parametrize(("report", "stale_rows"), REPORTS)
def test_the_committed_report_cites_the_spec_as_it_is(report, stale_rows):
    assert stale_rows(tla_dir() / report, tla_dir()) == []


@pytest.mark.parametrize(("report", "stale_rows"), REPORTS)
def test_a_spec_that_moved_makes_the_report_stale(copy, report, stale_rows):
    rows = stale_rows(copy / report, copy)
    _shift(copy / "OmniSleep.tla")
    stale = stale_rows(copy / report, copy)
    assert rows == [] and stale, "a moved spec must be noticed"
    assert all("OmniSleep" in line for line in stale)  # OmniAdmission did not move


def test_relocate_moves_the_guard_rows_and_keeps_the_verdicts(copy):
    report = copy / guard_mutation.REPORT
    before = report.read_text()
    _shift(copy / "OmniSleep.tla")
    assert guard_mutation.relocate_report(report, copy) == []
    assert guard_mutation.stale_rows(report, copy) == []
    after = report.read_text()
    assert after != before
    # Only the places changed: each row's verdict columns are as they were.
    verdicts = [line.split("` |", 1)[1] for line in after.splitlines() if line.startswith("| ") and "` |" in line]
    assert verdicts == [
        line.split("` |", 1)[1] for line in before.splitlines() if line.startswith("| ") and "` |" in line
    ]


def test_a_guard_whose_text_changed_is_not_relocated(copy):
    spec = copy / "OmniSleep.tla"
    text = spec.read_text()
    assert text.count("~BadSourcePending(r)") >= 1
    spec.write_text(text.replace("~BadSourcePending(r)", "~BadSourcePendingNow(r)", 1))
    lost = guard_mutation.relocate_report(copy / guard_mutation.REPORT, copy)
    assert any("BadSourcePending" in line for line in lost)


def test_omni_core_check_fails_while_a_report_is_stale(copy):
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    lines: list[str] = []
    args = parser.parse_args(["--tla-dir", str(copy), "--only", "no-model-has-this-name"])
    assert check.run(args, echo=lines.append) == 0, lines
    _shift(copy / "OmniSleep.tla")
    lines.clear()
    assert check.run(args, echo=lines.append) == 1
    assert any("report/guard_mutation.md" in line and "FAIL" in line for line in lines), lines
    assert any("--relocate" in line for line in lines), lines
