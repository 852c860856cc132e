"""P-17 in the sans-IO cores: the weights version through a rank's and a stage's lifecycle."""

from __future__ import annotations

import msgspec
import pytest
import stage_inputs

from omni_core.fsm import StageCommandError
from omni_core.fsm.effects import ShareEffect, UpdateEffect
from omni_core.fsm.worker import EffectCompleted, EffectDeclined, EffectRaised
from omni_core.protocol import (
    Ack,
    AckStatus,
    Bucket,
    Capability,
    DiskSource,
    Execute,
    Nack,
    NackReason,
    ProtocolError,
    ReloadWeights,
    Result,
    ShareWeights,
    ShmSource,
    Sleep,
    StageState,
    TensorSpec,
    UpdateWeights,
    Wake,
    WorkerState,
    decode,
    encode,
)
from tests.lifecycle_helpers import reach_worker
from tests.test_stage_core import reach_stage

S, W = StageState, WorkerState
DISK = DiskSource(path="/ckpt")


def update(task_id: str, version: int, source: object = DISK) -> UpdateWeights:
    return UpdateWeights(task_id=task_id, epoch=0, version=version, source=source)  # type: ignore[arg-type]


# ----------------------------------------------------------------------- wire


def _shm(nbytes: int, *specs: TensorSpec) -> ShmSource:
    return ShmSource(buckets=(Bucket(handle="/dev/shm/x", nbytes=nbytes, sender_pid=1, tensors=specs),))


def test_update_round_trips_and_bounds_are_checked_on_decode() -> None:
    good = update(
        "u",
        3,
        _shm(
            32,
            TensorSpec(name="w", dtype="float32", shape=(2, 2)),
            TensorSpec(name="b", dtype="bfloat16", shape=(8,), offset_bytes=16),
        ),
    )
    assert decode(encode(good)) == good

    def raw(tensors: list[dict], nbytes: int, version: int = 3) -> bytes:
        bucket = {"handle": "/dev/shm/x", "nbytes": nbytes, "sender_pid": 1, "tensors": tensors}
        return msgspec.msgpack.encode(
            {
                "type": "UpdateWeights",
                "task_id": "u",
                "epoch": 0,
                "version": version,
                "source": {"type": "shm", "buckets": [bucket]},
            }
        )

    w = {"name": "w", "dtype": "float32", "shape": [2, 2]}
    for bad, match in [
        (raw([w], 8), "ends past its bucket"),
        (raw([w, {**w, "offset_bytes": 16}], 64), "appears twice"),
        (raw([w], 64, version=0), ">= 1"),
        (raw([{**w, "shape": [1] * 9}], 64), "length <= 8"),
        (raw([{**w, "dtype": "complex64"}], 64), "dtype"),
    ]:
        with pytest.raises(ProtocolError, match=match):
            decode(bad)


def test_a_reply_without_a_version_is_the_frame_earlier_peers_know() -> None:
    ack = Ack(task_id="t", epoch=0, rank=0, command="Sleep", state=W.ACTIVE)
    assert b"weights_version" not in encode(ack)
    assert b"weights_version" in encode(msgspec.structs.replace(ack, weights_version=2))
    assert decode(encode(msgspec.structs.replace(ack, weights_version=2))).weights_version == 2  # type: ignore[attr-defined]


# ----------------------------------------------------------------------- worker


@pytest.mark.parametrize("state", [W.ACTIVE, W.PARTIAL, W.NEEDS_RELOAD])
def test_an_update_is_taken_where_the_weights_are_resident(state: WorkerState) -> None:
    d = reach_worker(W.SLEEPING if state is W.PARTIAL else state)
    if state is W.PARTIAL:  # reach_worker's PARTIAL has the weights asleep: this one has them awake
        d.run(Wake(task_id="w-weights", epoch=0, tags=("weights",)))
        assert d.w.state is W.PARTIAL
    before = d.w.state
    step = d.send(update("u1", 1))
    assert step.effect == UpdateEffect("u1", 1, DISK) and d.w.state is W.RELOADING
    reply = d.w.step(EffectCompleted("u1")).replies[0]
    assert isinstance(reply, Ack) and reply.weights_version == 1 and d.w.weights_version == 1
    assert d.w.state is (W.ACTIVE if before in (W.ACTIVE, W.NEEDS_RELOAD) and not d.w.residency.asleep else W.PARTIAL)


