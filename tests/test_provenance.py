"""The commit a result names: git's, or OMNI_COMMIT where the tree has no history."""

from __future__ import annotations

import subprocess

from omni_core import provenance


def test_the_commit_is_gits_here_and_the_stand_in_on_a_copy_without_history(monkeypatch):
    monkeypatch.delenv("OMNI_COMMIT", raising=False)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance.git_commit() == (head or "unknown")
    assert head.startswith(provenance.git_commit(short=True)) if head else True
    monkeypatch.setenv("OMNI_COMMIT", "d6570d3")
    monkeypatch.setenv("OMNI_COMMIT_DIRTY", "1")
    assert provenance.git_commit() == provenance.git_commit(short=True) == "d6570d3"
    assert provenance.git_dirty() is True


def test_a_missing_program_is_an_empty_answer_not_an_error():
    assert provenance.run_quietly(["/nonexistent/git", "rev-parse", "HEAD"]) == ""
