"""StageCore, one scripted case at a time: start-up, all-ranks commit, draining, NACKs,
deadlines, dead ranks, restarts and epochs, retries, refusals. Plus the golden walkthrough."""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import stage_inputs
from lifecycle_helpers import NO_MEMORY, StageHarness, record_transitions, table_pairs, wire
from test_pause_core import test_a_paused_stage_takes_a_weight_update_and_stays_paused
from test_transfers_core import TRANSFER_STAGE_SCENARIOS

from omni_core.fsm import STAGE_TRANSITIONS, StageBusyError, StageCommandError, StageStep
from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.worker import CommandReceived
from omni_core.protocol import (
    Ack,
    AckStatus,
    Capability,
    Nack,
    NackReason,
    Profile,
    ResetPrefixCache,
    Result,
    Sleep,
    StageState,
    Wake,
    WorkerState,
)
from omni_testing.walkthrough import Walkthrough

S = StageState
W = WorkerState
GOLDEN = Path(__file__).parent / "golden" / "walkthrough.txt"


def reach_stage(state: StageState, ranks: int = 3, **kwargs: object) -> StageHarness:
    """A stage (and its workers) in `state`, reached through legal calls only."""
    if state is S.STARTING:
        return StageHarness(ranks, hello=False, **kwargs)  # type: ignore[arg-type]
    h = StageHarness(ranks, **kwargs)  # type: ignore[arg-type]
    st = h.stage
    if state is S.FAILED:
        stage_inputs.on_rank_died(st, 0, "SIGKILL", h.now)
    elif state is S.STOPPED:
        stage_inputs.stop(st, h.now)
    elif state is S.DRAINING:
        stage_inputs.request_started(st, h.now)
        stage_inputs.sleep(st, "drain", 1, None, h.now, 5.0)
    elif state is S.TRANSITIONING:
        h.last = stage_inputs.sleep(st, "sleep", 1, None, h.now, 5.0)  # type: ignore[attr-defined]
    elif state is S.PAUSED:
        stage_inputs.pause(st, "pause", "wait", h.now, 5.0)
    elif state is not S.RUNNING:
        level = 2 if state is S.NEEDS_RELOAD else 1
        h.complete(stage_inputs.sleep(st, "sleep", level, None, h.now, 5.0))
        if state is S.WAKING:
            h.last = stage_inputs.wake(st, "wake", None, h.now, 5.0)  # type: ignore[attr-defined]
        elif state is S.PARTIAL:
            h.complete(stage_inputs.wake(st, "wake", ("kv_cache",), h.now, 5.0))
        elif state is S.NEEDS_RELOAD:
            h.complete(stage_inputs.wake(st, "wake", None, h.now, 5.0))
    assert st.state is state, (st.state, state)
    return h


def outcome_of(step: StageStep):  # type: ignore[no-untyped-def]
    assert step.outcome is not None, step
    return step.outcome


# ----------------------------------------------------------------------- start-up


def test_start_commits_running_only_after_every_hello() -> None:
    h = StageHarness(3, hello=False)
    for rank in (2, 0):
        stage_inputs.on_hello(h.stage, h.hello(rank), h.now)
        assert h.stage.state is S.STARTING and not h.stage.admits()
    stage_inputs.on_hello(h.stage, h.hello(1), h.now)
    assert h.stage.state is S.RUNNING and h.stage.admits()


def test_start_deadline_names_the_silent_ranks() -> None:
    h = StageHarness(3, hello=False, deadline_s=10.0)
    stage_inputs.on_hello(h.stage, h.hello(1), h.now)
    assert stage_inputs.on_tick(h.stage, 9.9) == StageStep() and h.stage.state is S.STARTING
    stage_inputs.on_tick(h.stage, 10.0)
    assert h.stage.state is S.FAILED
    assert set(h.stage.failed_ranks) == {0, 2}
    assert "rank 0" in h.stage.failure and "rank 2" in h.stage.failure and "rank 1" not in h.stage.failure
    assert "Hello" in h.stage.failure


def test_hello_from_another_epoch_is_ignored() -> None:
    h = StageHarness(1, hello=False)
    stage_inputs.on_hello(h.stage, h.hello(0, epoch=5), h.now)
    assert h.stage.state is S.STARTING and h.stage.counters.stale_replies_ignored == 1


def test_hello_with_other_tags_fails_start() -> None:
    h = StageHarness(2, hello=False)
    stage_inputs.on_hello(h.stage, h.hello(1, tags=("weights",)), h.now)
    assert h.stage.state is S.FAILED and set(h.stage.failed_ranks) == {1}
    assert "tags" in h.stage.failure


def test_hello_from_a_rank_that_failed_to_load() -> None:
    h = StageHarness(2, hello=False)
    stage_inputs.on_hello(h.stage, h.hello(0), h.now)
    stage_inputs.on_hello(h.stage, h.hello(1, state=W.FAILED, detail="CUDA out of memory"), h.now)
    assert h.stage.state is S.FAILED and set(h.stage.failed_ranks) == {1}
    assert "CUDA out of memory" in h.stage.failure


def test_hello_from_an_unknown_rank_fails_start() -> None:
    h = StageHarness(2, hello=False)
    stage_inputs.on_hello(h.stage, h.hello(7), h.now)
    assert h.stage.state is S.FAILED and 7 in h.stage.failed_ranks


def test_rank_death_during_start() -> None:
    h = StageHarness(2, hello=False)
    stage_inputs.on_rank_died(h.stage, 1, "exit code 1", h.now)
    assert h.stage.state is S.FAILED and "exit code 1" in h.stage.failure


def test_death_of_an_earlier_incarnation_or_unknown_rank_is_ignored() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    stage_inputs.on_rank_died(h.stage, 1, "old process", h.now, epoch=h.stage.epoch + 1)
    stage_inputs.on_rank_died(h.stage, 7, "not ours", h.now)
    assert h.stage.state is S.RUNNING and h.stage.counters.stale_replies_ignored == 2


