"""Admission and requests in the stage core, driven through `StageCore.step` on a controlled
clock (no processes, no sleeping): the tables are total, and every admission decision, queue
rule, deadline and request path gives the outcome the engine used to compute by hand."""

from __future__ import annotations

import pytest
from lifecycle_helpers import NO_MEMORY, wire

from omni_core.fsm import StageCore, StageStep, WorkerCore
from omni_core.fsm import inputs as I
from omni_core.fsm import trace_records as T
from omni_core.fsm.admission import ADMISSION, QUEUE_RULES, AdmissionPolicy, Admit, admit, queue_rule
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.worker import CommandReceived, EffectCompleted, Loaded
from omni_core.protocol import (
    Capability,
    Execute,
    Hello,
    Nack,
    NackReason,
    Reply,
    Result,
    StageState,
    Wake,
    WorkerState,
    decode_command,
    encode,
)

S = StageState
P = AdmissionPolicy


@pytest.mark.parametrize("table", [ADMISSION, QUEUE_RULES], ids=["admission", "queue_rules"])
def test_tables_are_total_and_disjoint(table) -> None:
    for state in S:
        for policy in P:
            rows = [r for r in table if state in r.states and policy in r.policies]
            assert len(rows) == 1, (state, policy, rows)


def test_only_running_admits_and_only_failed_or_stopped_need_a_restart() -> None:
    assert {s for s in S if admit(s, P.QUEUE).decision is Admit.RUN} == {S.RUNNING}
    assert {s for s in S if admit(s, P.QUEUE).decision is Admit.REFUSE_FAILED} == {S.FAILED, S.STOPPED}
    assert queue_rule(S.SLEEPING, P.WAKE).action.value == "auto_wake"


class Driver:
    """One StageCore and its WorkerCores; every input through step(), the clock in `now`."""

    def __init__(self, ranks: int = 2, capabilities: tuple[Capability, ...] = (), **core: object) -> None:
        self.now = 0.0
        self.core = StageCore("s", ranks, **core)  # type: ignore[arg-type]
        self.workers = [WorkerCore(r) for r in range(ranks)]
        self.step(I.Start(60.0))
        started = StageStep()
        for w in self.workers:
            w.step(Loaded())
            hello = Hello(
                task_id="hello",
                epoch=0,
                rank=w.rank,
                pid=1,
                device="cpu",
                backend="portable",
                tags=self.core.tags,
                capabilities=capabilities,
            )
            started = self.step(I.Received(hello))
        assert started.started is S.RUNNING

    def step(self, event: I.EngineInput) -> StageStep:
        return self.core.step(event, self.now)

    def deliver(self, step: StageStep, ranks: set[int] | None = None) -> list[Reply]:
        """Run the step's commands on the workers (Execute answers with its payload)."""
        replies: list[Reply] = []
        for out in step.sends:
            if ranks is not None and out.rank not in ranks:
                continue
            worker = self.workers[out.rank]
            got = worker.step(CommandReceived(decode_command(encode(out.command))))
            replies += got.replies
            if got.effect is not None:
                output = out.command.payload if isinstance(out.command, Execute) else None
                replies += worker.step(EffectCompleted(out.command.task_id, memory=NO_MEMORY, output=output)).replies
        return [wire(r) for r in replies]

    def feed(self, replies: list[Reply]) -> StageStep:
        out = StageStep()
        for reply in replies:
            out = out.then(self.step(I.Received(reply)))
        return out

    def run(self, step: StageStep) -> StageStep:
        return self.feed(self.deliver(step))


def answers(step: StageStep) -> dict[str, tuple[RequestError | None, object]]:
    return {a.request_id: (a.error, a.output if a.ok else a.detail) for a in step.requests}


def test_a_request_runs_on_every_rank_and_answers_with_rank_0s_output() -> None:
    d = Driver()
    step = d.step(I.Submit("r1", {"x": 1}, 30.0))
    assert [o.rank for o in step.sends] == [0, 1] and d.core.in_flight_requests == 1
    assert answers(d.run(step)) == {"r1": (None, {"x": 1})}
    assert d.core.in_flight_requests == 0


def test_sleep_waits_for_the_request_in_flight_then_goes_out() -> None:
    d = Driver()
    request = d.step(I.Submit("r1", 1, 30.0))
    sleep = d.step(I.SleepCall("sl", 1, None, 30.0))
    assert d.core.state is S.DRAINING and not sleep.sends  # nothing over a running request
    replies = d.deliver(request)
    first = d.step(I.Received(replies[0]))
    assert not first.sends and d.core.state is S.DRAINING  # one rank is not all of them
    last = d.step(I.Received(replies[1]))
    assert answers(last) == {"r1": (None, 1)} and {type(o.command).__name__ for o in last.sends} == {"Sleep"}


