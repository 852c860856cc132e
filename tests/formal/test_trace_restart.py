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


@pytest.fixture(scope="module")
def floor_records(tmp_path_factory):
    """An update from memory, a restart under its version floor (the fresh ranks greet
    NEEDS_RELOAD: the worker table's loaded_needs_reload), a request refused, the trainer's
    version again, a request served."""
    from omni_core.engine.errors import RequestRejectedError
    from omni_core.weights_sender import WeightSender
    from tests.engine.test_weight_updates import new_weights, reference

    path = tmp_path_factory.mktemp("floor") / "floor.jsonl"
    with (
        Engine([small_spec("f", admission="reject")], trace_path=str(path)) as engine,
        WeightSender(bucket_bytes=1 << 20) as sender,
    ):
        weights = new_weights(reference(seed=1), 13)
        engine.update_weights("f", sender.share(weights), version=3)
        assert engine.restart("f").version_floor == 3
        with pytest.raises(RequestRejectedError):
            engine.execute("f", PROBE)
        engine.update_weights("f", sender.share(weights), version=3)
        engine.execute("f", PROBE)
    return read_trace(path)


def test_the_restart_record_names_its_floor_and_the_ranks_greet_needs_reload(floor_records) -> None:
    (restarted,) = [r.record for r in floor_records if isinstance(r.record, T.StageRestarted)]
    assert (restarted.weights_version, restarted.needs_reload, restarted.version_floor) == (0, True, 3)
    greeted = [r.record.state for r in floor_records if isinstance(r.record, T.WorkerStarted) and r.epoch == 1]
    assert greeted == ["NEEDS_RELOAD"]


@needs_tlc
def test_a_restart_under_a_version_floor_is_replayed(floor_records) -> None:
    (verdict,) = trace_check.validate_records(floor_records)
    assert verdict.accepted, verdict.line()


@needs_tlc
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("needs_reload", False),  # the stage expected ACTIVE ranks: their NEEDS_RELOAD Hellos fail it
        ("version_floor", 5),  # the update at 3 is then below the floor: never issued
    ],
)
def test_a_restart_record_that_hides_its_floor_is_rejected(floor_records, field: str, value: object) -> None:
    lines = list(floor_records)
    (restarted,) = [r for r in lines if isinstance(r.record, T.StageRestarted)]
    setattr(restarted.record, field, value)
    (verdict,) = trace_check.validate_records(lines)
    assert not verdict.accepted, verdict.line()
