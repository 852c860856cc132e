"""A run that restarts after a disk update: the fresh ranks come back at that version
(StageRestarted names it), and the trace spec replays it (OmniWeights' WeightsRestarted takes
the version); a restart record that claims the checkpoint's version instead is rejected."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, small_spec
from tests.formal.test_trace_validation import needs_tlc


@pytest.fixture(scope="module")
def restart_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("restart") / "restart.jsonl"
    with Engine([small_spec("r")], trace_path=str(path)) as engine:
        engine.execute("r", PROBE)
        engine.update_weights("r", "seed:9", version=2)
        engine.restart("r")
        engine.execute("r", PROBE)
    return read_trace(path)


def test_the_restart_record_names_the_version_it_comes_back_at(restart_records) -> None:
    (restarted,) = [r.record for r in restart_records if isinstance(r.record, T.StageRestarted)]
    assert (restarted.epoch, restarted.after, restarted.weights_version) == (1, "STARTING", 2)


@needs_tlc
def test_a_restart_at_the_updated_version_is_accepted(restart_records) -> None:
    (verdict,) = trace_check.validate_records(restart_records)
    assert verdict.accepted, verdict.line()


@needs_tlc
def test_a_restart_that_claims_the_checkpoints_version_is_rejected(restart_records) -> None:
    lines = list(restart_records)
    (restarted,) = [r for r in lines if isinstance(r.record, T.StageRestarted)]
    restarted.record.weights_version = 0  # the ranks then say Hello at 2: not what was restarted
    (verdict,) = trace_check.validate_records(lines)
    assert not verdict.accepted, verdict.line()