@pytest.mark.parametrize("state", [W.SLEEPING, W.PARTIAL, W.LOADING, W.FAILED])
def test_an_update_is_refused_where_the_weights_are_not_resident(state: WorkerState) -> None:
    d = reach_worker(state)  # PARTIAL here: kv_cache awake, weights asleep
    reply = d.run(update("u1", 1))
    assert isinstance(reply, Nack) and reply.reason in (NackReason.INVALID_STATE, NackReason.FAILED)
    assert d.w.state is state and d.w.weights_version == 0


def test_a_version_not_above_the_current_is_refused_naming_both() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(update("u5", 5))
    for version in (5, 4):
        reply = d.run(update(f"again-{version}", version))
        assert isinstance(reply, Nack) and reply.reason is NackReason.STALE_VERSION
        assert f"version {version} is not above this rank's version 5" in reply.detail
        assert reply.weights_version == 5 and d.w.state is W.ACTIVE


def test_a_retry_of_an_update_is_answered_from_the_cache_without_a_second_write() -> None:
    d = reach_worker(W.ACTIVE)
    first = d.run(update("u1", 1))
    step = d.send(update("u1", 1))
    assert step.effect is None and step.replies == (first,)
    assert isinstance(d.run(update("u1", 2)), Nack)  # the same task_id for another update: TASK_ID_REUSED


def test_refused_before_writing_keeps_state_and_version() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(update("u1", 1))
    d.send(update("u2", 2))
    (reply,) = d.w.step(EffectDeclined("u2", "tensor 'w0' has shape (4, 4), the model's is (4, 8)")).replies
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_ARGUMENT and "'w0'" in reply.detail
    assert d.w.state is W.ACTIVE and d.w.weights_version == 1 and d.w.residency.weights_valid


def test_a_failure_once_writing_began_leaves_needs_reload_at_the_old_version() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(update("u1", 1))
    d.send(update("u2", 2))
    (reply,) = d.w.step(EffectRaised("u2", "sender pid 4242 exited mid-update")).replies
    assert isinstance(reply, Nack) and reply.reason is NackReason.UPDATE_FAILED
    assert reply.state is W.NEEDS_RELOAD and reply.weights_version == 1 and "still at weights version 1" in reply.detail
    assert isinstance(d.run(Execute(task_id="x", epoch=0)), Nack)  # nothing runs on half-written weights
    assert d.run(update("u2-again", 2)).weights_version == 2 and d.w.state is W.ACTIVE  # type: ignore[attr-defined]


def test_a_reload_brings_back_the_runners_own_weights_as_version_0() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(update("u1", 3))
    assert d.run(ReloadWeights(task_id="r", epoch=0)).weights_version == 0  # type: ignore[attr-defined]


def test_results_and_sleeps_carry_the_version() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(update("u1", 7))
    assert isinstance(result := d.run(Execute(task_id="x", epoch=0)), Result) and result.weights_version == 7
    assert d.run(Sleep(task_id="s", epoch=0, level=2)).weights_version == 7  # type: ignore[attr-defined]


def test_a_worker_without_the_capability_refuses_updates() -> None:
    d = reach_worker(W.ACTIVE, capabilities=(Capability.LEVEL2,))
    reply = d.run(update("u1", 1))
    assert isinstance(reply, Nack) and reply.reason is NackReason.UNSUPPORTED and d.w.state is W.ACTIVE


# ----------------------------------------------------------------------- stage


