"""The pytest plugin, through its entry point, in a pytest of its own: failures quote the
requirement, skips name the capability, a class that names no worker is a usage error."""

from __future__ import annotations

import re
import sys

from ._util import HERE, finish, start

TEST_FILE = f"""
import sys
sys.path.insert(0, {str(HERE)!r})

import mutants
from omni_core.conformance import ConformanceSuite, SuiteOptions


class TestBroken(ConformanceSuite):
    worker = mutants.no_reply_cache
    only = "P-2"
    options = SuiteOptions(reply_timeout_s=8.0)


class TestNoLevel2(ConformanceSuite):
    only = ("P-8",)

    def start_worker(self, address, rank, epoch):
        return mutants.no_capabilities(address, rank, epoch)


class TestNothingToStart(ConformanceSuite):
    only = "P-3"
"""


STRAYS_FILE = f"""
import sys
sys.path.insert(0, {str(HERE)!r})

import mutants
from omni_core.conformance import ConformanceSuite


class TestStrays(ConformanceSuite):
    worker = mutants.double_reply
    only = "P-3"
"""


def test_a_k_subset_still_fails_on_strays(tmp_path):
    """`-k` leaves the run-wide check out; the strays fail the class at teardown instead."""
    (tmp_path / "test_strays.py").write_text(STRAYS_FILE)
    code, out = finish(
        start(
            [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-k", "P-3/", "test_strays.py"], tmp_path
        )
    )
    assert code == 1, out
    assert "ERROR at teardown of TestStrays.test_requirement[P-3/unsupported_version]" in out, out
    assert "P-1: a worker sent a message that answers no command it was sent" in out, out
    assert "during P-3/greeting" not in out and "during P-3/reply_envelope: Ack(" in out, out
    assert "3 passed, 1 deselected, 1 error" in out, out


def test_plugin_reports_failures_skips_and_usage_errors(tmp_path):
    (tmp_path / "test_third_party.py").write_text(TEST_FILE)
    code, out = finish(
        start([sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "test_third_party.py"], tmp_path)
    )
    assert code == 1, out
    assert "FAILED test_third_party.py::TestBroken::test_requirement[P-2/duplicate_answered_from_cache]" in out
    assert "FAILED test_third_party.py::TestBroken::test_requirement[P-2/task_id_reused]" in out
    assert re.search(r'requirement P-2 \(Idempotent duplicates\):\n\s+"A command whose `task_id`', out), out
    assert re.search(r"SKIPPED \[1\] .*: P-8: worker does not declare capability 'level2'", out), out
    assert "PASSED test_third_party.py::TestNoLevel2::test_requirement[P-8/level2_refused_without_capability]" in out
    assert "TestNothingToStart: set `worker = <target>` or override `start_worker" in out
    assert "ERROR test_third_party.py::TestNothingToStart::test_requirement[P-3/greeting]" in out
    assert "4 failed, 3 passed, 1 skipped, 4 errors" in out, out