def test_ranks_silent_on_a_request_fail_the_stage_naming_them() -> None:
    h = reach_stage(S.RUNNING, ranks=3)
    h.stage.step(I.Submit("r1", None, 2.0), h.now)
    for rank in (0, 1):
        stage_inputs.on_reply(h.stage, Result(task_id="r1", epoch=h.stage.epoch, rank=rank, output=None), h.now)
    stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    assert h.stage.state is S.DRAINING
    assert stage_inputs.on_tick(h.stage, h.now + 1.9).outcome is None and h.stage.state is S.DRAINING
    step = stage_inputs.on_tick(h.stage, h.now + 2.0)
    assert h.stage.state is S.FAILED and set(h.stage.failed_ranks) == {2}
    assert step.outcome is not None and not step.outcome.ok and "rank 2: no result for request r1" in step.outcome.error
    (answer,) = step.requests
    assert answer.request_id == "r1" and answer.error is RequestError.FAILED and "ranks [2]" in answer.detail
    assert stage_inputs.on_tick(h.stage, h.now + 9.0) == StageStep()


def test_stage_needs_a_rank() -> None:
    from omni_core.fsm import StageCore

    with pytest.raises(StageCommandError, match="at least one rank"):
        StageCore("talker", 0)


def test_step_is_the_only_door() -> None:
    """Every input goes through step(), so the queue pump, the trace records and the
    invariant check always run: the core has no other public method but `restore`, which
    builds a state (a case, a test's start) and is no input."""
    from omni_core.fsm import StageCore

    public = {name for name in dir(StageCore) if not name.startswith("_") and callable(getattr(StageCore, name))}
    assert public == {"step", "admits", "restore"}
    h = reach_stage(S.RUNNING)
    with pytest.raises(TypeError, match="engine input"):
        h.stage.step(Sleep(task_id="s", epoch=0), h.now)  # a wire command is no input of the stage


def test_a_lifecycle_call_through_the_door_is_traced() -> None:
    h = reach_stage(S.RUNNING)
    step = h.stage.step(I.SleepCall("s", 1, None, 5.0), h.now)
    kinds = [type(r).__name__ for r in step.records]
    assert kinds == ["StageIssued", "StageSent", "StageSent", "StageSent"]
    assert step.records[0].deadline_at_s == h.now + 5.0  # type: ignore[attr-defined]


# ----------------------------------------------------------------------- all-ranks commit (P-5)


def test_sleep_commits_only_on_the_last_ack() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.sleep(h.stage, "s1", 1, None, h.now, 5.0)
    assert h.stage.state is S.TRANSITIONING and not h.stage.admits()
    assert sorted(o.rank for o in step.sends) == [0, 1, 2]
    assert all(o.command == Sleep(task_id="s1", epoch=0, level=1) for o in step.sends)
    replies = h.to_workers(step)
    for reply in replies[:-1]:
        assert stage_inputs.on_reply(h.stage, reply, h.now) == StageStep()
        assert h.stage.state is S.TRANSITIONING
    h.now = 1.5
    outcome = outcome_of(stage_inputs.on_reply(h.stage, replies[-1], h.now))
    assert h.stage.state is S.SLEEPING
    assert (outcome.ok, outcome.status, outcome.state, outcome.command) == (True, AckStatus.OK, S.SLEEPING, "Sleep")
    assert sorted(outcome.acks) == [0, 1, 2] and outcome.duration_s == 1.5
    assert h.stage.residency.asleep == {"weights", "kv_cache"}
    assert all(w.state is W.SLEEPING for w in h.workers)


def test_wake_to_running_partial_and_needs_reload_then_reload() -> None:
    h = reach_stage(S.SLEEPING)
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w", ("kv_cache",), h.now, 5.0))).state is S.PARTIAL
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w2", None, h.now, 5.0))).state is S.RUNNING
    h.complete(stage_inputs.sleep(h.stage, "s2", 2, None, h.now, 5.0))
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w3", ("weights",), h.now, 5.0))).state is S.NEEDS_RELOAD
    assert h.stage.residency.asleep == {"kv_cache"}
    outcome = outcome_of(h.complete(stage_inputs.reload(h.stage, "r", "/ckpt", h.now, 5.0)))
    assert outcome.state is S.PARTIAL and outcome.command == "ReloadWeights"
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w4", None, h.now, 5.0))).state is S.RUNNING
    assert h.stage.admits()


def test_sleep_and_wake_from_partial_and_needs_reload() -> None:
    h = reach_stage(S.PARTIAL)
    assert outcome_of(h.complete(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0))).state is S.SLEEPING
    h = reach_stage(S.NEEDS_RELOAD)
    assert outcome_of(h.complete(stage_inputs.sleep(h.stage, "s", 1, ("kv_cache",), h.now, 5.0))).state is S.SLEEPING
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w", None, h.now, 5.0))).state is S.NEEDS_RELOAD
    h = reach_stage(S.PARTIAL)
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w", None, h.now, 5.0))).state is S.RUNNING
    h = reach_stage(S.NEEDS_RELOAD)
    assert outcome_of(h.complete(stage_inputs.reload(h.stage, "r", None, h.now, 5.0))).state is S.RUNNING


def test_sleep_more_tags_while_sleeping() -> None:
    h = reach_stage(S.RUNNING)
    assert outcome_of(h.complete(stage_inputs.sleep(h.stage, "s-kv", 1, ("kv_cache",), h.now, 5.0))).state is S.SLEEPING
    step = stage_inputs.sleep(h.stage, "s-all", 2, None, h.now, 5.0)
    assert step.sends[0].command == Sleep(task_id="s-all", epoch=0, level=2, tags=None)
    assert h.stage.state is S.TRANSITIONING  # nothing executes while asleep: no drain
    assert outcome_of(h.complete(step)).state is S.SLEEPING
    assert not h.stage.residency.weights_valid
    assert outcome_of(h.complete(stage_inputs.wake(h.stage, "w", None, h.now, 5.0))).state is S.NEEDS_RELOAD


def test_wake_the_rest_while_needs_reload() -> None:
    h = needs_reload_with_kv_cache_asleep()
    step = stage_inputs.wake(h.stage, "w-kv", None, h.now, 5.0)
    assert step.sends[0].command == Wake(task_id="w-kv", epoch=0, tags=None)
    assert outcome_of(h.complete(step)).state is S.NEEDS_RELOAD
    assert h.stage.residency.asleep == frozenset()


def test_ack_in_an_unexpected_state_fails_naming_the_rank() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    liar = Ack(task_id="s", epoch=0, rank=1, command="Sleep", state=W.ACTIVE, memory=NO_MEMORY)
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(liar), h.now))
    assert h.stage.state is S.FAILED and set(outcome.failures) == {1}
    assert "expected SLEEPING" in outcome.failures[1] and "rank 1" in outcome.error
    assert step.sends


