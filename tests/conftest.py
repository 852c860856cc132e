"""Shared test settings.

Hypothesis profiles (chosen by HYPOTHESIS_PROFILE, else "ci", locally as in CI):

- "ci": what CI and a local run use. Derandomized, so a red run is reproducible anywhere with
  the same code; 200 examples of up to 30 steps per stateful machine; a failure prints its
  reproduction blob (`print_blob`).
- "dev": a longer hunt on request (HYPOTHESIS_PROFILE=dev: 1000 examples of up to 50 steps,
  random seeds); every failing example is kept in the database under .hypothesis/ at the
  checkout's root and replayed first next time, and its blob is printed.
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / ".hypothesis" / "examples"  # git-ignored

settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "dev",
    max_examples=1000,
    stateful_step_count=50,
    deadline=None,
    database=DirectoryBasedExampleDatabase(str(EXAMPLES_DIR)),
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# A local run is CI's run (a failure seen once is seen again); the longer hunt is asked for.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_addoption(parser) -> None:  # type: ignore[no-untyped-def]
    # etcd-raft's datadriven `-rewrite`: tests/test_scenarios.py writes what the scenarios do now
    # into the expected sections of tests/testdata/*.txt; review the diff before committing it.
    parser.addoption(
        "--rewrite",
        action="store_true",
        default=False,
        help="rewrite the expected output of tests/testdata/*.txt scenarios",
    )
