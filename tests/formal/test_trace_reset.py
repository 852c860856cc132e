"""A run that drops the runners' caches (ResetPrefixCache, P-19): the trace spec replays the
command as it replays the other stateless tasks (OmniWeights' IssueWeightTask and its worker
side), so a real run that uses it is accepted, and a forged reply state is rejected."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, small_spec
from tests.formal.test_trace_validation import needs_tlc


@pytest.fixture(scope="module")
def reset_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("reset") / "reset.jsonl"
    with Engine([small_spec("r")], trace_path=str(path)) as engine:
        engine.execute("r", PROBE)
        engine.reset_prefix_cache("r")
        engine.execute("r", PROBE)
    return read_trace(path)


def test_the_trace_names_the_command(reset_records) -> None:
    issued = [r for r in reset_records if isinstance(r.record, T.StageIssued)]
    assert [r.record.command for r in issued] == ["ResetPrefixCache"]


@needs_tlc
def test_a_run_that_resets_the_caches_is_accepted(reset_records) -> None:
    (verdict,) = trace_check.validate_records(reset_records)
    assert verdict.accepted, verdict.line()


@needs_tlc
def test_a_reset_that_claims_to_change_the_state_is_rejected(reset_records) -> None:
    lines = [r for r in reset_records]
    (issue,) = [r for r in lines if isinstance(r.record, T.StageIssued)]
    issue.record.after = "SLEEPING"  # the command never changes the stage's state
    (verdict,) = trace_check.validate_records(lines)
    assert not verdict.accepted, verdict.line()
