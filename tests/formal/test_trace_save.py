"""A run that saves its version (SaveWeights, P-21), restarts, then reloads the save: the trace
spec replays the save as it replays the other stateless tasks (OmniWeights' IssueWeightTask and
its worker side), the restart at the saved version (StageRestarted's version, not the floor),
and the reload at the save's version (EffectDone's, RankReloaded); a restart record that claims
the floor after the save, and a reload that claims version 0, are rejected."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, small_spec
from tests.engine.test_weight_updates import new_weights, reference
from tests.formal.test_trace_validation import needs_tlc


@pytest.fixture(scope="module")
def save_records(tmp_path_factory):
    root = tmp_path_factory.mktemp("save")
    with (
        Engine([small_spec("s")], trace_path=str(root / "save.jsonl")) as engine,
        WeightSender(bucket_bytes=1 << 20) as sender,
    ):
        engine.update_weights("s", sender.share(new_weights(reference(seed=1), 13)), version=3)
        engine.save_weights("s", str(root / "v3"))
        assert engine.restart("s").weights_version == 3
        engine.execute("s", PROBE)
        engine.update_weights("s", "seed:9", version=5)
        engine.sleep("s", level=2)
        engine.wake("s")
        assert engine.reload_weights("s", str(root / "v3")).weights_version == 3  # the save's version
        engine.execute("s", PROBE)
    return read_trace(root / "save.jsonl")


def test_the_trace_names_the_save_and_a_restart_at_its_version(save_records) -> None:
    issued = [r.record.command for r in save_records if isinstance(r.record, T.StageIssued)]
    assert issued == ["UpdateWeights", "SaveWeights", "UpdateWeights", "Sleep", "Wake", "ReloadWeights"]
    (reloaded,) = [
        r.record for r in save_records if isinstance(r.record, T.EffectDone) and r.record.command == "ReloadWeights"
    ]
    assert reloaded.weights_version == 3
    (restarted,) = [r.record for r in save_records if isinstance(r.record, T.StageRestarted)]
    assert (restarted.weights_version, restarted.needs_reload, restarted.version_floor) == (3, False, 0)


@needs_tlc
def test_a_run_that_saves_then_restarts_is_accepted(save_records) -> None:
    (verdict,) = trace_check.validate_records(save_records)
    assert verdict.accepted, verdict.line()


@needs_tlc
def test_a_reload_of_the_save_that_claims_version_zero_is_rejected(save_records) -> None:
    lines = list(save_records)
    (done,) = [r for r in lines if isinstance(r.record, T.EffectDone) and r.record.command == "ReloadWeights"]
    done.record.weights_version = 0  # the rank reloaded the runner's own weights, then ACKed at 3
    (verdict,) = trace_check.validate_records(lines)
    assert not verdict.accepted, verdict.line()


@needs_tlc
def test_a_restart_after_the_save_that_claims_the_floor_is_rejected(save_records) -> None:
    lines = list(save_records)
    (restarted,) = [r for r in lines if isinstance(r.record, T.StageRestarted)]
    restarted.record.needs_reload, restarted.record.version_floor = True, 3  # the ranks greet ACTIVE at 3
    (verdict,) = trace_check.validate_records(lines)
    assert not verdict.accepted, verdict.line()
