"""The fsm mutation campaign (scripts/mutate_fsm.py): its table, its verdict, its committed score.

The campaign itself runs in CI as its own stage of scripts/test.sh (`--check tla/fsm_mutation.md`);
these tests keep the table and the score honest between runs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "mutate_fsm.py"
SCORE = REPO / "tla" / "fsm_mutation.md"


@pytest.fixture(scope="module")
def mf():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import mutate_fsm

        yield mutate_fsm
    finally:
        sys.path.remove(str(SCRIPT.parent))


def test_list_finds_every_snippet_in_the_current_sources(mf):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--list"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(mf.MUTATIONS)} mutations, 0 stale" in done.stdout


def test_the_committed_score_has_every_mutation_and_no_unexplained_survivor(mf):
    score = mf.committed(SCORE)
    assert set(score) == {m.name for m in mf.MUTATIONS}
    for m in mf.MUTATIONS:
        assert score[m.name] == ("SURVIVED" if m.equivalent else "CAUGHT"), m.name


def _result(mf, name: str, result: str):
    return mf.Result(name, result, mf.TIER1 if result == "CAUGHT" else "", "t", 1.0)


def test_the_verdict_fails_on_an_unexplained_survivor_a_change_or_an_error(mf):
    name = mf.MUTATIONS[0].name
    assert not mf.MUTATIONS[0].equivalent
    assert mf.verdict([_result(mf, name, "CAUGHT")], {name: "CAUGHT"}) == []
    assert mf.verdict([_result(mf, name, "SURVIVED")], None)
    assert mf.verdict([_result(mf, name, "ERROR")], None)
    assert mf.verdict([_result(mf, name, "CAUGHT")], {name: "SURVIVED"})


def test_a_snippet_is_found_in_any_module_and_every_copy_is_replaced(mf, tmp_path):
    pkg = tmp_path / mf.FSM
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text("x = now + deadline_s\n")
    (pkg / "b.py").write_text("y = now + deadline_s\nz = now + deadline_s\n")
    m = mf._m("unit", "u", mf.FSM, "now + deadline_s", "now + deadline_s / 1000")
    assert mf._problems(m, tmp_path) == []
    assert mf._apply(m, tmp_path) == {f"{mf.FSM}/a.py", f"{mf.FSM}/b.py"}
    assert (pkg / "b.py").read_text().count("/ 1000") == 2
    gone = mf._m("gone", "g", mf.FSM, "no such text", "")
    assert mf._problems(gone, tmp_path)
