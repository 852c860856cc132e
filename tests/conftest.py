"""Shared test settings.

Hypothesis profiles (chosen by HYPOTHESIS_PROFILE, else "ci" when CI is set and "dev" otherwise):

- "ci": what CI runs (hypothesis also auto-loads it when CI=true). Derandomized, so a red
  CI run is reproducible; 200 examples of up to 30 steps per stateful machine.
- "dev": a longer local hunt (1000 examples of up to 50 steps, random seeds, shrinking
  results kept in the example database).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

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
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# CI (CI=true) gets the reproducible "ci" profile; a developer's run hunts longer.
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_addoption(parser) -> None:  # type: ignore[no-untyped-def]
    # etcd-raft's datadriven `-rewrite`: tests/test_scenarios.py writes what the scenarios do now
    # into the expected sections of tests/testdata/*.txt; review the diff before committing it.
    parser.addoption(
        "--rewrite",
        action="store_true",
        default=False,
        help="rewrite the expected output of tests/testdata/*.txt scenarios",
    )
