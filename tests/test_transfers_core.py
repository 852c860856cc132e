"""Stage-to-stage transfers (P-22) in the sans-IO cores: the worker's three generic calls, the
producer stage's holds (no sleep, no update while a transfer is in flight), the consumer's
version check, and one request's transfer core (where it lands by the consumer's admission,
one answer, the producer's buckets released at every end)."""

from __future__ import annotations

import pytest
import stage_inputs
from lifecycle_helpers import StageHarness, reach_worker

from omni_core.fsm import StageCommandError
from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.effects import CommandEffect
from omni_core.fsm.stage_step import StageBusyError
from omni_core.fsm.transfers import Land, TransferCore, TransferState, landing
from omni_core.fsm.worker_step import ALL_CAPABILITIES
from omni_core.protocol import (
    Ack,
    Bucket,
    Capability,
    DiskSource,
    Nack,
    NackReason,
    ShmSource,
    TensorSpec,
    TransferIn,
    TransferOut,
    TransferRelease,
    decode,
    encode,
)
from omni_core.protocol import StageState as S
from omni_core.protocol import WorkerState as W

CAPS = {"capabilities": (*ALL_CAPABILITIES, Capability.TRANSFER)}
SOURCE = ShmSource(
    buckets=(
        Bucket(
            handle="/dev/shm/omni-weights-1-00000000-1",
            nbytes=64,
            sender_pid=2,
            tensors=(TensorSpec(name="prompt_embeds", dtype="float32", shape=(2, 8)),),
        ),
    )
)


def reach_stage(state: S, **kwargs: object) -> StageHarness:
    """A stage of three ranks in RUNNING, PAUSED, SLEEPING, PARTIAL or NEEDS_RELOAD."""
    h = StageHarness(3, **kwargs)  # type: ignore[arg-type]
    if state is S.PAUSED:
        stage_inputs.pause(h.stage, "pause", "wait", h.now, 5.0)
    elif state is not S.RUNNING:
        h.complete(stage_inputs.sleep(h.stage, "sleep", 2 if state is S.NEEDS_RELOAD else 1, None, h.now, 5.0))
        if state is not S.SLEEPING:
            h.complete(stage_inputs.wake(h.stage, "wake", ("kv_cache",) if state is S.PARTIAL else None, h.now, 5.0))
    assert h.stage.state is state, (h.stage.state, state)
    return h


def outcome_of(step):  # type: ignore[no-untyped-def]
    assert step.outcome is not None, step
    return step.outcome


def _out(request_id: str = "r1", task_id: str = "out") -> TransferOut:
    return TransferOut(task_id=task_id, epoch=0, request_id=request_id, names=("prompt_embeds",), payload="a cat")


# ----------------------------------------------------------------------- the wire


def test_a_transfer_in_over_its_byte_bound_is_refused_on_decode() -> None:
    with pytest.raises(ValueError, match="over its max_bytes 32"):
        TransferIn(task_id="t", epoch=0, request_id="r", producer_version=0, source=SOURCE, max_bytes=32)
    fine = TransferIn(task_id="t", epoch=0, request_id="r", producer_version=3, source=SOURCE)
    assert decode(encode(fine)) == fine


# ----------------------------------------------------------------------- the worker


def test_transfer_out_runs_on_the_shell_and_its_ack_lists_the_buckets() -> None:
    d = reach_worker(W.ACTIVE, **CAPS)
    step = d.send(_out())
    assert isinstance(step.effect, CommandEffect) and step.effect.command == _out()
    from omni_core.fsm.worker import EffectCompleted

    (ack,) = d.w.step(EffectCompleted("out", shared=SOURCE)).replies
    assert isinstance(ack, Ack) and ack.shared == SOURCE and ack.state is W.ACTIVE
    # A copy is answered from the reply cache: nothing is exported twice (P-2).
    assert d.send(_out()).replies == (ack,) and d.send(_out()).effect is None


def test_transfer_out_and_in_are_refused_outside_active_release_is_not() -> None:
    d = reach_worker(W.SLEEPING, **CAPS)
    (nack,) = d.send(_out()).replies
    assert isinstance(nack, Nack) and nack.reason is NackReason.INVALID_STATE
    land = TransferIn(task_id="in", epoch=0, request_id="r1", producer_version=0, source=SOURCE)
    assert d.send(land).replies[0].reason is NackReason.INVALID_STATE  # type: ignore[union-attr]
    release = d.send(TransferRelease(task_id="rel", epoch=0, request_id="r1"))
    assert isinstance(release.effect, CommandEffect)


