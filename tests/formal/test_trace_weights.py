"""A run with a weight update (P-17): its trace exports, and the checker says where the
replay stops and why (OmniSleep has no weight commands; OmniVersions.tla checks versions)."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check, trace_export
from omni_core.formal.tlc import TlcNotFoundError, find_jar, find_java
from omni_core.trace import read_trace
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, small_spec
from tests.engine.test_weight_updates import new_weights, reference


@pytest.fixture(scope="module")
def update_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("weights") / "update.jsonl"
    with Engine([small_spec("r")], trace_path=str(path)) as engine, WeightSender(bucket_bytes=1 << 20) as sender:
        engine.execute("r", PROBE)
        engine.update_weights("r", sender.share(new_weights(reference(1), 7)), version=1)
        engine.execute("r", PROBE)
    return read_trace(path)


def test_weight_commands_are_exported_with_a_note_naming_them(update_records) -> None:
    trace = trace_export.project(update_records, "r")
    weights = [e for e in trace.events if e.cmd in trace_export.WEIGHT_COMMANDS]
    assert weights and weights[0].kind == "issue" and weights[0].cmd == "UpdateWeights"
    assert all("(P-17) is not among OmniSleep's actions" in e.note for e in weights)
    first = trace.events.index(weights[0])
    assert not any(e.note for e in trace.events[:first])  # what comes before replays as before


def test_the_checker_stops_at_the_update_saying_it_is_outside_the_model(update_records) -> None:
    try:
        find_java(), find_jar()
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))
    (verdict,) = trace_check.validate_records(update_records)
    trace = trace_export.project(update_records, "r")
    update = next(e for e in trace.events if e.cmd == "UpdateWeights")
    assert not verdict.accepted
    assert verdict.reason.startswith("outside the model: UpdateWeights (P-17)"), verdict.line()
    assert verdict.index == trace.events.index(update) + 1, verdict.line()
