"""The mutation table of scripts/mutate.py stays true to the sources.

The mutation run itself is too slow for CI; this keeps its table from going stale unseen:
every snippet must still occur exactly once in the file it mutates, and every test it names
must still exist. An orchestrator change that moves a guarded branch fails here, and the
table is updated with it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "mutate.py"


@pytest.fixture(scope="module")
def mutate():
    spec = importlib.util.spec_from_file_location("omni_mutate", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_list_finds_every_snippet_and_test_in_the_current_sources(mutate) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--list"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for mutation in mutate.MUTATIONS:
        assert mutation.name in done.stdout
    assert f"{len(mutate.MUTATIONS)} mutations, 0 stale" in done.stdout


def test_the_table_covers_every_guarantee_the_issue_names(mutate) -> None:
    names = {m.name for m in mutate.MUTATIONS}
    required = {
        "reject-policy",
        "queue-full-running",
        "queue-full-asleep",
        "needs-reload-refusal",
        "auto-wake",
        "lifecycle-deadline",
        "request-deadline",
        "queue-deadline",
        "start-deadline",
        "reply-cache",
        "epoch-fence",
        "drain-core",
        "canary-test-process",
        "canary-rank-process",
    }
    assert required <= names, required - names
    assert len(names) == len(mutate.MUTATIONS), "mutation names must be unique"


def test_a_missing_snippet_is_an_error_not_a_skip(mutate, tmp_path) -> None:
    (tmp_path / "omni_core").mkdir()
    (tmp_path / "omni_core" / "x.py").write_text("a = 1\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text("def test_x():\n    pass\n")
    stale = mutate.Mutation(
        "stale",
        "-",
        (mutate.Edit("omni_core/x.py", "a = 2\n", "a = 3\n"),),
        ("tests/test_x.py::test_x", "tests/test_x.py::test_gone"),
    )
    found = mutate.problems(stale, None, tmp_path)
    assert any("found 0 times" in p for p in found), found
    assert any("defines no test test_gone" in p for p in found), found
    fresh = mutate.Mutation(
        "fresh", "-", (mutate.Edit("omni_core/x.py", "a = 1\n", "a = 3\n"),), ("tests/test_x.py::test_x",)
    )
    assert mutate.problems(fresh, None, tmp_path) == []
    copy = tmp_path / "copy"
    (copy / "omni_core").mkdir(parents=True)
    (copy / "omni_core" / "x.py").write_text("a = 2\n")
    with pytest.raises(mutate.StaleTable):
        mutate.apply(fresh, copy)