def test_in_running_the_update_drains_first_and_requests_wait_until_every_rank_acked() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    st = h.stage
    stage_inputs.request_started(st, h.now)
    step = stage_inputs.update_weights(st, "u1", 1, DISK, h.now, 5.0)
    assert not step.sends and st.state is S.DRAINING and not st.admits()
    sent = stage_inputs.request_finished(st, h.now)
    assert st.state is S.WAKING and {type(o.command) for o in sent.sends} == {UpdateWeights}
    replies = h.to_workers(sent)
    h.feed(replies[:1])
    assert st.state is S.WAKING and not st.admits() and st.weights_version == 0  # one rank is not a commit
    outcome = h.feed(replies[1:]).outcome
    assert outcome is not None and outcome.ok and st.state is S.RUNNING and st.weights_version == 1


def test_an_update_drain_that_times_out_stays_running_and_sends_nothing() -> None:
    h = reach_stage(S.RUNNING, ranks=1)
    stage_inputs.request_started(h.stage, h.now)
    stage_inputs.update_weights(h.stage, "u1", 1, DISK, h.now, 5.0)
    step = stage_inputs.on_tick(h.stage, h.now + 6.0)
    assert step.outcome is not None and not step.outcome.ok and "update abandoned" in step.outcome.error
    assert h.stage.state is S.RUNNING and h.stage.weights_version == 0


def test_an_ack_at_another_version_fails_the_stage_naming_both() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    step = stage_inputs.update_weights(h.stage, "u1", 2, DISK, h.now, 5.0)
    replies = h.to_workers(step)
    forged = msgspec.structs.replace(replies[1], weights_version=9)
    outcome = h.feed([replies[0], forged]).outcome
    assert outcome is not None and h.stage.state is S.FAILED
    assert "at weights version 9; the stage expected version 2" in outcome.error


def test_a_result_from_another_version_is_never_served() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    stage_inputs.request_started(h.stage, h.now)
    request = next(iter(h.stage.in_flight))
    from omni_core.fsm import inputs as I

    good = Result(task_id=request, epoch=0, rank=0, output=1)
    stale = Result(task_id=request, epoch=0, rank=1, output=2, weights_version=3)
    h.stage.step(I.Received(good), h.now)
    step = h.stage.step(I.Received(stale), h.now)
    assert h.stage.state is S.FAILED and "weights version 3" in h.stage.failure
    assert all(r.output is None for r in step.requests)


def test_ranks_starting_at_different_versions_fail_the_start() -> None:
    h = reach_stage(S.STARTING, ranks=2)
    h.hello(0, weights_version=1)
    h.hello(1, weights_version=2)
    stage_inputs.on_hello(h.stage, h.hello(0, weights_version=1), h.now)
    stage_inputs.on_hello(h.stage, h.hello(1, weights_version=2), h.now)
    assert h.stage.state is S.FAILED and "different weights" in h.stage.failure


@pytest.mark.parametrize("state", [S.SLEEPING, S.FAILED, S.STOPPED])
def test_the_stage_refuses_an_update_where_the_weights_are_not_resident(state: StageState) -> None:
    h = reach_stage(state, ranks=1)
    with pytest.raises(StageCommandError):
        stage_inputs.update_weights(h.stage, "u1", 1, DISK, h.now, 5.0)
    assert h.stage.state is state


def test_the_stage_refuses_a_stale_version_before_sending() -> None:
    h = reach_stage(S.RUNNING, ranks=1)
    h.complete(stage_inputs.update_weights(h.stage, "u1", 4, DISK, h.now, 5.0))
    with pytest.raises(StageCommandError, match="version 4 is not above the stage's version 4"):
        stage_inputs.update_weights(h.stage, "u2", 4, DISK, h.now, 5.0)
    assert stage_inputs.update_weights(h.stage, "u1", 4, DISK, h.now, 5.0).outcome.status is AckStatus.OK  # type: ignore[union-attr]


@pytest.mark.parametrize("state", [W.SLEEPING, W.NEEDS_RELOAD, W.PARTIAL])
def test_share_needs_valid_weights_awake(state: WorkerState) -> None:
    d = reach_worker(state)  # PARTIAL here has the weights asleep
    reply = d.run(ShareWeights(task_id="sh", epoch=0))
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_STATE and d.w.state is state


