"""Refit into a sleeping stage (Capability.HOST_REFIT) in the sans-IO cores: an UpdateWeights
with the weights asleep at level 1 is written into the host copy, the rank and the stage stay
SLEEPING at the new version, and the next wake brings it."""

from __future__ import annotations

from typing import Any

import pytest
import stage_inputs

from omni_core.fsm import StageCommandError
from omni_core.fsm.effects import UpdateEffect
from omni_core.fsm.worker import ALL_CAPABILITIES, EffectCompleted, EffectDeclined, EffectRaised
from omni_core.protocol import (
    Ack,
    Capability,
    DiskSource,
    Nack,
    NackReason,
    Sleep,
    StageState,
    UpdateWeights,
    Wake,
    WorkerState,
)
from tests.lifecycle_helpers import reach_worker
from tests.test_stage_core import reach_stage

S, W = StageState, WorkerState
DISK = DiskSource(path="/ckpt")
REFIT = (*ALL_CAPABILITIES, Capability.HOST_REFIT)


def update(task_id: str, version: int) -> UpdateWeights:
    return UpdateWeights(task_id=task_id, epoch=0, version=version, source=DISK)


# ----------------------------------------------------------------------- worker


def test_a_rank_asleep_at_level_1_writes_its_host_copy_and_stays_asleep() -> None:
    d = reach_worker(W.SLEEPING, capabilities=REFIT)
    asleep = d.w.residency.asleep
    step = d.send(update("u1", 1))
    assert step.effect == UpdateEffect("u1", 1, DISK, True, into_host=True) and d.w.state is W.RELOADING
    (reply,) = d.w.step(EffectCompleted("u1")).replies
    assert isinstance(reply, Ack) and reply.state is W.SLEEPING and reply.weights_version == 1
    assert d.w.state is W.SLEEPING and d.w.residency.asleep == asleep and d.w.residency.weights_valid
    woke = d.run(Wake(task_id="w", epoch=0))
    assert isinstance(woke, Ack) and woke.state is W.ACTIVE and woke.weights_version == 1


def test_a_rank_without_host_refit_refuses_naming_the_capability() -> None:
    d = reach_worker(W.SLEEPING)  # the default capabilities: no host_refit
    reply = d.run(update("u1", 1))
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_STATE
    assert "'host_refit' not declared" in reply.detail and "wake 'weights' first" in reply.detail
    assert d.w.state is W.SLEEPING and d.w.weights_version == 0


def test_a_rank_asleep_at_level_2_has_no_host_copy_to_write() -> None:
    d = reach_worker(W.ACTIVE, capabilities=REFIT)
    d.run(Sleep(task_id="s2", epoch=0, level=2))
    reply = d.run(update("u1", 1))
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_STATE
    assert "level-2 sleep discarded the weights" in reply.detail and d.w.state is W.SLEEPING


def test_a_refit_refused_before_writing_leaves_the_rank_asleep_at_its_version() -> None:
    d = reach_worker(W.SLEEPING, capabilities=REFIT)
    d.send(update("u1", 1))
    (reply,) = d.w.step(EffectDeclined("u1", "tensor 'x' is not a weight", NackReason.INVALID_ARGUMENT)).replies
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_ARGUMENT
    assert d.w.state is W.SLEEPING and d.w.weights_version == 0 and d.w.residency.weights_valid


def test_a_refit_failed_midway_leaves_the_weights_invalid_and_the_wake_needs_reload() -> None:
    d = reach_worker(W.SLEEPING, capabilities=REFIT)
    d.send(update("u1", 1))
    (reply,) = d.w.step(EffectRaised("u1", "the sender vanished")).replies
    assert isinstance(reply, Nack) and reply.reason is NackReason.UPDATE_FAILED and reply.state is W.SLEEPING
    assert "its wake lands NEEDS_RELOAD" in reply.detail
    assert d.w.weights_version == 0 and not d.w.residency.weights_valid
    woke = d.run(Wake(task_id="w", epoch=0))
    assert isinstance(woke, Ack) and woke.state is W.NEEDS_RELOAD


