"""The cores' trace records: one record per action, in program order, with the fields the
trace spec compares (and the deadlines and failed ranks later per-process checks need)."""

from __future__ import annotations

from omni_core.fsm import StageCore, WorkerCore
from omni_core.fsm import inputs as I
from omni_core.fsm import trace_records as T
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.worker import BadFrame, CommandReceived, EffectCompleted, EffectDeclined, EffectRaised, Loaded
from omni_core.protocol import (
    Capability,
    DiskSource,
    Hello,
    MemoryReport,
    ProtocolError,
    ReloadWeights,
    Sleep,
    WorkerState,
)

REPORT = MemoryReport(pool_bytes_before={}, pool_bytes_after={})
WEIGHT_UPDATE = Capability.WEIGHT_UPDATE


def kinds(records) -> list[str]:
    return [type(r).__name__ for r in records]


def started(ranks: int = 2, **kwargs) -> tuple[StageCore, list[WorkerCore]]:
    stage = StageCore("s", ranks, **kwargs)
    workers = [WorkerCore(r) for r in range(ranks)]
    assert kinds(stage.step(I.Start(deadline_s=30.0), now=0.0).records) == ["StageStarting"]
    for w in workers:
        w.step(Loaded())
        hello = Hello(task_id="hello", epoch=0, rank=w.rank, pid=1, device="cpu", backend="b", tags=w.tags)
        step = stage.step(I.Received(hello), now=1.0)
    assert kinds(step.records) == ["StageReceived", "StageChanged"]
    assert (step.records[1].before, step.records[1].after) == ("STARTING", "RUNNING")
    return stage, workers


def answer(stage: StageCore, workers: list[WorkerCore], sends, now: float):
    """Every rank performs its command at once; returns the stage's steps for the replies."""
    steps = []
    for out in sends:
        w = workers[out.rank]
        step = w.step(CommandReceived(out.command))
        done = w.step(EffectCompleted(out.command.task_id, memory=REPORT))
        steps += [stage.step(I.Received(reply), now) for reply in step.replies + done.replies]
    return steps


def test_a_sleep_is_issued_sent_received_and_committed_in_that_order() -> None:
    stage, workers = started()
    step = stage.step(I.SleepCall("t1", level=1, tags=None, deadline_s=5.0), now=2.0)
    issued, *sent = step.records[:3]
    assert kinds(step.records) == ["StageIssued", "StageSent", "StageSent"]
    assert (issued.command, issued.level, issued.tags, issued.before, issued.after) == (
        "Sleep",
        1,
        None,
        "RUNNING",
        "TRANSITIONING",
    )
    assert issued.deadline_at_s == 7.0 and not issued.already and not issued.auto
    assert [(s.rank, s.command, s.task_id, s.state) for s in sent] == [
        (0, "Sleep", "t1", "TRANSITIONING"),
        (1, "Sleep", "t1", "TRANSITIONING"),
    ]
    first, last = answer(stage, workers, step.sends, now=3.0)
    assert kinds(first.records) == ["StageReceived"] and first.records[0].info == "OK"
    assert kinds(last.records) == ["StageReceived", "StageChanged", "TaskEnded"]
    assert (last.records[1].before, last.records[1].after) == ("TRANSITIONING", "SLEEPING")
    again = stage.step(I.SleepCall("t2", level=1, tags=None, deadline_s=5.0), now=4.0)
    assert kinds(again.records) == ["StageIssued", "TaskEnded"] and again.records[0].already


def test_an_update_is_issued_and_sent_with_the_version_it_installs_and_a_sleep_with_none() -> None:
    """StageIssued.version and StageSent.version: the weights version the command installs
    (Command.installs_version), which the trace spec compares with the ranks' ACKs (P-17)."""
    stage = StageCore("s", 2)
    stage.step(I.Start(deadline_s=30.0), now=0.0)
    for rank in range(2):
        hello = Hello(
            task_id="hello",
            epoch=0,
            rank=rank,
            pid=1,
            device="cpu",
            backend="b",
            tags=stage.tags,
            capabilities=(WEIGHT_UPDATE,),
        )
        stage.step(I.Received(hello), now=1.0)
    step = stage.step(I.UpdateCall("u1", 3, DiskSource(path="/ckpt"), 10.0), now=2.0)
    assert kinds(step.records) == ["StageIssued", "StageSent", "StageSent"]
    assert [(r.command, r.version) for r in step.records] == [("UpdateWeights", 3)] * 3
    other, _ = started()
    assert all(r.version == 0 for r in other.step(I.SleepCall("t", 1, None, 5.0), now=2.0).records)


