"""The PAUSED lifecycle in the stage core (vLLM's pause/resume), through `StageCore.step` on a
controlled clock: admission closes and memory stays, no request starts while PAUSED, in-flight
requests drain first (their callers hear ABORTED at once under mode=abort), nothing goes to the
ranks, resume serves the queue, and the table refuses what a pause does not allow."""

from __future__ import annotations

import dataclasses

import pytest
import stage_inputs
from lifecycle_helpers import StageHarness
from test_admission import Driver, answers

from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy, Admit, QueueAction, admit, queue_rule
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.stage import StageBusyError, StageCommandError, StageCore, StageRequest
from omni_core.fsm.stage_step import StageSnapshot
from omni_core.fsm.stage_table import STAGE_TRANSITIONS
from omni_core.fsm.worker import InvariantViolation
from omni_core.protocol import AckStatus, DiskSource, HoldRequests, Nack, NackReason, StageState, WorkerState

S = StageState
P = AdmissionPolicy


def _names(step) -> set[str]:
    return {type(o.command).__name__ for o in step.sends}


def test_the_table_pauses_only_a_running_stage_and_resumes_only_a_paused_one() -> None:
    rows = {t.trigger: t for t in STAGE_TRANSITIONS}
    assert rows["pause_drain"].sources == (S.RUNNING,) and rows["pause_drain"].dest is S.DRAINING
    assert rows["pause_drained"].sources == (S.DRAINING,) and rows["pause_drained"].dest is S.PAUSED
    assert rows["resume"].sources == (S.PAUSED,) and rows["resume"].dest is S.RUNNING
    assert not any(S.PAUSED in t.sources for t in STAGE_TRANSITIONS if t.trigger == "execute")
    # The admission rows: nothing runs in PAUSED, the queue holds (no policy wakes a pause).
    for policy in P:
        assert admit(S.PAUSED, policy).decision is not Admit.RUN
        assert queue_rule(S.PAUSED, policy).action is QueueAction.HOLD
    assert admit(S.PAUSED, P.QUEUE).decision is Admit.QUEUE
    assert admit(S.PAUSED, P.WAKE).decision is Admit.QUEUE
    assert admit(S.PAUSED, P.REJECT).decision is Admit.REFUSE_POLICY


def test_pause_of_an_idle_stage_commits_at_once_and_sends_nothing() -> None:
    d = Driver()
    step = d.step(I.PauseCall("p", "wait", 30.0))
    assert d.core.state is S.PAUSED and not step.sends
    assert step.outcome is not None and step.outcome.ok and step.outcome.command == "Pause"
    assert step.outcome.state is S.PAUSED and step.outcome.status is AckStatus.OK
    # Memory is as in RUNNING: every tag resident, weights valid, ranks ACTIVE.
    assert not d.core.residency.asleep and d.core.residency.weights_valid


def test_no_request_starts_while_paused_and_resume_serves_the_queue() -> None:
    d = Driver()
    d.step(I.PauseCall("p", "wait", 30.0))
    held = d.step(I.Submit("r1", 7, 30.0))
    assert not held.sends and not held.requests and len(d.core.queue) == 1
    assert d.core.in_flight_requests == 0
    resumed = d.step(I.ResumeCall("u", 30.0))
    assert d.core.state is S.RUNNING and resumed.outcome is not None and resumed.outcome.ok
    assert resumed.outcome.command == "Resume" and _names(resumed) == {"Execute"}  # the queue, in the same step
    assert answers(d.run(resumed)) == {"r1": (None, 7)}


def test_wait_lets_in_flight_requests_finish_before_paused() -> None:
    d = Driver()
    request = d.step(I.Submit("r1", 5, 30.0))
    step = d.step(I.PauseCall("p", "wait", 30.0))
    assert d.core.state is S.DRAINING and step.outcome is None and not step.sends and not step.requests
    late = d.step(I.Submit("r2", 6, 30.0))
    assert not late.sends and len(d.core.queue) == 1  # admission is closed while it drains
    done = d.run(request)
    assert answers(done) == {"r1": (None, 5)}
    assert d.core.state is S.PAUSED and done.outcome is not None and done.outcome.ok
    assert not done.sends  # the queued r2 stays held: nothing starts while PAUSED


def test_keep_holds_in_flight_requests_on_every_rank_and_resume_releases_them() -> None:
    d = Driver()
    request = d.step(I.Submit("r1", 5, 30.0))
    step = d.step(I.PauseCall("p", "keep", 30.0))
    holds = [(o.rank, o.command.hold) for o in step.sends if isinstance(o.command, HoldRequests)]
    assert d.core.state is S.DRAINING and step.outcome is None and holds == [(0, True), (1, True)]
    assert not d.step(I.Submit("r2", 6, 30.0)).sends  # admission is closed while the ranks hold
    paused = d.run(step)
    assert d.core.state is S.PAUSED and paused.outcome is not None and paused.outcome.command == "Pause"
    assert d.core.in_flight_requests == 1 and not paused.requests  # r1 is held, not answered
    resumed = d.step(I.ResumeCall("u", 30.0))
    releases = [(o.rank, o.command.hold) for o in resumed.sends if isinstance(o.command, HoldRequests)]
    assert d.core.state is S.RUNNING and releases == [(0, False), (1, False)]
    released = d.run(resumed)  # the release, then the queued r2 behind it
    assert released.outcome is not None and released.outcome.ok and released.outcome.command == "Resume"
    assert answers(released) == {"r2": (None, 6)}
    assert answers(d.run(request)) == {"r1": (None, 5)}