def test_ack_without_a_memory_report_fails_naming_the_rank() -> None:
    """Issue 10: an ACK that moved memory must say how much; one without is not trusted."""
    h = reach_stage(S.RUNNING)
    stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    bare = Ack(task_id="s", epoch=0, rank=2, command="Sleep", state=W.SLEEPING, asleep_tags=("kv_cache", "weights"))
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(bare), h.now))
    assert h.stage.state is S.FAILED and set(outcome.failures) == {2}
    assert "without a memory report" in outcome.failures[2]
    assert h.stage.counters.acks_without_memory_report == 1


def test_ack_for_another_command_fails_naming_the_rank() -> None:
    h = reach_stage(S.RUNNING)
    stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    confused = Ack(
        task_id="s",
        epoch=0,
        rank=0,
        command="Wake",
        state=W.SLEEPING,
        asleep_tags=("kv_cache", "weights"),
        memory=NO_MEMORY,
    )
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(confused), h.now))
    assert h.stage.state is S.FAILED and "'Wake'" in outcome.failures[0]


def _refusal(rank: int) -> Nack:
    return Nack(
        task_id="r",
        epoch=0,
        rank=rank,
        command="ReloadWeights",
        reason=NackReason.INVALID_ARGUMENT,
        detail="no such checkpoint",
        state=W.NEEDS_RELOAD,
    )


def test_reload_refused_by_every_rank_returns_to_needs_reload() -> None:
    """Issue 10: a source the runner cannot use is bad input, not a failure of the stage."""
    h = reach_stage(S.NEEDS_RELOAD)
    stage_inputs.reload(h.stage, "r", "/nope", h.now, 5.0)
    for rank in (0, 1):
        assert stage_inputs.on_reply(h.stage, wire(_refusal(rank)), h.now) == StageStep()  # waits for every rank
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(_refusal(2)), h.now))
    assert not outcome.ok and outcome.refused and outcome.state is S.NEEDS_RELOAD
    assert h.stage.state is S.NEEDS_RELOAD and "no such checkpoint" in outcome.error
    assert outcome_of(h.complete(stage_inputs.reload(h.stage, "r2", None, h.now, 5.0))).state is S.RUNNING


def test_reload_refused_by_some_ranks_only_fails_naming_them() -> None:
    """Ranks that disagree hold different weights: the stage cannot serve, and says who."""
    h = reach_stage(S.NEEDS_RELOAD)
    step = stage_inputs.reload(h.stage, "r", "/half", h.now, 5.0)
    for ack in h.to_workers(step, ranks={0, 2}):
        stage_inputs.on_reply(h.stage, ack, h.now)
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(_refusal(1)), h.now))
    assert h.stage.state is S.FAILED and set(outcome.failures) == {1}
    assert "different weights" in outcome.failures[1]


def _no_memory(rank: int, task_id: str, state: W) -> Nack:
    return Nack(
        task_id=task_id,
        epoch=0,
        rank=rank,
        command="Wake",
        reason=NackReason.NO_MEMORY,
        detail=f"rank {rank}: needed 4 GiB, 1 GiB free after 5 s; held by pid 77 (30 GiB)",
        state=state,
    )


def test_wake_refused_for_memory_by_every_rank_returns_to_where_it_started() -> None:
    """P-16: a swap's incoming stage that never got the memory is exactly where it was."""
    cases = (
        (S.SLEEPING, reach_stage(S.SLEEPING), None),
        (S.PARTIAL, reach_stage(S.PARTIAL), None),
        (S.NEEDS_RELOAD, needs_reload_with_kv_cache_asleep(), ("kv_cache",)),
    )
    for start, h, tags in cases:
        asleep = set(h.stage.residency.asleep)
        step = stage_inputs.wake(h.stage, "w", tags, h.now, 30.0, memory_wait_s=5.0)
        assert {out.command.memory_wait_s for out in step.sends} == {5.0}
        for rank in (0, 1):
            assert stage_inputs.on_reply(h.stage, wire(_no_memory(rank, "w", W(start.value))), h.now) == StageStep()
        outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(_no_memory(2, "w", W(start.value))), h.now))
        assert not outcome.ok and outcome.refused and outcome.state is start and h.stage.state is start
        assert set(outcome.refusals) == {0, 1, 2} and "held by pid 77" in outcome.error
        assert h.stage.residency.asleep == asleep
        # A retry of the same task is its recorded refusal; a new one may succeed.
        assert stage_inputs.wake(h.stage, "w", tags, h.now, 30.0, memory_wait_s=5.0).outcome == outcome


def test_wake_refused_for_memory_by_some_ranks_fails_naming_them() -> None:
    h = reach_stage(S.SLEEPING)
    step = stage_inputs.wake(h.stage, "w", None, h.now, 30.0, memory_wait_s=5.0)
    for ack in h.to_workers(step, ranks={0, 2}):
        stage_inputs.on_reply(h.stage, ack, h.now)
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(_no_memory(1, "w", W.SLEEPING)), h.now))
    assert h.stage.state is S.FAILED and set(outcome.failures) == {1}
    assert "different tags" in outcome.failures[1] and "held by pid 77" in outcome.failures[1]


def test_a_no_memory_nack_to_another_command_is_a_failure_not_a_refusal() -> None:
    h = reach_stage(S.RUNNING)
    stage_inputs.sleep(h.stage, "s", 1, None, h.now, 30.0)
    nack = Nack(task_id="s", epoch=0, rank=0, command="Sleep", reason=NackReason.NO_MEMORY, detail="?", state=W.ACTIVE)
    outcome = outcome_of(stage_inputs.on_reply(h.stage, wire(nack), h.now))
    assert h.stage.state is S.FAILED and not outcome.refused


def test_waiting_for_memory_needs_every_rank_to_declare_swap() -> None:
    h = StageHarness(ranks=2, hello=False)
    stage_inputs.on_hello(h.stage, h.hello(0), h.now)
    stage_inputs.on_hello(h.stage, h.hello(1, capabilities=(Capability.LEVEL2,)), h.now)
    h.complete(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 30.0))
    with pytest.raises(StageCommandError, match=r"ranks \[1\] cannot wait .*'swap'"):
        stage_inputs.wake(h.stage, "w", None, h.now, 30.0, memory_wait_s=5.0)
    assert h.stage.state is S.SLEEPING
    assert (
        outcome_of(h.complete(stage_inputs.wake(h.stage, "w", None, h.now, 30.0))).state is S.RUNNING
    )  # no waiting: fine