def test_abort_in_flight_answers_callers_now_but_the_drain_still_waits() -> None:
    d = Driver()
    request = d.step(I.Submit("r1", 1, 30.0))
    step = d.step(I.SleepCall("sl", 1, None, 30.0, abort_in_flight=True))
    assert answers(step)["r1"][0] is RequestError.ABORTED and not step.sends
    after = d.run(request)
    assert not after.requests and {type(o.command).__name__ for o in after.sends} == {"Sleep"}


def _asleep(policy: P, **core: object) -> Driver:
    d = Driver(policy=policy, **core)  # type: ignore[arg-type]
    d.run(d.step(I.SleepCall("sl", 1, None, 30.0)))
    assert d.core.state is S.SLEEPING
    return d


def test_queue_policy_holds_requests_until_a_wake_then_serves_them() -> None:
    d = _asleep(P.QUEUE)
    step = d.step(I.Submit("r1", 7, 30.0))
    assert not step.sends and not step.requests and len(d.core.queue) == 1
    woke = d.step(I.WakeCall("w", None, 30.0))
    served = d.run(woke)  # the commit dispatches the queue in the same step
    assert d.core.state is S.RUNNING and {type(o.command).__name__ for o in served.sends} == {"Execute"}
    assert answers(d.run(served)) == {"r1": (None, 7)}


def test_reject_policy_refuses_at_once() -> None:
    d = _asleep(P.REJECT)
    (answer,) = d.step(I.Submit("r1", 7, 30.0)).requests
    assert answer.error is RequestError.REJECTED and "policy is 'reject'" in answer.detail
    assert not d.core.queue


def test_wake_policy_wakes_the_stage_itself() -> None:
    d = _asleep(P.WAKE)
    step = d.step(I.Submit("r1", 7, 30.0))
    wakes = [o for o in step.sends if isinstance(o.command, Wake)]
    assert len(wakes) == 2 and wakes[0].command.task_id.startswith("auto-wake-s-0-")
    served = d.run(step)
    assert answers(d.run(served)) == {"r1": (None, 7)} and d.core.state is S.RUNNING


def test_needs_reload_refuses_requests_under_queue_and_wake() -> None:
    for policy in (P.QUEUE, P.WAKE):
        d = Driver(policy=policy)
        d.run(d.step(I.SleepCall("sl", 2, None, 30.0)))
        d.run(d.step(I.WakeCall("w", None, 30.0)))
        assert d.core.state is S.NEEDS_RELOAD
        (answer,) = d.step(I.Submit("r", 1, 30.0)).requests
        assert answer.error is RequestError.REJECTED and "reload_weights()" in answer.detail


def test_queued_requests_are_refused_when_the_stage_lands_in_needs_reload() -> None:
    d = Driver()
    d.run(d.step(I.SleepCall("sl", 2, None, 30.0)))
    d.step(I.Submit("r", 1, 30.0))
    landed = d.run(d.step(I.WakeCall("w", None, 30.0)))
    assert d.core.state is S.NEEDS_RELOAD and answers(landed)["r"][0] is RequestError.REJECTED


def test_the_queue_is_bounded_and_says_which_limit() -> None:
    d = _asleep(P.QUEUE, queue_limit=2)
    d.step(I.Submit("a", 1, 30.0))
    d.step(I.Submit("b", 1, 30.0))
    (answer,) = d.step(I.Submit("c", 1, 30.0)).requests
    assert answer.error is RequestError.REJECTED and "queue is full (2 requests)" in answer.detail


def test_max_in_flight_queues_the_rest_and_dispatches_as_requests_retire() -> None:
    d = Driver(max_in_flight=1)
    first = d.step(I.Submit("a", 1, 30.0))
    second = d.step(I.Submit("b", 2, 30.0))
    assert not second.sends and len(d.core.queue) == 1
    after = d.run(first)
    assert answers(after) == {"a": (None, 1)} and {o.command.task_id for o in after.sends} == {"b"}


def test_a_queued_request_expires_at_its_deadline_on_the_controlled_clock() -> None:
    d = _asleep(P.QUEUE)
    d.step(I.Submit("r", 1, 5.0))
    d.now = 4.999
    assert not d.step(I.Tick()).requests
    d.now = 5.0
    (answer,) = d.step(I.Tick()).requests
    assert answer.error is RequestError.REJECTED and "until its deadline" in answer.detail


def test_a_rank_silent_on_a_request_fails_the_request_and_the_stage_naming_it() -> None:
    d = Driver()
    step = d.step(I.Submit("r", 1, 5.0))
    d.feed(d.deliver(step, ranks={0}))
    d.now = 5.0
    tick = d.step(I.Tick())
    assert answers(tick)["r"][0] is RequestError.FAILED and "ranks [1]" in answers(tick)["r"][1]
    assert d.core.state is S.FAILED and set(d.core.failed_ranks) == {1}


