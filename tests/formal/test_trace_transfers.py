"""A traced pipeline (P-22): the trace spec replays the transfer commands as it replays the
other stateless tasks (OmniWeights), so a real run of two stages moving a request's
intermediate is accepted, each stage's trace on its own."""

from __future__ import annotations

import pytest

from omni_core.engine import Engine, PipelineStage
from omni_core.formal import trace_check
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.engine.conftest import small_spec
from tests.formal.test_trace_validation import needs_tlc


@pytest.fixture(scope="module")
def pipeline_records(tmp_path_factory):
    path = tmp_path_factory.mktemp("transfers") / "transfers.jsonl"
    with Engine([small_spec("text"), small_spec("image")], trace_path=str(path)) as engine:
        engine.pipeline(
            [PipelineStage("text", {"seed": 1, "batch": 1}, export=("hidden",)), PipelineStage("image", {})]
        )
    return read_trace(path)


def test_the_trace_names_the_commands(pipeline_records) -> None:
    issued = sorted({r.record.command for r in pipeline_records if isinstance(r.record, T.StageIssued)})
    assert issued == ["TransferIn", "TransferOut", "TransferRelease"]


@needs_tlc
def test_a_traced_pipeline_is_accepted(pipeline_records) -> None:
    verdicts = trace_check.validate_records(pipeline_records)
    assert verdicts and all(v.accepted for v in verdicts), [v.line() for v in verdicts]