def test_the_memory_wait_must_end_before_the_deadline() -> None:
    h = reach_stage(S.SLEEPING)
    for wait in (30.0, 31.0, -1.0, float("nan"), 4000.0):
        with pytest.raises(StageCommandError, match="memory_wait_s"):
            stage_inputs.wake(h.stage, "w", None, h.now, 30.0 if wait != 4000.0 else 5000.0, memory_wait_s=wait)
    assert h.stage.state is S.SLEEPING


# ----------------------------------------------------------------------- ALREADY (P-4)


def needs_reload_with_kv_cache_asleep() -> StageHarness:
    h = reach_stage(S.RUNNING)
    h.complete(stage_inputs.sleep(h.stage, "s-l2", 2, None, h.now, 5.0))
    h.complete(stage_inputs.wake(h.stage, "w-weights", ("weights",), h.now, 5.0))
    assert h.stage.state is S.NEEDS_RELOAD and h.stage.residency.asleep == {"kv_cache"}
    return h


def test_sleep_of_asleep_tags_and_wake_of_resident_tags_are_already() -> None:
    for make, call in [
        (lambda: reach_stage(S.SLEEPING), lambda st: stage_inputs.sleep(st, "again", 2, None, 0.0, 5.0)),
        (lambda: reach_stage(S.PARTIAL), lambda st: stage_inputs.sleep(st, "again", 1, ("weights",), 0.0, 5.0)),
        (needs_reload_with_kv_cache_asleep, lambda st: stage_inputs.sleep(st, "again", 1, ("kv_cache",), 0.0, 5.0)),
        (lambda: reach_stage(S.RUNNING), lambda st: stage_inputs.wake(st, "again", None, 0.0, 5.0)),
        (lambda: reach_stage(S.PARTIAL), lambda st: stage_inputs.wake(st, "again", ("kv_cache",), 0.0, 5.0)),
        (lambda: reach_stage(S.NEEDS_RELOAD), lambda st: stage_inputs.wake(st, "again", None, 0.0, 5.0)),
    ]:
        h = make()
        state = h.stage.state
        step = call(h.stage)
        assert step.sends == ()
        outcome = outcome_of(step)
        assert (outcome.ok, outcome.status, outcome.state) == (True, AckStatus.ALREADY, state)
        assert h.stage.state is state
        assert call(h.stage).outcome is outcome  # recorded


def test_wake_of_resident_tags_while_sleeping() -> None:
    h = reach_stage(S.RUNNING)
    h.complete(stage_inputs.sleep(h.stage, "s", 1, ("kv_cache",), h.now, 5.0))
    assert h.stage.state is S.SLEEPING
    assert outcome_of(stage_inputs.wake(h.stage, "w", ("weights",), h.now, 5.0)).status is AckStatus.ALREADY


# ----------------------------------------------------------------------- draining and admission


def test_sleep_drains_in_flight_requests_first() -> None:
    h = reach_stage(S.RUNNING)
    stage_inputs.request_started(h.stage, h.now)
    stage_inputs.request_started(h.stage, h.now)
    step = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    assert step == StageStep() and h.stage.state is S.DRAINING
    with pytest.raises(StageCommandError, match="admits no request in DRAINING"):
        stage_inputs.request_started(h.stage, h.now)
    assert stage_inputs.request_finished(h.stage, h.now).sends == ()
    step = stage_inputs.request_finished(h.stage, h.now)  # the last one: now the Sleeps go out
    assert h.stage.state is S.TRANSITIONING and len(step.sends) == 3
    assert outcome_of(h.complete(step)).state is S.SLEEPING


def test_drain_timeout_goes_back_to_running_with_a_failed_outcome() -> None:
    h = reach_stage(S.RUNNING)
    stage_inputs.request_started(h.stage, h.now)
    stage_inputs.sleep(h.stage, "s", 1, None, 0.0, 5.0)
    assert stage_inputs.on_tick(h.stage, 4.9) == StageStep()
    step = stage_inputs.on_tick(h.stage, 5.0)
    outcome = outcome_of(step)
    assert step.sends == () and h.stage.state is S.RUNNING and h.stage.admits()
    assert not outcome.ok and outcome.state is S.RUNNING and "did not finish" in outcome.error
    assert h.stage.in_flight_requests == 1
    assert all(w.state is W.ACTIVE for w in h.workers)  # nothing was sent
    assert stage_inputs.request_finished(h.stage, 6.0).sends == ()
    assert stage_inputs.sleep(h.stage, "s", 1, None, 7.0, 5.0).outcome is outcome  # recorded, not retried


def test_a_result_for_a_request_nobody_started_is_counted_late() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.on_reply(h.stage, Result(task_id="nobody", epoch=0, rank=0), h.now)
    assert step == StageStep() and h.stage.state is S.RUNNING and h.stage.counters.late_results == 1


# ----------------------------------------------------------------------- failures (P-9)


def test_nack_fails_the_stage_naming_the_rank() -> None:
    h = StageHarness(3, capabilities=(Capability.PARTIAL_WAKE,))  # no level-2 support
    step = stage_inputs.sleep(h.stage, "s", 2, None, h.now, 5.0)
    replies = h.to_workers(step)
    assert all(isinstance(r, Nack) and r.reason is NackReason.UNSUPPORTED for r in replies)
    outcome = outcome_of(stage_inputs.on_reply(h.stage, replies[1], h.now))
    assert h.stage.state is S.FAILED and not outcome.ok and outcome.state is S.FAILED
    assert set(outcome.failures) == {1} and "NACK UNSUPPORTED" in outcome.failures[1]
    assert "rank 1" in h.stage.failure and "level2" in h.stage.failure
    # The other NACKs arrive after the task ended: counted, not applied.
    assert stage_inputs.on_reply(h.stage, replies[0], h.now) == StageStep()
    assert h.stage.counters.unknown_replies_ignored == 1


def test_deadline_fails_naming_exactly_the_silent_ranks() -> None:
    h = reach_stage(S.RUNNING, ranks=4)
    step = stage_inputs.sleep(h.stage, "s", 1, None, 0.0, 5.0)
    h.feed(h.to_workers(step, ranks={0, 2}))
    assert stage_inputs.on_tick(h.stage, 4.999) == StageStep()
    outcome = outcome_of(stage_inputs.on_tick(h.stage, 5.0))
    assert h.stage.state is S.FAILED
    assert set(outcome.failures) == {1, 3} == set(h.stage.failed_ranks)
    assert sorted(outcome.acks) == [0, 2]
    for rank in (1, 3):
        assert f"rank {rank}: no reply to Sleep within 5 s" in outcome.error
    assert "rank 0" not in outcome.error and "rank 2" not in outcome.error