def test_a_worker_without_the_capability_refuses_transfers() -> None:
    d = reach_worker(W.ACTIVE, capabilities=(Capability.LEVEL2,))
    (nack,) = d.send(_out()).replies
    assert isinstance(nack, Nack) and nack.reason is NackReason.UNSUPPORTED and "transfer" in nack.detail


def test_a_failed_export_is_that_commands_refusal_and_the_rank_serves_on() -> None:
    from omni_core.fsm.worker import EffectRaised

    d = reach_worker(W.ACTIVE, **CAPS)
    d.send(_out())
    (nack,) = d.w.step(EffectRaised("out", "RunnerArgumentError: 'hidden' is not exported")).replies
    assert isinstance(nack, Nack) and nack.reason is NackReason.INVALID_ARGUMENT and d.w.state is W.ACTIVE


# ----------------------------------------------------------------------- the producer stage


def _hold(h, request_id: str = "r1") -> None:  # type: ignore[no-untyped-def]
    step = h.stage.step(I.CommandCall(_out(request_id, f"out-{request_id}"), 5.0), h.now)
    assert outcome_of(h.complete(step)).ok
    assert request_id in h.stage.transfers.held


def test_a_producer_holding_a_transfer_does_not_sleep_until_it_is_released() -> None:
    h = reach_stage(S.RUNNING, **CAPS)
    _hold(h)
    with pytest.raises(StageBusyError, match=r"cannot sleep: 1 transfer\(s\) in flight \(\['r1'\]\)"):
        stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0)
    assert h.stage.state is S.RUNNING
    release = h.stage.step(I.CommandCall(TransferRelease(task_id="rel", epoch=0, request_id="r1"), 5.0), h.now)
    assert outcome_of(h.complete(release)).ok and not h.stage.transfers.held
    h.complete(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0))
    assert h.stage.state is S.SLEEPING


def test_a_producer_holding_a_transfer_takes_no_update() -> None:
    h = reach_stage(S.RUNNING, **CAPS)
    _hold(h)
    with pytest.raises(StageBusyError, match="cannot update weights"):
        stage_inputs.update_weights(h.stage, "u", 1, DiskSource(path="/ckpt"), h.now, 5.0)
    assert h.stage.weights_version == 0


def test_a_restart_holds_nothing() -> None:
    h = reach_stage(S.RUNNING, **CAPS)
    _hold(h)
    h.restart()
    assert not h.stage.transfers.held


def test_a_stage_bounds_its_held_transfers() -> None:
    h = reach_stage(S.RUNNING, **CAPS)
    h.stage.transfers.max_held = 1
    _hold(h, "a")
    with pytest.raises(StageCommandError, match="holds 1 transfers already"):
        h.stage.step(I.CommandCall(_out("b", "out-b"), 5.0), h.now)


def test_a_consumer_refuses_a_transfer_of_another_producer_version_before_sending() -> None:
    h = reach_stage(S.RUNNING, **CAPS)
    land = TransferIn(task_id="in", epoch=0, request_id="r1", producer_version=4, expect_version=3, source=SOURCE)
    with pytest.raises(StageCommandError, match=r"declared for producer weights version 3.*carries version 4"):
        h.stage.step(I.CommandCall(land, 5.0), h.now)
    assert h.stage.task is None


def test_a_transfer_lands_only_on_a_running_consumer() -> None:
    h = reach_stage(S.SLEEPING, **CAPS)
    land = TransferIn(task_id="in", epoch=0, request_id="r1", producer_version=0, source=SOURCE)
    with pytest.raises(StageCommandError, match="cannot import a transfer in SLEEPING"):
        h.stage.step(I.CommandCall(land, 5.0), h.now)


# ----------------------------------------------------------------------- one request's transfer


@pytest.mark.parametrize(
    ("state", "policy", "land"),
    [
        (S.RUNNING, AdmissionPolicy.QUEUE, Land.LAND),
        (S.SLEEPING, AdmissionPolicy.QUEUE, Land.QUEUE),
        (S.SLEEPING, AdmissionPolicy.WAKE, Land.WAKE),
        (S.PARTIAL, AdmissionPolicy.WAKE, Land.WAKE),
        (S.PAUSED, AdmissionPolicy.WAKE, Land.QUEUE),
        (S.PAUSED, AdmissionPolicy.QUEUE, Land.QUEUE),
        (S.SLEEPING, AdmissionPolicy.REJECT, Land.REFUSE),
        (S.NEEDS_RELOAD, AdmissionPolicy.WAKE, Land.REFUSE),
        (S.FAILED, AdmissionPolicy.QUEUE, Land.REFUSE),
    ],
)
def test_a_transfer_is_admitted_by_the_consumers_admission(state: S, policy: AdmissionPolicy, land: Land) -> None:
    assert landing(state, policy)[0] is land