def test_abort_answers_callers_at_once_but_pauses_only_when_the_ranks_answered() -> None:
    d = Driver()
    request = d.step(I.Submit("r1", 5, 30.0))
    step = d.step(I.PauseCall("p", "abort", 30.0))
    assert answers(step)["r1"][0] is RequestError.ABORTED
    assert d.core.state is S.DRAINING and step.outcome is None  # a rank still runs it
    after = d.run(request)
    assert not after.requests  # the caller heard once
    assert d.core.state is S.PAUSED and after.outcome is not None and after.outcome.ok


def test_a_drain_past_its_deadline_abandons_the_pause_back_to_running() -> None:
    d = Driver()
    d.step(I.Submit("r1", 5, 60.0))
    d.step(I.PauseCall("p", "wait", 5.0))
    d.now = 6.0
    step = d.step(I.Tick())
    assert d.core.state is S.RUNNING and step.outcome is not None and not step.outcome.ok
    assert "pause abandoned" in step.outcome.error and "stays RUNNING" in step.outcome.error


def test_pause_and_resume_twice_are_already_and_retries_replay() -> None:
    d = Driver()
    first = d.step(I.PauseCall("p", "wait", 30.0))
    assert d.step(I.PauseCall("p", "wait", 30.0)).outcome == first.outcome  # same task id: replayed
    again = d.step(I.PauseCall("p2", "abort", 30.0))
    assert again.outcome is not None and again.outcome.status is AckStatus.ALREADY and d.core.state is S.PAUSED
    d.step(I.ResumeCall("u", 30.0))
    twice = d.step(I.ResumeCall("u2", 30.0))
    assert twice.outcome is not None and twice.outcome.status is AckStatus.ALREADY and d.core.state is S.RUNNING
    with pytest.raises(StageCommandError, match="use a fresh task_id"):
        d.step(I.PauseCall("p", "abort", 30.0))


def test_what_a_pause_refuses() -> None:
    d = Driver()
    with pytest.raises(StageCommandError, match="pause mode must be one of"):
        d.step(I.PauseCall("bad", "freeze", 30.0))
    d.run(d.step(I.SleepCall("sl", 1, None, 30.0)))
    with pytest.raises(StageCommandError, match="only a RUNNING stage pauses"):
        d.step(I.PauseCall("p", "wait", 30.0))
    with pytest.raises(StageCommandError, match="not PAUSED: nothing to resume"):
        d.step(I.ResumeCall("u", 30.0))
    d2 = Driver()
    d2.step(I.Submit("r1", 5, 30.0))
    d2.step(I.PauseCall("p", "wait", 30.0))
    with pytest.raises(StageBusyError, match="task 'p' is in flight"):
        d2.step(I.ResumeCall("u", 30.0))


def test_reject_policy_refuses_while_paused_naming_resume() -> None:
    d = Driver(policy=P.REJECT)
    d.step(I.PauseCall("p", "wait", 30.0))
    step = d.step(I.Submit("r1", 1, 30.0))
    error, detail = answers(step)["r1"]
    assert error is RequestError.REJECTED and "PAUSED" in str(detail) and "resume()" in str(detail)


def test_a_paused_stage_sleeps_without_a_drain_and_wakes_still_paused() -> None:
    d = Driver()
    d.step(I.PauseCall("p", "wait", 30.0))
    sleep = d.step(I.SleepCall("sl", 1, None, 30.0))
    assert d.core.state is S.TRANSITIONING and _names(sleep) == {"Sleep"}
    d.run(sleep)
    assert d.core.state is S.SLEEPING and d.core.paused
    woke = d.run(d.step(I.WakeCall("w", None, 30.0)))
    assert d.core.state is S.PAUSED and woke.outcome is not None and woke.outcome.state is S.PAUSED
    assert d.step(I.ResumeCall("u", 30.0)).outcome.state is S.RUNNING  # type: ignore[union-attr]
    assert not d.core.paused