def test_a_partial_sleep_with_the_weights_awake_is_no_refit_into_the_host() -> None:
    d = reach_worker(W.ACTIVE, capabilities=REFIT)
    d.run(Sleep(task_id="kv", epoch=0, tags=("kv_cache",)))
    assert d.w.state is W.SLEEPING and d.w.residency.weights_resident
    reply = d.run(update("u1", 1))
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_STATE


# ----------------------------------------------------------------------- stage


def _sleeping_stage(**kwargs: object):  # type: ignore[no-untyped-def]
    return reach_stage(S.SLEEPING, ranks=2, **kwargs)


def test_the_stage_commits_the_refit_and_stays_sleeping_at_the_new_version() -> None:
    h = _sleeping_stage(capabilities=REFIT)
    step = stage_inputs.update_weights(h.stage, "u1", 1, DISK, h.now, 5.0)
    assert h.stage.state is S.WAKING and len(step.sends) == 2
    outcome = h.complete(step).outcome
    assert outcome is not None and outcome.ok
    assert h.stage.state is S.SLEEPING and h.stage.weights_version == 1
    assert h.stage.residency.asleep == frozenset(h.stage.tags)
    woke = h.complete(stage_inputs.wake(h.stage, "w", None, h.now, 5.0)).outcome
    assert woke is not None and woke.ok and h.stage.state is S.RUNNING
    assert set(h.stage.rank_versions.values()) == {1}


def test_the_stage_refuses_a_refit_when_a_rank_lacks_host_refit() -> None:
    h = _sleeping_stage()
    with pytest.raises(StageCommandError, match="no 'host_refit' capability"):
        stage_inputs.update_weights(h.stage, "u1", 1, DISK, h.now, 5.0)
    assert h.stage.state is S.SLEEPING and h.stage.weights_version == 0


def test_the_stage_refuses_a_refit_after_a_level_2_sleep() -> None:
    h = reach_stage(S.RUNNING, ranks=2, capabilities=REFIT)
    h.complete(stage_inputs.sleep(h.stage, "s2", 2, None, h.now, 5.0))
    with pytest.raises(StageCommandError, match="level-2 sleep discarded them"):
        stage_inputs.update_weights(h.stage, "u1", 1, DISK, h.now, 5.0)


def _every_rank_nacks_the_update(h: Any, reason: NackReason, detail: str) -> Any:
    """An update to version 1 sent to a sleeping stage, each rank answering Nack `reason`."""
    step = stage_inputs.update_weights(h.stage, "u1", 1, DISK, h.now, 5.0)
    replies = [
        Nack(
            task_id="u1",
            epoch=h.stage.epoch,
            command="UpdateWeights",
            rank=out.rank,
            reason=reason,
            state=W.SLEEPING,
            detail=detail,
        )
        for out in step.sends
    ]
    return h.feed(replies).outcome


def test_every_rank_refusing_returns_the_stage_to_sleeping() -> None:
    h = _sleeping_stage(capabilities=REFIT)
    outcome = _every_rank_nacks_the_update(h, NackReason.INVALID_ARGUMENT, "tensor 'x' is not a weight")
    assert outcome is not None and not outcome.ok and h.stage.state is S.SLEEPING
    assert h.stage.weights_version == 0


def test_every_rank_failing_leaves_the_stage_asleep_with_invalid_weights() -> None:
    h = _sleeping_stage(capabilities=REFIT)
    outcome = _every_rank_nacks_the_update(h, NackReason.UPDATE_FAILED, "the sender vanished")
    assert outcome is not None and not outcome.ok and "wake it (NEEDS_RELOAD)" in outcome.error
    assert h.stage.state is S.SLEEPING and h.stage.weights_version == 0 and not h.stage.residency.weights_valid
