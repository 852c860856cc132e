"""P-11/generated_commands_match_the_tables: generated sequences compared with the reference
model (omni_core/conformance/cases_model.py). This project's worker passes; of the suite's
own mutants, those below are rejected by this case alone (run on its own, not the hand-written
cases of their requirement), with the words of the first disagreement."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_core.conformance import SuiteOptions
from omni_core.conformance.cases import CASES
from omni_core.conformance.cases_model import Model, _agrees
from omni_core.conformance.runner import CaseResult, SuiteRunner
from omni_core.fsm.worker import CommandReceived, EffectCompleted, Loaded, WorkerCore
from omni_core.protocol import Execute, Nack, NackReason, Result, Sleep, WorkerState

from . import mutants

CASE = next(c for c in CASES if c.name == "generated_commands_match_the_tables")
SEQUENCE = "of a generated sequence (seed 0) was answered"
# mutant -> words of the failure (with the default 50 sequences from seed 0)
CAUGHT = {
    "no_reply_cache": SEQUENCE,
    "crash_on_second_sleep": "died with exit code 134",
    "execute_while_sleeping": "answered Nack EXECUTE_ERROR SLEEPING; the reference model answers Nack INVALID_STATE",
    "level2_wakes_active": "the reference model answers Ack OK NEEDS_RELOAD",
    "double_reply": SEQUENCE,
    "unknown_tag_half_applied": "Nack UNKNOWN_TAG SLEEPING; the reference model answers Nack UNKNOWN_TAG ACTIVE",
    "status_clears_cache": "answered Ack ALREADY SLEEPING",
    "wake_unknown_tag_already": "the reference model answers Nack UNKNOWN_TAG",
    "status_wakes": SEQUENCE,
    "silent_sleep_already": "no reply from worker rank 0",
    "task_id_reuse_served": "the reference model answers Nack TASK_ID_REUSED",
}


def _run(name: str) -> CaseResult:
    if name == "reference":
        runner = SuiteRunner("synthetic", options=SuiteOptions(reply_timeout_s=5.0))
    else:
        runner = SuiteRunner(mutants.target(name), options=mutants.options(name, reply_timeout_s=5.0))
    try:
        return runner.run_case(CASE)
    finally:
        runner.close()


@pytest.fixture(scope="module")
def results() -> dict[str, CaseResult]:
    names = ["reference", *CAUGHT]
    with ThreadPoolExecutor(4) as pool:
        return dict(zip(names, pool.map(_run, names), strict=True))


def test_the_reference_worker_answers_as_the_model(results) -> None:
    assert results["reference"].outcome == "pass", results["reference"].details()


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_a_mutant_is_rejected_by_the_generated_sequences(results, name: str) -> None:
    result = results[name]
    assert result.outcome == "fail", f"{name} ({mutants.MUTANTS[name][1]}) passed the generated sequences"
    assert CAUGHT[name] in result.failure.problem if result.failure else False, result.details()


def test_a_failure_names_the_seed_and_the_sequence(results) -> None:
    problem = results["execute_while_sleeping"].failure.problem
    assert "seed 0" in problem and "The sequence, with the model's answers:\n  1. " in problem


def test_the_model_is_the_worker_core_with_its_effects_completed() -> None:
    """What the model answers is what WorkerCore answers once the shell completed the effect."""
    core = WorkerCore(0, epoch=3)
    core.step(Loaded())
    sleep = Sleep(task_id="s", epoch=3, level=2)
    core.step(CommandReceived(sleep))
    (want,) = core.step(EffectCompleted("s", output=())).replies

    class _Peer:
        rank, tags, epoch, capabilities = 0, core.tags, 3, frozenset(c.value for c in core.capabilities)

    class _Ctx:
        worker = _Peer()

    model = Model(_Ctx())  # type: ignore[arg-type]
    assert model.answer(sleep) == want
    assert isinstance(model.answer(Execute(task_id="e", epoch=3, payload=1)), Nack)


def test_a_runner_error_in_active_stands_for_a_result_and_nothing_else_does() -> None:
    result = Result(task_id="e", epoch=3, rank=0, output=None)

    def nack(reason: NackReason, state: WorkerState) -> Nack:
        return Nack(task_id="e", epoch=3, rank=0, command="Execute", reason=reason, detail="x", state=state)

    assert _agrees(nack(NackReason.EXECUTE_ERROR, WorkerState.ACTIVE), result)
    assert not _agrees(nack(NackReason.EXECUTE_ERROR, WorkerState.SLEEPING), result)
    assert not _agrees(nack(NackReason.INVALID_STATE, WorkerState.SLEEPING), result)


def test_no_sequences_asked_for_is_a_skip_and_a_negative_count_an_error() -> None:
    runner = SuiteRunner("synthetic", options=SuiteOptions(reply_timeout_s=5.0, model_examples=0))
    try:
        assert runner.run_case(CASE).outcome == "skip"
    finally:
        runner.close()
    with pytest.raises(ValueError, match="model_examples must be >= 0"):
        SuiteOptions(model_examples=-1)