def _held(expect: int | None = None) -> TransferCore:
    core = TransferCore("r1", expect)
    core.offer()
    core.offered(2)
    return core


def test_a_transfer_into_a_sleeping_consumer_wakes_it_then_lands() -> None:
    core = _held()
    assert core.decide(S.SLEEPING, AdmissionPolicy.WAKE) is Land.WAKE and core.state is TransferState.WAKING
    core.woke()
    assert core.decide(S.RUNNING, AdmissionPolicy.WAKE) is Land.LAND
    core.landed()
    core.finished({"image": b"x"})
    assert core.answer is not None and core.answer.ok and core.answer.producer_version == 2
    assert core.release_due
    core.released()
    assert core.state is TransferState.DONE and core.answers == 1


def test_a_paused_consumer_queues_the_transfer_until_it_runs() -> None:
    core = _held()
    assert core.decide(S.PAUSED, AdmissionPolicy.WAKE) is Land.QUEUE
    assert core.decide(S.PAUSED, AdmissionPolicy.WAKE) is Land.QUEUE and core.state is TransferState.QUEUED
    assert core.decide(S.RUNNING, AdmissionPolicy.WAKE) is Land.LAND and core.state is TransferState.LANDING


def test_a_version_mismatch_is_refused_answered_once_and_released() -> None:
    core = _held(expect=1)
    assert (
        core.answer is not None
        and not core.answer.ok
        and "declared for producer weights version 1" in (core.answer.error)
    )
    assert core.release_due and core.answers == 1
    with pytest.raises(StageBusyError):
        core.decide(S.RUNNING, AdmissionPolicy.QUEUE)  # nothing lands after the refusal


def test_a_consumer_dying_mid_transfer_fails_the_request_once_and_releases() -> None:
    core = _held()
    core.decide(S.RUNNING, AdmissionPolicy.QUEUE)
    core.failed("stage 'dit' FAILED (rank 0: process died)")
    assert core.answers == 1 and core.release_due and not core.answer.ok  # type: ignore[union-attr]
    with pytest.raises(StageBusyError):
        core.failed("again")  # a second failure answers nothing more
    assert core.answers == 1
    core.released()
    assert core.state is TransferState.DONE


def test_a_refused_export_is_answered_and_released_all_the_same() -> None:
    core = TransferCore("r1")
    core.offer()
    core.failed("rank 0: NACK INVALID_ARGUMENT")
    assert core.release_due and core.answers == 1


# ----------------------------------------------------------------------- every row exercised


def _release_in(state: S) -> None:
    h = reach_stage(state, **CAPS)
    step = h.stage.step(I.CommandCall(TransferRelease(task_id="rel", epoch=0, request_id="r9"), 5.0), h.now)
    outcome = outcome_of(h.complete(step))
    assert outcome.ok and h.stage.state is state


def _land_on_running() -> None:
    h = reach_stage(S.RUNNING, **CAPS)
    land = TransferIn(task_id="in", epoch=0, request_id="r1", producer_version=0, expect_version=0, source=SOURCE)
    assert outcome_of(h.complete(h.stage.step(I.CommandCall(land, 5.0), h.now))).ok


def _worker_release_in(state: W) -> None:
    d = reach_worker(state, **CAPS)
    reply = d.run(TransferRelease(task_id="rel", epoch=0, request_id="r1"))
    assert isinstance(reply, Ack) and d.w.state is state


def _worker_land() -> None:
    d = reach_worker(W.ACTIVE, **CAPS)
    reply = d.run(TransferIn(task_id="in", epoch=0, request_id="r1", producer_version=0, source=SOURCE))
    assert isinstance(reply, Ack) and d.w.state is W.ACTIVE


# test_stage_core's and test_worker_core's coverage tests run these: every transfer row fires.
TRANSFER_STAGE_SCENARIOS = [
    test_a_producer_holding_a_transfer_does_not_sleep_until_it_is_released,
    _land_on_running,
    *[lambda s=s: _release_in(s) for s in (S.RUNNING, S.PAUSED, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)],
]
TRANSFER_WORKER_SCENARIOS = [
    test_transfer_out_runs_on_the_shell_and_its_ack_lists_the_buckets,
    _worker_land,
    *[lambda s=s: _worker_release_in(s) for s in (W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)],
]
