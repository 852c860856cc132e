"""Bugs the fuzzer found that are not fixed yet, so that a run can go on past them.

Each has a regression test in `tests/fuzz/test_regressions.py` (xfail, strict), a predicate
that recognises the frames that trigger it, and `still_open()`, which checks in-process
whether the bug is still there. A fuzz run withholds matching frames only while the bug is
open (and counts them in the report); once it is fixed the same frames are sent and must
pass like any other. Nothing here hides a bug that has not been reproduced and reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from omni_core.protocol import Message


@dataclass(frozen=True)
class KnownIssue:
    name: str
    summary: str
    regression_test: str
    matches: Callable[[Message], bool]
    still_open: Callable[[], bool]


KNOWN_ISSUES: tuple[KnownIssue, ...] = ()


def open_issues() -> tuple[KnownIssue, ...]:
    """The known issues that are still there (each checked now, in this process)."""
    return tuple(issue for issue in KNOWN_ISSUES if issue.still_open())
