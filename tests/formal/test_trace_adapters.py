"""A run with LoRA adapters (P-20): the trace spec replays AddAdapter, PinAdapter, ListAdapters
and RemoveAdapter as the other stateless tasks (OmniWeights' IssueWeightTask), so a real run
that uses them, adapter-bound requests included, is accepted."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine
from omni_core.formal import trace_check
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import PROBE, small_spec
from tests.formal.test_trace_validation import needs_tlc


@pytest.fixture(scope="module")
def adapter_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("adapters") / "adapters.jsonl"
    spec = small_spec("a", tags=("weights", "kv_cache", "adapters"))
    with Engine([spec], trace_path=str(path)) as engine:
        engine.add_adapter("a", "sql", "seed:7", rank=4, target_modules=("w0",))
        engine.pin_adapter("a", "sql")
        engine.execute("a", PROBE, adapter="sql")
        engine.list_adapters("a")
        engine.remove_adapter("a", "sql")
    return read_trace(path)


def test_the_trace_names_the_commands(adapter_records) -> None:
    issued = [r.record.command for r in adapter_records if isinstance(r.record, T.StageIssued)]
    assert issued == ["AddAdapter", "PinAdapter", "ListAdapters", "RemoveAdapter"]


@needs_tlc
def test_a_run_with_adapters_is_accepted(adapter_records) -> None:
    (verdict,) = trace_check.validate_records(adapter_records)
    assert verdict.accepted, verdict.line()