def test_a_refusal_from_one_rank_fails_the_request_naming_it() -> None:
    d = Driver()
    step = d.step(I.Submit("r", 1, 30.0))
    refusal = Nack(
        task_id="r",
        epoch=0,
        rank=1,
        command="Execute",
        reason=NackReason.EXECUTE_ERROR,
        detail="bad payload",
        state=WorkerState.ACTIVE,
    )
    d.feed(d.deliver(step, ranks={0}))
    (answer,) = d.step(I.Received(wire(refusal))).requests
    assert answer.error is RequestError.FAILED and "rank 1: EXECUTE_ERROR" in answer.detail
    assert d.core.state is S.RUNNING


def test_a_request_that_could_not_be_sent_is_overload_and_retires_when_the_others_answer() -> None:
    d = Driver()
    step = d.step(I.Submit("r", 1, 30.0))
    (answer,) = d.step(I.SendFailed("r", (1,))).requests
    assert answer.error is RequestError.OVERLOADED and "overloaded" in answer.detail
    assert d.core.in_flight_requests == 1  # rank 0 still runs it
    after = d.feed(d.deliver(step, ranks={0}))
    assert not after.requests and d.core.in_flight_requests == 0 and d.core.state is S.RUNNING


def test_a_late_result_is_counted_not_applied() -> None:
    d = Driver()
    late = Result(task_id="gone", epoch=0, rank=0, output=1)
    assert d.step(I.Received(wire(late))) == StageStep()
    assert d.core.counters.late_results == 1


def test_stop_and_restart_answer_every_request() -> None:
    d = Driver(max_in_flight=1)
    d.step(I.Submit("a", 1, 30.0))
    d.step(I.Submit("b", 1, 30.0))
    restarted = d.step(I.Restart(60.0))
    # The running one may have run ("FAILED ... while this request ran"); the queued one never did.
    assert {k: v[0] for k, v in answers(restarted).items()} == {"a": RequestError.FAILED, "b": RequestError.REJECTED}
    d.step(I.Submit("c", 1, 30.0))  # STARTING: waits in the queue
    stopped = d.step(I.Stop())
    assert answers(stopped)["c"][0] is RequestError.CLOSED


def test_step_refuses_what_is_not_an_input() -> None:
    with pytest.raises(TypeError, match="engine input"):
        Driver().step("sleep")  # type: ignore[arg-type]


def test_each_queued_request_expires_at_its_own_deadline_not_behind_the_head() -> None:
    """Helper-reported bug: only the head of the queue was checked, so a 1 s request waited
    behind a 30 s one."""
    d = _asleep(P.QUEUE)
    d.step(I.Submit("patient", 1, 30.0))
    d.step(I.Submit("hurried", 1, 1.0))
    d.now = 1.0
    assert [a.request_id for a in d.step(I.Tick()).requests] == ["hurried"]
    assert [r.request_id for r in d.core.queue] == ["patient"]


def test_reject_in_needs_reload_says_to_reload_not_to_wake() -> None:
    d = Driver(policy=P.REJECT)
    d.run(d.step(I.SleepCall("sl", 2, None, 30.0)))
    d.run(d.step(I.WakeCall("w", None, 30.0)))
    (answer,) = d.step(I.Submit("r", 1, 30.0)).requests
    assert "reload_weights()" in answer.detail and "wake it" not in answer.detail


def test_the_records_name_the_policy_on_each_change_and_with_each_admission() -> None:
    """What trace validation holds the admission tables to (formal/trace_admission.py)."""
    d = _asleep(P.QUEUE)
    changed = d.step(I.SetAdmission(P.WAKE)).records
    assert changed == (T.AdmissionChanged(0, "queue", "wake"),)
    assert d.step(I.SetAdmission(P.WAKE)).records == ()  # no change, no line
    step = d.step(I.Submit("r1", 7, 30.0))
    submitted = next(r for r in step.records if isinstance(r, T.RequestSubmitted))
    assert (submitted.state, submitted.admission, submitted.policy) == ("SLEEPING", "queue", "wake")
    auto = next(r for r in step.records if isinstance(r, T.StageIssued))
    assert auto.auto and auto.policy == "wake"


def test_the_start_records_the_policy() -> None:
    core = StageCore("s", 1, policy=P.REJECT)
    (start,) = core.step(I.Start(60.0), 0.0).records
    assert isinstance(start, T.StageStarting) and start.policy == "reject"


def test_a_waiting_wake_records_how_long_it_may_wait_for_memory() -> None:
    d = _asleep(P.QUEUE, capabilities=(Capability.SWAP,))
    step = d.step(I.WakeCall("w", None, 30.0, memory_wait_s=2.5))
    issued = next(r for r in step.records if isinstance(r, T.StageIssued))
    sent = [r for r in step.records if isinstance(r, T.StageSent)]
    assert issued.memory_wait_s == 2.5 and issued.level == 1
    assert len(sent) == 2 and all(r.memory_wait_s == 2.5 for r in sent)
    plain = _asleep(P.QUEUE).step(I.WakeCall("w", None, 30.0)).records
    assert all(getattr(r, "memory_wait_s", None) is None for r in plain)