def test_deadline_while_waking() -> None:
    h = reach_stage(S.WAKING)
    outcome = outcome_of(stage_inputs.on_tick(h.stage, h.now + 5.0))
    assert h.stage.state is S.FAILED and set(outcome.failures) == {0, 1, 2}
    assert "no reply to Wake" in outcome.error


@pytest.mark.parametrize(
    "state", [S.RUNNING, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD, S.DRAINING, S.TRANSITIONING, S.WAKING]
)
def test_rank_death_fails_the_stage(state: StageState) -> None:
    h = reach_stage(state)
    step = stage_inputs.on_rank_died(h.stage, 2, "SIGKILL (exit -9)", h.now)
    assert h.stage.state is S.FAILED and set(h.stage.failed_ranks) == {2}
    assert "rank 2: process died: SIGKILL (exit -9)" in h.stage.failure
    assert (step.outcome is not None) == (state in (S.DRAINING, S.TRANSITIONING, S.WAKING))
    assert not h.stage.admits() and h.stage.in_flight_requests == 0
    # Dead already: a second death report changes nothing.
    assert stage_inputs.on_rank_died(h.stage, 1, "again", h.now) == StageStep() and set(h.stage.failed_ranks) == {2}


# ----------------------------------------------------------------------- epochs and restarts (P-6)


@pytest.mark.parametrize("state", [S.RUNNING, S.PAUSED, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD, S.FAILED, S.STOPPED])
def test_restart_bumps_the_epoch_and_starts_fresh(state: StageState) -> None:
    h = reach_stage(state)
    assert h.restart() == 1
    assert h.stage.state is S.RUNNING and h.stage.epoch == 1
    assert h.stage.residency.asleep == frozenset() and h.stage.failure == ""
    assert outcome_of(h.complete(stage_inputs.sleep(h.stage, "after", 1, None, h.now, 5.0))).ok


def test_replies_from_the_old_epoch_are_ignored_after_a_restart() -> None:
    h = reach_stage(S.RUNNING)
    old = h.to_workers(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0))
    stage_inputs.on_tick(h.stage, 10.0)  # deadline: FAILED
    h.restart()
    step = stage_inputs.sleep(h.stage, "s-new", 1, None, h.now, 5.0)
    for reply in old + [msgspec.structs.replace(old[0], task_id="s-new")]:
        assert stage_inputs.on_reply(h.stage, reply, h.now) == StageStep()
        assert h.stage.state is S.TRANSITIONING
    assert h.stage.counters.stale_replies_ignored == 4
    # And an old-epoch command reaching a new worker is refused by the worker.
    (nack,) = h.workers[0].step(CommandReceived(Sleep(task_id="s", epoch=0))).replies
    assert nack.reason is NackReason.STALE_EPOCH
    assert outcome_of(h.complete(step)).ok


def test_unknown_duplicate_and_foreign_replies_are_counted_not_applied() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    replies = h.to_workers(step)
    c = h.stage.counters
    ignored = [
        msgspec.structs.replace(replies[0], task_id="ghost"),  # another task
        msgspec.structs.replace(replies[0], rank=9),  # not a rank of this stage
        Result(task_id="s", epoch=0, rank=0),  # not an answer to a lifecycle command: a late result
    ]
    for reply in ignored:
        assert stage_inputs.on_reply(h.stage, reply, h.now) == StageStep() and h.stage.state is S.TRANSITIONING
    assert c.unknown_replies_ignored == 2 and c.late_results == 1
    stage_inputs.on_reply(h.stage, replies[0], h.now)
    stage_inputs.on_reply(h.stage, replies[0], h.now)
    assert c.duplicate_replies_ignored == 1 and h.stage.state is S.TRANSITIONING
    # A NACK from a rank that already ACKed is a duplicate too, not a failure.
    nack = Nack(task_id="s", epoch=0, rank=0, command="Sleep", reason=NackReason.BUSY, state=W.ACTIVE)
    assert stage_inputs.on_reply(h.stage, nack, h.now) == StageStep() and c.duplicate_replies_ignored == 2
    h.feed(replies[1:])
    assert h.stage.state is S.SLEEPING
    assert stage_inputs.on_reply(h.stage, replies[1], h.now) == StageStep() and c.unknown_replies_ignored == 3


def test_replies_while_draining_are_unknown() -> None:
    h = reach_stage(S.DRAINING)
    ack = Ack(task_id="drain", epoch=0, rank=0, command="Sleep", state=W.SLEEPING, asleep_tags=("kv_cache", "weights"))
    assert stage_inputs.on_reply(h.stage, ack, h.now) == StageStep() and h.stage.state is S.DRAINING
    assert h.stage.counters.unknown_replies_ignored == 1


# ----------------------------------------------------------------------- retries and task_ids


def test_retry_in_flight_resends_only_to_silent_ranks() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    h.feed(h.to_workers(step, ranks={1}))
    retry = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    assert sorted(o.rank for o in retry.sends) == [0, 2] and retry.outcome is None
    assert all(o.command == step.sends[0].command for o in retry.sends)
    assert h.stage.counters.retries == 1
    # The worker that already did it answers from its cache; one that had not, does it now.
    outcome = outcome_of(h.feed(h.to_workers(step, ranks={1}) + h.to_workers(retry)))
    assert outcome.ok and h.stage.state is S.SLEEPING
    assert h.workers[1].counters.duplicates_answered_from_cache == 1


def test_retry_after_the_end_returns_the_recorded_outcome() -> None:
    h = reach_stage(S.RUNNING)
    first = outcome_of(h.complete(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)))
    h.complete(stage_inputs.wake(h.stage, "w", None, h.now, 5.0))
    again = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    assert again.sends == () and again.outcome is first and h.stage.state is S.RUNNING
    # Also a failed task: its failure is what a retry gets (no silent second attempt).
    stage_inputs.on_rank_died(h.stage, 0, "gone", h.now)
    h.restart()
    stage_inputs.on_tick(h.stage, 0.0)
    step = stage_inputs.sleep(h.stage, "s2", 1, None, 0.0, 1.0)
    failed = outcome_of(stage_inputs.on_tick(h.stage, 1.0))
    assert not failed.ok
    h.restart()
    assert stage_inputs.sleep(h.stage, "s2", 1, None, 0.0, 1.0).outcome is failed
    assert step.sends


