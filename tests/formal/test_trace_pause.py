"""A traced run with a pause: trace validation follows OmniSleep, which has no PAUSED (the
pause is model-checked in tla/OmniPause.tla), so the projection marks the pause's lines as
outside the model and a divergence there says so instead of "no spec action matches"."""

from __future__ import annotations

from omni_core.engine import Engine
from omni_core.formal import trace_export
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, small_spec


def test_a_pause_in_a_trace_is_named_as_outside_the_replayed_model(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    with Engine([small_spec("s")], trace_path=str(path)) as engine:
        engine.execute("s", PROBE)
        engine.pause("s")
        engine.resume("s")
    events = trace_export.project(read_trace(path), "s").events
    marked = [(e.before, e.state) for e in events if e.kind == "state" and "OmniPause.tla" in e.note]
    assert marked == [("RUNNING", "PAUSED"), ("PAUSED", "RUNNING")], marked
    assert not [e for e in events if e.note and e.kind != "state"]  # nothing else is marked