def test_a_request_under_policy_wake_wakes_a_paused_sleeping_stage_and_waits_for_resume() -> None:
    """pause -> sleep -> a request under admission 'wake': the stage wakes (the policy's wake)
    and comes back PAUSED; the request stays queued, nothing runs, until resume()."""
    d = Driver(policy=P.WAKE)
    d.step(I.PauseCall("p", "wait", 30.0))
    d.run(d.step(I.SleepCall("sl", 1, None, 30.0)))
    submitted = d.step(I.Submit("r1", 7, 30.0))
    assert _names(submitted) == {"Wake"} and len(d.core.queue) == 1  # the policy wakes it
    woke = d.run(submitted)
    assert d.core.state is S.PAUSED and not woke.requests and len(d.core.queue) == 1
    assert d.core.in_flight_requests == 0 and "Execute" not in _names(woke)
    resumed = d.step(I.ResumeCall("u", 30.0))
    assert d.core.state is S.RUNNING and _names(resumed) == {"Execute"}
    assert answers(d.run(resumed)) == {"r1": (None, 7)}


def test_a_resume_while_asleep_ends_the_pause_and_the_next_wake_serves() -> None:
    d = Driver()
    d.step(I.PauseCall("p", "wait", 30.0))
    d.run(d.step(I.SleepCall("sl", 2, None, 30.0)))
    resumed = d.step(I.ResumeCall("u", 30.0))
    assert resumed.outcome is not None and resumed.outcome.status is AckStatus.OK and not resumed.sends
    assert d.core.state is S.SLEEPING and not d.core.paused
    d.run(d.step(I.WakeCall("w", None, 30.0)))
    assert d.core.state is S.NEEDS_RELOAD
    d.run(d.step(I.ReloadCall("rl", None, 30.0)))
    assert d.core.state is S.RUNNING


def test_a_reload_of_a_paused_stage_after_a_level_2_sleep_stays_paused() -> None:
    d = Driver()
    d.step(I.PauseCall("p", "wait", 30.0))
    d.run(d.step(I.SleepCall("sl", 2, None, 30.0)))
    d.run(d.step(I.WakeCall("w", None, 30.0)))
    assert d.core.state is S.NEEDS_RELOAD and d.core.paused
    d.run(d.step(I.ReloadCall("rl", None, 30.0)))
    assert d.core.state is S.PAUSED


def test_the_invariants_refuse_a_request_in_flight_while_paused() -> None:
    d = Driver()
    d.step(I.PauseCall("p", "wait", 30.0))
    d.core.in_flight["smuggled"] = StageRequest("smuggled", None, float("inf"))
    with pytest.raises(InvariantViolation, match="requests in flight outside RUNNING/DRAINING"):
        d.core._check_invariants()


def test_a_paused_stage_takes_a_weight_update_and_stays_paused() -> None:
    """vLLM's RL loop: pause, update the weights, resume. The update goes out at once (nothing
    is in flight), commits the new version on every ACK and leaves the stage PAUSED; a refusal
    by every rank returns it to PAUSED at the old version."""
    h = StageHarness(2)
    stage_inputs.pause(h.stage, "p", "wait", h.now, 5.0)
    step = stage_inputs.update_weights(h.stage, "u1", 1, DiskSource(path="/ckpt/v1"), h.now, 5.0)
    assert h.stage.state is S.WAKING and _names(step) == {"UpdateWeights"}
    done = h.complete(step).outcome
    assert done is not None and done.ok and done.state is S.PAUSED and h.stage.weights_version == 1
    step = stage_inputs.update_weights(h.stage, "u2", 2, DiskSource(path="/ckpt/v2"), h.now, 5.0)
    refusals = [
        Nack(
            task_id="u2",
            epoch=0,
            rank=r,
            command="UpdateWeights",
            reason=NackReason.INVALID_ARGUMENT,
            detail="no such checkpoint",
            state=WorkerState.ACTIVE,
            weights_version=1,
        )
        for r in (0, 1)
    ]
    refused = h.feed(refusals).outcome
    assert refused is not None and refused.refused and refused.state is S.PAUSED
    assert h.stage.weights_version == 1 and h.stage.state is S.PAUSED
    assert stage_inputs.resume(h.stage, "u", h.now).outcome.state is S.RUNNING  # type: ignore[union-attr]


def test_a_held_pause_restores_from_its_snapshot_and_resume_releases_every_rank() -> None:
    d = Driver()
    d.step(I.Submit("r1", 5, 30.0))
    d.run(d.step(I.PauseCall("p", "keep", 30.0)))
    assert d.core.state is S.PAUSED and d.core.holding and d.core.in_flight_requests == 1
    core = StageCore("s", 2)
    # Without `holding` the snapshot would be a PAUSED stage with requests in flight: no state.
    snapshot = StageSnapshot(
        S.PAUSED,
        rank_state={0: WorkerState.ACTIVE, 1: WorkerState.ACTIVE},
        paused=True,
        in_flight=tuple(d.core.requests.in_flight.values()),
        holding=True,
    )
    core.restore(snapshot)
    assert core.holding and core.in_flight_requests == 1
    with pytest.raises(InvariantViolation, match="in flight outside"):
        StageCore("s", 2).restore(dataclasses.replace(snapshot, holding=False))
    resumed = core.step(I.ResumeCall("u", 30.0), 0.0)
    releases = [(o.rank, o.command.hold) for o in resumed.sends if isinstance(o.command, HoldRequests)]
    assert core.state is S.RUNNING and releases == [(0, False), (1, False)]