def test_retry_while_draining_sends_nothing() -> None:
    h = reach_stage(S.DRAINING)
    assert stage_inputs.sleep(h.stage, "drain", 1, None, h.now, 5.0) == StageStep()
    assert h.stage.counters.retries == 1


def test_retry_that_spells_the_same_tags_differently_is_the_same_task() -> None:
    h = reach_stage(S.RUNNING)
    stage_inputs.sleep(h.stage, "s", 1, ("weights", "kv_cache"), h.now, 5.0)
    assert len(stage_inputs.sleep(h.stage, "s", 1, ("kv_cache", "weights", "kv_cache"), h.now, 5.0).sends) == 3


@pytest.mark.parametrize("finished", [False, True])
def test_different_command_with_the_same_task_id_raises(finished: bool) -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    if finished:
        h.complete(step)
    state = h.stage.state
    for call in (
        lambda: stage_inputs.sleep(h.stage, "s", 2, None, h.now, 5.0),
        lambda: stage_inputs.sleep(h.stage, "s", 1, ("weights",), h.now, 5.0),
        lambda: stage_inputs.wake(h.stage, "s", None, h.now, 5.0),
        lambda: stage_inputs.reload(h.stage, "s", None, h.now, 5.0),
    ):
        with pytest.raises(StageCommandError, match="task_id 's' was used for") as info:
            call()
        assert not isinstance(info.value, StageBusyError)
        assert h.stage.state is state


def test_another_task_while_one_is_in_flight_is_busy() -> None:
    for state in (S.DRAINING, S.TRANSITIONING, S.WAKING):
        h = reach_stage(state)
        with pytest.raises(StageBusyError, match=f"in flight \\({state.value}\\)"):
            stage_inputs.wake(h.stage, "other", None, h.now, 5.0)
        assert h.stage.state is state


# ----------------------------------------------------------------------- refusals (P-11)

CALLS: dict[str, tuple[tuple[str, ...], Callable]] = {
    "sleep": (
        ("drain", "sleep", "sleep_already"),
        lambda h: stage_inputs.sleep(h.stage, "x-sleep", 1, None, h.now, 5.0),
    ),
    "sleep-level2": (
        ("drain", "sleep", "sleep_already"),
        lambda h: stage_inputs.sleep(h.stage, "x-sleep2", 2, ("kv_cache",), h.now, 5.0),
    ),
    "wake": (("wake", "wake_already"), lambda h: stage_inputs.wake(h.stage, "x-wake", None, h.now, 5.0)),
    "reload": (("reload",), lambda h: stage_inputs.reload(h.stage, "x-reload", None, h.now, 5.0)),
    "request": (("execute",), lambda h: stage_inputs.request_started(h.stage, h.now)),
    "restart": (("restart",), lambda h: stage_inputs.restart(h.stage, h.now, 5.0)),
    "profile": (("profile",), lambda h: stage_inputs.profile(h.stage, "x-profile", True, None, h.now, 5.0)),
    "pause": (("pause_drain", "pause_already"), lambda h: stage_inputs.pause(h.stage, "x-pause", "wait", h.now, 5.0)),
    "resume": (("resume", "resume_already"), lambda h: stage_inputs.resume(h.stage, "x-resume", h.now)),
}


def _legal(triggers: tuple[str, ...]) -> set[StageState]:
    return {s for t in STAGE_TRANSITIONS if t.trigger in triggers for s in t.sources}


REFUSED = [(s, name) for name, (triggers, _) in CALLS.items() for s in S if s not in _legal(triggers)]


def _stage_snapshot(h: StageHarness) -> tuple:
    st = h.stage
    return (
        st.state,
        st.epoch,
        st.task_id,
        st.residency.asleep,
        st.residency.weights_valid,
        st.in_flight_requests,
        dict(st.rank_state),
        st.failure,
        dataclasses.asdict(st.counters),
        [w.state for w in h.workers],
    )


@pytest.mark.parametrize(("state", "call"), REFUSED, ids=[f"{c}-in-{s.value}" for s, c in REFUSED])
def test_forbidden_call_raises_naming_the_state_and_changes_nothing(state: StageState, call: str) -> None:
    h = reach_stage(state)
    before = _stage_snapshot(h)
    with pytest.raises(StageCommandError) as info:
        CALLS[call][1](h)
    assert state.value in str(info.value)
    assert _stage_snapshot(h) == before


def test_bad_arguments_raise_before_anything_is_sent() -> None:
    h = reach_stage(S.RUNNING)
    with pytest.raises(StageCommandError, match="level must be 1 or 2"):
        stage_inputs.sleep(h.stage, "s", 3, None, h.now, 5.0)
    with pytest.raises(StageCommandError, match="unknown tag"):
        stage_inputs.sleep(h.stage, "s", 1, ("lora",), h.now, 5.0)
    with pytest.raises(StageCommandError, match="non-empty"):
        stage_inputs.wake(h.stage, "s", (), h.now, 5.0)
    assert h.stage.state is S.RUNNING and h.stage.task_id is None


# ----------------------------------------------------------------------- stop


@pytest.mark.parametrize("state", [s for s in S if s is not S.STOPPED])
def test_stop_from_every_state(state: StageState) -> None:
    h = reach_stage(state)
    step = stage_inputs.stop(h.stage, h.now)
    assert h.stage.state is S.STOPPED and not h.stage.admits()
    if state in (S.DRAINING, S.TRANSITIONING, S.WAKING):
        outcome = outcome_of(step)
        assert not outcome.ok and "stopped" in outcome.error
        assert outcome.state is S.STOPPED  # where the task ended, not a transient state
    else:
        assert step.outcome is None
    assert stage_inputs.stop(h.stage, h.now) == StageStep()


# ----------------------------------------------------------------------- transition coverage


def _fail_from_each_state() -> None:
    stage_inputs.on_tick(reach_stage(S.STARTING).stage, 100.0)
    for state in (S.RUNNING, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD, S.DRAINING):
        stage_inputs.on_rank_died(reach_stage(state).stage, 0, "x", 0.0)
    test_nack_fails_the_stage_naming_the_rank()  # TRANSITIONING
    test_deadline_while_waking()  # WAKING


