"""The stage core's trace recorder (`fsm/stage_trace.py`, `StageRecorder`) on its own: each
step starts empty, the first deadline noted is the one recorded, the step closes with its
answers and its task's end, and nothing of one step is left for the next."""

from __future__ import annotations

from types import MappingProxyType

from omni_core.fsm import StageCore
from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.fsm.stage_step import TaskOutcome
from omni_core.fsm.stage_trace import StageRecorder
from omni_core.fsm.trace_records import RequestAnswered, StageDeadline, StageStarting, TaskEnded
from omni_core.protocol import AckStatus, StageState


def _outcome() -> TaskOutcome:
    empty: MappingProxyType = MappingProxyType({})
    failures = MappingProxyType({0: "x" * 5000})
    return TaskOutcome("t", "Sleep", False, AckStatus.OK, StageState.FAILED, empty, failures, "bad", 0.0, 1.0)


def test_a_step_closes_with_its_answers_then_its_task_and_the_next_starts_empty() -> None:
    recorder = StageRecorder()
    core = StageCore("s", 1)
    recorder.phase(core, I.Start(10.0), StageState.STARTING, (), 0.0)
    answer = RequestOutcome("r", None, RequestError.REJECTED, "full")
    records = recorder.finish((answer,), _outcome())
    assert [type(r) for r in records] == [StageStarting, RequestAnswered, TaskEnded]
    ended = records[-1]
    assert isinstance(ended, TaskEnded) and len(ended.failed_ranks[0]) < 5000  # clipped, as every detail
    assert recorder.finish((), None) == ()


def test_the_first_deadline_noted_in_a_step_is_the_one_recorded() -> None:
    core = StageCore("s", 1)
    core.step(I.Start(5.0), 0.0)
    recorder = StageRecorder()
    recorder.expired(5.0, "")
    recorder.expired(7.0, "later")  # a request's, found after the start's
    core.lifecycle.fire("fail")  # the tick's phase changed the state
    recorder.phase(core, I.Tick(), StageState.STARTING, (), 9.0)
    (deadline,) = recorder.finish((), None)
    assert isinstance(deadline, StageDeadline)
    assert (deadline.deadline_at_s, deadline.task_id) == (5.0, "")
    recorder.begin()
    recorder.phase(core, I.Tick(), StageState.STARTING, (), 9.0)
    (deadline,) = recorder.finish((), None)
    assert isinstance(deadline, StageDeadline) and deadline.deadline_at_s == 9.0  # none noted: now