def test_a_deadline_names_the_silent_ranks_and_when_it_passed() -> None:
    stage, _ = started()
    stage.step(I.WakeCall("w0", tags=None, deadline_s=1.0), now=2.0)  # ALREADY
    stage.step(I.SleepCall("t1", level=2, tags=("kv_cache",), deadline_s=5.0), now=2.0)
    assert kinds(stage.step(I.Tick(), now=6.9).records) == []
    step = stage.step(I.Tick(), now=7.5)
    deadline = step.records[0]
    assert kinds(step.records) == ["StageDeadline", "TaskEnded"]
    assert (deadline.before, deadline.after, deadline.deadline_at_s, deadline.now_s) == (
        "TRANSITIONING",
        "FAILED",
        7.0,
        7.5,
    )
    assert sorted(deadline.failed_ranks) == [0, 1] and "within 5 s" in deadline.failed_ranks[0]
    restart = stage.step(I.Restart(deadline_s=10.0), now=8.0)
    assert kinds(restart.records) == ["StageRestarted"]
    record = restart.records[0]
    assert (record.epoch, record.after, record.deadline_at_s) == (1, "STARTING", 18.0)


def test_a_dead_rank_is_recorded_before_the_failure_it_causes_and_old_epochs_are_marked_fenced() -> None:
    stage, _ = started()
    step = stage.step(I.RankExited(1, "exit 9", epoch=0), now=2.0)
    assert kinds(step.records) == ["RankDied", "StageChanged"]
    assert step.records[1].failed_ranks == {1: "process died: exit 9"}
    stale = stage.step(I.RankExited(0, "exit 9", epoch=7), now=2.0)
    assert kinds(stale.records) == ["RankDied"] and stale.records[0].fenced


def test_a_commit_and_the_wake_it_lets_admission_start_are_two_records() -> None:
    """Admission 'wake': a request queued while asleep starts a wake right at the commit of
    the sleep, in the same step; the trace spec sees a receipt, a change and an issue."""
    stage, workers = started(policy=AdmissionPolicy.WAKE)
    step = stage.step(I.SleepCall("t1", level=1, tags=None, deadline_s=5.0), now=2.0)
    submitted = stage.step(I.Submit("r1", {"x": 1}, timeout_s=30.0), now=2.1)
    assert kinds(submitted.records) == ["RequestSubmitted"] and submitted.records[0].admission == "queue"
    *_, last = answer(stage, workers, step.sends, now=3.0)
    assert kinds(last.records) == [
        "StageReceived",
        "StageChanged",
        "StageIssued",
        "StageSent",
        "StageSent",
        "TaskEnded",
    ]
    issued = last.records[2]
    assert (issued.command, issued.before, issued.after, issued.auto) == ("Wake", "SLEEPING", "WAKING", True)
    *_, woke = answer(stage, workers, last.sends, now=4.0)
    assert kinds(woke.records) == [
        "StageReceived",
        "StageChanged",
        "StageDispatched",
        "StageSent",
        "StageSent",
        "TaskEnded",
    ]
    assert (woke.records[2].request_id, woke.records[2].deadline_at_s) == ("r1", 32.1)


def test_worker_records_name_the_command_its_states_and_each_reply() -> None:
    w = WorkerCore(0)
    assert kinds(w.step(Loaded("fast")).records) == ["WorkerStarted", "ReplySent"]
    step = w.step(CommandReceived(Sleep(task_id="s", epoch=0, level=2)))
    assert kinds(step.records) == ["WorkerReceived", "WorkerChanged"]
    assert (step.records[0].command, step.records[0].state) == ("Sleep", "ACTIVE")
    done = w.step(EffectCompleted("s", memory=REPORT, duration_s=0.5, path="per-allocation"))
    assert kinds(done.records) == ["EffectDone", "WorkerChanged", "ReplySent"]
    assert (done.records[0].state, done.records[0].path, done.records[1].after) == (
        "SLEEPING",
        "per-allocation",
        "SLEEPING",
    )
    assert (done.records[2].reply, done.records[2].info, done.records[2].state) == ("ack", "OK", "SLEEPING")
    refused = w.step(CommandReceived(ReloadWeights(task_id="r", epoch=0)))
    assert kinds(refused.records) == ["WorkerReceived", "ReplySent"] and refused.records[1].info == "INVALID_STATE"
    bad = w.step(BadFrame(ProtocolError("not msgpack")))
    assert kinds(bad.records) == ["BadMessage", "ReplySent"] and bad.records[1].to_bad_bytes


def test_a_refused_reload_and_a_failed_effect_are_records_of_their_own() -> None:
    w = WorkerCore(0)
    w.step(Loaded())
    w.step(CommandReceived(ReloadWeights(task_id="r", epoch=0, source="nope")))
    refused = w.step(EffectDeclined("r", "no such checkpoint"))
    assert kinds(refused.records) == ["EffectRefused", "WorkerChanged", "ReplySent"]
    assert (refused.records[0].command, refused.records[1].before, refused.records[1].after) == (
        "ReloadWeights",
        "RELOADING",
        "ACTIVE",
    )
    w.step(CommandReceived(Sleep(task_id="s", epoch=0, level=1)))
    failed = w.step(EffectRaised("s", "x" * 1000))
    assert kinds(failed.records) == ["EffectFailed", "WorkerChanged", "ReplySent"]
    assert failed.records[1].after == WorkerState.FAILED.value
    assert len(failed.records[0].detail) == T.MAX_TRACE_DETAIL_CHARS  # clipped: a line stays small