SCENARIOS: list[Callable[[], object]] = [
    test_reload_refused_by_every_rank_returns_to_needs_reload,
    test_wake_refused_for_memory_by_every_rank_returns_to_where_it_started,
    test_start_commits_running_only_after_every_hello,
    test_sleep_commits_only_on_the_last_ack,
    test_wake_to_running_partial_and_needs_reload_then_reload,
    test_sleep_and_wake_from_partial_and_needs_reload,
    test_sleep_more_tags_while_sleeping,
    test_wake_the_rest_while_needs_reload,
    test_sleep_of_asleep_tags_and_wake_of_resident_tags_are_already,
    test_wake_of_resident_tags_while_sleeping,
    test_sleep_drains_in_flight_requests_first,
    test_drain_timeout_goes_back_to_running_with_a_failed_outcome,
    _fail_from_each_state,
    *[
        lambda s=s: test_restart_bumps_the_epoch_and_starts_fresh(s)
        for s in (S.RUNNING, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD, S.FAILED, S.STOPPED)
    ],
    *[lambda s=s: test_stop_from_every_state(s) for s in S if s is not S.STOPPED],
    *TRANSFER_STAGE_SCENARIOS,
]


# ----------------------------------------------------------------------- Profile (P-15)

SETTLED = (S.RUNNING, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)


@pytest.mark.parametrize("state", SETTLED)
def test_profile_start_and_stop_never_change_the_stage(state: StageState) -> None:
    h = reach_stage(state)
    before = _stage_snapshot(h)
    step = stage_inputs.profile(h.stage, "p-on", True, "wake", h.now, 5.0)
    assert [o.rank for o in step.sends] == [0, 1, 2] and h.stage.task_id == "p-on"
    assert {o.command for o in step.sends} == {Profile(task_id="p-on", epoch=0, start=True, prefix="wake")}
    on = outcome_of(h.complete(step))
    assert (on.ok, on.command, on.state, on.status) == (True, "Profile", state, AckStatus.OK)
    off = outcome_of(h.complete(stage_inputs.profile(h.stage, "p-off", False, None, h.now, 5.0)))
    assert off.ok and off.state is state
    assert {r: a.trace_paths for r, a in off.acks.items()} == {
        r: (f"/profiles/talker-rank{r}-t0.json.gz",) for r in range(3)
    }
    after = _stage_snapshot(h)
    assert after[:8] == before[:8] and after[9] == before[9]  # counters aside, nothing moved


SCENARIOS.extend(lambda s=s: test_profile_start_and_stop_never_change_the_stage(s) for s in SETTLED)


def test_profile_refusals_are_the_outcome_not_a_failure() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.profile(h.stage, "p", True, None, h.now, 5.0)
    replies = h.to_workers(step, ranks={0, 2})
    busy = Nack(
        task_id="p",
        epoch=0,
        rank=1,
        command="Profile",
        reason=NackReason.BUSY,
        detail="task 'q' is in progress; retry after its reply",
        state=W.ACTIVE,
    )
    outcome = outcome_of(h.feed([*replies, busy]))
    assert not outcome.ok and outcome.refused and outcome.state is S.RUNNING
    assert dict(outcome.refusals) == {1: "NACK BUSY: task 'q' is in progress; retry after its reply"}
    assert sorted(outcome.acks) == [0, 2] and "ranks [0, 2] did it" in outcome.error
    assert h.stage.state is S.RUNNING and h.stage.task_id is None and not h.stage.failure
    # An old worker that does not know Profile (BAD_MESSAGE) is a refusal too; the stage serves on.
    step = stage_inputs.profile(h.stage, "p2", False, None, h.now, 5.0)
    old = [
        Nack(
            task_id="p2",
            epoch=0,
            rank=r,
            command="?",
            reason=NackReason.BAD_MESSAGE,
            detail="unknown type 'Profile'",
            state=W.ACTIVE,
        )
        for r in range(3)
    ]
    assert outcome_of(h.feed(old)).refused and h.stage.admits()


def test_a_profile_reply_in_another_state_fails_the_stage_naming_the_rank() -> None:
    h = reach_stage(S.SLEEPING)
    stage_inputs.profile(h.stage, "p", True, None, h.now, 5.0)
    failed = Nack(
        task_id="p",
        epoch=0,
        rank=2,
        command="Profile",
        reason=NackReason.FAILED,
        detail="worker is FAILED (x)",
        state=W.FAILED,
    )
    outcome = outcome_of(h.feed([failed]))
    assert outcome.state is S.FAILED and list(outcome.failures) == [2]
    assert "answered Profile in FAILED" in outcome.failures[2]


def test_a_profile_in_flight_holds_lifecycle_calls_but_not_requests() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.profile(h.stage, "p", True, None, h.now, 5.0)
    with pytest.raises(StageBusyError, match="task 'p' is in flight"):
        stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    with pytest.raises(StageCommandError, match="a task is in flight"):
        stage_inputs.restart(h.stage, h.now, 5.0)
    assert h.stage.admits()
    stage_inputs.request_started(h.stage, h.now)
    assert outcome_of(h.complete(step)).ok and h.stage.in_flight_requests == 1
    with pytest.raises(StageCommandError, match="used for"):
        stage_inputs.profile(h.stage, "p", False, None, h.now, 5.0)  # one task id, one command


@pytest.mark.parametrize(
    ("start", "prefix", "match"),
    [
        (True, "a/b", "characters"),
        (True, "..", r"contains '\.\.'"),
        (True, "", "empty"),
        (True, "x" * 65, "65 characters"),
        (1, None, "True or False"),
    ],
)
def test_profile_bad_arguments_raise_before_anything_is_sent(start: object, prefix: str, match: str) -> None:
    h = reach_stage(S.RUNNING)
    with pytest.raises(StageCommandError, match=match):
        stage_inputs.profile(h.stage, "p", start, prefix, h.now, 5.0)  # type: ignore[arg-type]
    assert h.stage.task_id is None


def _weights_update_scenario() -> None:
    """The P-17 rows (update, its refusals and failure, weight groups): tests/testdata/weights_update.txt."""
    from omni_testing.scenario import parse_blocks, run_blocks

    run_blocks(parse_blocks((Path(__file__).parent / "testdata" / "weights_update.txt").read_text())[0])


SCENARIOS.append(_weights_update_scenario)


def _host_refit_scenario() -> None:
    """The refit-into-a-sleeping-stage rows (host_refit): tests/testdata/host_refit.txt."""
    from omni_testing.scenario import parse_blocks, run_blocks

    run_blocks(parse_blocks((Path(__file__).parent / "testdata" / "host_refit.txt").read_text())[0])


SCENARIOS.append(_host_refit_scenario)


def _save_scenarios() -> None:
    # SaveWeights' cases live in test_save_weights_core.py (which imports this module's helpers).
    import test_save_weights_core as save_cases

    for state in (S.RUNNING, S.PAUSED, S.PARTIAL):
        save_cases.test_a_stage_saves_wherever_valid_weights_are_awake_and_keeps_its_state(state)


