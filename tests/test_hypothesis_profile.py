"""The Hypothesis settings every test runs under (tests/conftest.py): without
HYPOTHESIS_PROFILE a local run is CI's, derandomized and printing its reproduction blob, so a
failure seen once is seen again; the longer "dev" hunt keeps its failures under .hypothesis/."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.database import DirectoryBasedExampleDatabase

from tests.conftest import EXAMPLES_DIR


@pytest.mark.skipif("HYPOTHESIS_PROFILE" in os.environ, reason="a profile was asked for by name")
def test_a_plain_run_uses_the_ci_profile() -> None:
    current = settings()
    assert current.derandomize and current.print_blob, current
    assert current.max_examples == settings.get_profile("ci").max_examples


def test_every_profile_prints_its_blob_and_dev_keeps_failures() -> None:
    for name in ("ci", "dev"):
        assert settings.get_profile(name).print_blob, name
    database = settings.get_profile("dev").database
    assert isinstance(database, DirectoryBasedExampleDatabase)
    assert Path(__file__).resolve().parent.parent / ".hypothesis" / "examples" == EXAMPLES_DIR
