"""Where a result came from: the commit of the code that produced it.

Every committed figure names its commit (bench results, load tests). On the lent GPU machine
the tree arrives without its history, so `OMNI_COMMIT` (and `OMNI_COMMIT_DIRTY=1`) stand in
for git there.
"""

from __future__ import annotations

import os
import subprocess

GIT_TIMEOUT_S = 20.0  # git on a cold, loaded machine; past this the commit is "unknown"


def run_quietly(cmd: list[str], timeout_s: float = GIT_TIMEOUT_S) -> str:
    """A command's stripped stdout, or "" when it is missing, fails to start or times out."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def git_commit(*, short: bool = False) -> str:
    """The commit of the working tree (OMNI_COMMIT where set), or "unknown"."""
    if os.environ.get("OMNI_COMMIT"):
        return os.environ["OMNI_COMMIT"]
    return run_quietly(["git", "rev-parse", *(["--short"] if short else []), "HEAD"]) or "unknown"


def git_dirty() -> bool:
    """Uncommitted changes to tracked files (OMNI_COMMIT_DIRTY=1 where OMNI_COMMIT is set)."""
    if os.environ.get("OMNI_COMMIT"):
        return os.environ.get("OMNI_COMMIT_DIRTY") == "1"
    return bool(run_quietly(["git", "status", "--porcelain", "-uno"]))