SCENARIOS.append(_save_scenarios)


def _restart_versions_scenario() -> None:
    """A restart back at a disk update's version, NEEDS_RELOAD under a floor after a memory
    one, and from the checkpoint: tests/testdata/restart_versions.txt."""
    from omni_testing.scenario import parse_blocks, run_blocks

    run_blocks(parse_blocks((Path(__file__).parent / "testdata" / "restart_versions.txt").read_text())[0])


SCENARIOS.append(_restart_versions_scenario)


def _pause_scenario() -> None:
    """The PAUSED rows (tests/test_pause_core.py checks what each does)."""
    h = reach_stage(S.RUNNING)
    st = h.stage
    stage_inputs.request_started(st, h.now)
    stage_inputs.pause(st, "p1", "wait", h.now, 5.0)  # pause_drain: a request is in flight
    assert st.state is S.DRAINING
    stage_inputs.request_finished(st, h.now)  # pause_drained
    assert outcome_of(stage_inputs.pause(st, "p2", "abort", h.now, 5.0)).status is AckStatus.ALREADY  # pause_already
    assert outcome_of(stage_inputs.wake(st, "w", None, h.now, 5.0)).status is AckStatus.ALREADY  # wake_already
    assert outcome_of(h.complete(stage_inputs.profile(st, "pr", True, None, h.now, 5.0))).state is S.PAUSED
    call = I.WeightGroupCall("g", "trainer", "127.0.0.1", 29500, 4, 1, "gloo", 5.0)
    assert outcome_of(h.complete(stage_inputs.init_weight_group(st, call, h.now))).state is S.PAUSED
    assert outcome_of(stage_inputs.resume(st, "u1", h.now)).state is S.RUNNING  # resume
    assert outcome_of(stage_inputs.resume(st, "u2", h.now)).status is AckStatus.ALREADY  # resume_already
    stage_inputs.pause(st, "p3", "keep", h.now, 5.0)
    h.complete(stage_inputs.sleep(st, "s", 1, None, h.now, 5.0))  # sleep from PAUSED: no drain
    assert st.state is S.SLEEPING and st.paused
    assert outcome_of(h.complete(stage_inputs.wake(st, "w1", None, h.now, 5.0))).state is S.PAUSED  # woke_paused
    for tags, asleep in ((("weights",), S.PARTIAL), (None, S.SLEEPING)):
        h.complete(stage_inputs.sleep(st, f"s-{asleep.value}", 1, None, h.now, 5.0))
        if tags:
            h.complete(stage_inputs.wake(st, "w2", tags, h.now, 5.0))
        assert st.state is asleep and st.paused
        assert outcome_of(stage_inputs.resume(st, f"u-{asleep.value}", h.now)).state is asleep  # resume_asleep
        h.complete(stage_inputs.wake(st, f"w-{asleep.value}", None, h.now, 5.0))
        assert st.state is S.RUNNING
        stage_inputs.pause(st, f"p-{asleep.value}", "wait", h.now, 5.0)
    h.complete(stage_inputs.sleep(st, "s2", 2, None, h.now, 5.0))
    h.complete(stage_inputs.wake(st, "w3", None, h.now, 5.0))
    assert st.state is S.NEEDS_RELOAD and outcome_of(stage_inputs.resume(st, "u3", h.now)).state is S.NEEDS_RELOAD
    paused = reach_stage(S.PAUSED)
    stage_inputs.on_rank_died(paused.stage, 0, "x", 0.0)  # fail
    test_restart_bumps_the_epoch_and_starts_fresh(S.PAUSED)


SCENARIOS.append(_pause_scenario)
SCENARIOS.append(test_a_paused_stage_takes_a_weight_update_and_stays_paused)


@pytest.mark.parametrize("state", (S.RUNNING, S.PAUSED, S.PARTIAL))
def test_reset_prefix_cache_goes_to_every_rank_and_keeps_the_state(state: StageState) -> None:
    h = reach_stage(state)
    asleep = h.stage.residency.asleep
    step = h.stage.step(I.CommandCall(ResetPrefixCache(task_id="r", epoch=0), 5.0), h.now)
    assert [o.rank for o in step.sends] == [0, 1, 2]
    outcome = outcome_of(h.complete(step))
    assert (outcome.ok, outcome.command, outcome.state) == (True, "ResetPrefixCache", state)
    assert h.stage.state is state and h.stage.residency.asleep == asleep


SCENARIOS += [
    lambda s=s: test_reset_prefix_cache_goes_to_every_rank_and_keeps_the_state(s)
    for s in (S.RUNNING, S.PAUSED, S.PARTIAL)
]


def _adapter_scenarios() -> None:
    from test_stage_adapters import STAGE_ADAPTER_SCENARIOS  # P-20; it imports this module's helpers

    for scenario in STAGE_ADAPTER_SCENARIOS:
        scenario()


SCENARIOS.append(_adapter_scenarios)


def test_every_stage_transition_is_exercised() -> None:
    with record_transitions() as fired:
        for scenario in SCENARIOS:
            scenario()
    fired = {f for f in fired if f[0] == "stage"}
    table = table_pairs("stage")
    assert fired <= table, f"fired outside the table: {sorted(fired - table)}"
    assert not table - fired, f"no scenario exercises {sorted(table - fired)}"


# ----------------------------------------------------------------------- golden walkthrough


def test_walkthrough_matches_the_golden_output() -> None:
    """etcd-raft style: the scripted walk's full output is committed; a change in behaviour
    shows up as a diff. OMNI_UPDATE_GOLDEN=1 rewrites the file."""
    out = io.StringIO()
    assert Walkthrough(out=out).run() == 0, out.getvalue()
    text = out.getvalue()
    again = io.StringIO()
    Walkthrough(out=again).run()
    assert again.getvalue() == text, "the walkthrough is not deterministic"
    if os.environ.get("OMNI_UPDATE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), f"{GOLDEN} is missing: run with OMNI_UPDATE_GOLDEN=1"
    golden = GOLDEN.read_text()
    if text != golden:
        import difflib

        diff = "".join(
            difflib.unified_diff(
                golden.splitlines(True), text.splitlines(True), "golden/walkthrough.txt", "walkthrough now"
            )
        )
        raise AssertionError(f"walkthrough output changed (OMNI_UPDATE_GOLDEN=1 to accept):\n{diff}")
