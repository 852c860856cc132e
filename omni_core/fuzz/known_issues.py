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

from omni_core.protocol import Message, ReloadWeights


@dataclass(frozen=True)
class KnownIssue:
    name: str
    summary: str
    regression_test: str
    matches: Callable[[Message], bool]
    still_open: Callable[[], bool]


def _bad_seed_source(message: Message) -> bool:
    """A ReloadWeights source the synthetic runner's check lets through but int() refuses:
    more than 4300 digits, '--5' (lstrip removes both signs), '²' (isdigit, not int)."""
    if not isinstance(message, ReloadWeights) or not isinstance(message.source, str):
        return False
    source = message.source
    if not source.startswith("seed:") or not source[5:].lstrip("-").isdigit():
        return False
    try:
        int(source[5:])
    except ValueError:
        return True
    return False


def _synthetic_reload_still_open() -> bool:
    import torch

    from omni_core.workers.runner import RunnerArgumentError
    from omni_core.workers.synthetic import SyntheticRunner

    runner = SyntheticRunner(torch.device("cpu"), weights_bytes=4096, tensor_count=1, kv_bytes=1024, hidden=8)
    try:
        runner.reload_weights("seed:--5")
    except RunnerArgumentError:
        return False  # refused as an argument: fixed
    except Exception:
        return True
    return False


KNOWN_ISSUES: tuple[KnownIssue, ...] = (
    KnownIssue(
        name="synthetic-reload-source",
        summary="SyntheticRunner.reload_weights raises ValueError (not RunnerArgumentError) for 'seed:--5', "
        "'seed:\u00b2' and 'seed:' + 5000 digits: the worker goes FAILED (BACKEND_ERROR) instead of "
        "answering INVALID_ARGUMENT",
        regression_test="tests/fuzz/test_regressions.py::test_synthetic_reload_refuses_unparsable_seed",
        matches=_bad_seed_source,
        still_open=_synthetic_reload_still_open,
    ),
)


def open_issues() -> tuple[KnownIssue, ...]:
    """The known issues that are still there (each checked now, in this process)."""
    return tuple(issue for issue in KNOWN_ISSUES if issue.still_open())