def test_a_share_acks_the_buckets_and_changes_nothing() -> None:
    d = reach_worker(W.ACTIVE)
    source = ShmSource(
        buckets=(
            Bucket(
                handle="/dev/shm/x",
                nbytes=16,
                sender_pid=1,
                tensors=(TensorSpec(name="w0", dtype="float32", shape=(2, 2)),),
            ),
        )
    )
    step = d.send(ShareWeights(task_id="sh", epoch=0, bucket_bytes=4096))
    assert step.effect == ShareEffect("sh", 4096) and d.w.state is W.ACTIVE
    (ack,) = d.w.step(EffectCompleted("sh", shared=source)).replies
    assert isinstance(ack, Ack) and ack.shared == source and decode(encode(ack)) == ack and d.w.state is W.ACTIVE


# ----------------------------------------------------------------------- restarts


def test_a_restart_whose_ranks_ignore_their_start_source_fails_naming_them() -> None:
    """The fresh ranks must say Hello at the version their start source holds: a rank that
    loaded its checkpoint instead (a worker ignoring start_source) would serve version 0 under
    the label 4."""
    h = reach_stage(S.RUNNING, ranks=2)
    h.complete(stage_inputs.update_weights(h.stage, "u", 4, DISK, h.now, 5.0))
    assert h.stage.weights_version == 4
    h.sim.restart(10.0, hello=False)
    assert h.stage.start_weights is not None and h.stage.start_weights.source == "/ckpt"
    for rank in (0, 1):
        stage_inputs.on_hello(h.stage, h.hello(rank, weights_version=0), h.now)
    assert h.stage.state is S.FAILED
    assert "started at weights version 0, not 4 (loaded from /ckpt)" in h.stage.failure


def test_a_floor_survives_a_second_restart_and_a_reset_clears_it() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    shm = _shm(64, TensorSpec(name="w", dtype="float32", shape=(4,)))
    h.complete(stage_inputs.update_weights(h.stage, "u", 2, shm, h.now, 5.0))
    h.restart()
    assert (h.stage.state, h.stage.weights_version, h.stage.versions.floor) == (S.NEEDS_RELOAD, 0, 2)
    h.restart()  # nothing came back in between: the floor holds
    assert (h.stage.state, h.stage.versions.floor) == (S.NEEDS_RELOAD, 2)
    h.sim.restart(10.0, from_checkpoint=True)
    h.sim.deliver_all()
    assert (h.stage.state, h.stage.weights_version, h.stage.versions.floor) == (S.RUNNING, 0, 0)
    assert h.stage.versions.last_reset is not None and h.stage.versions.last_reset.from_version == 2


@pytest.mark.parametrize("version", [0, -1, True, 1.0, 1 << 63])
def test_a_version_outside_the_wires_bounds_is_refused_by_the_one_rule(version: object) -> None:
    """The stage core, the engine and the wire hold an update's version to one rule
    (new_version_problem, NewWeightsVersion's bounds): what it refuses never reaches a rank."""
    from omni_core.fsm import inputs as I
    from omni_core.protocol import UpdateWeights, new_version_problem
    from omni_core.protocol.weights import MAX_WEIGHTS_VERSION

    problem = new_version_problem(version)
    assert problem is not None and f"1..{MAX_WEIGHTS_VERSION}" in problem and repr(version) in problem
    h = reach_stage(S.RUNNING)
    with pytest.raises(StageCommandError) as refused:
        h.stage.step(I.UpdateCall("u", version, DISK, 10.0), h.now)  # type: ignore[arg-type]
    assert str(refused.value) == problem
    if type(version) is int:  # the wire says the same of the command
        wire = msgspec.to_builtins(UpdateWeights(task_id="u", epoch=0, version=version, source=DISK))
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(wire, UpdateWeights)
    assert new_version_problem(1) is None and new_version_problem(MAX_WEIGHTS_VERSION) is None
