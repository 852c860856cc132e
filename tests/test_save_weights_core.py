"""SaveWeights in the cores, one scripted case at a time: where the tables allow it (valid
weights awake), the rank count it must name, the capability a worker must declare, and what
the stage's version book does once every rank saved (the directory becomes the durable source
a restart reloads) and when one refuses (nothing)."""

from __future__ import annotations

import msgspec
import pytest
import stage_inputs
from lifecycle_helpers import StageHarness, reach_worker
from test_stage_core import outcome_of, reach_stage
from test_weights_core import _shm

from omni_core.fsm import StageCommandError, StageCore
from omni_core.fsm import inputs as I
from omni_core.fsm.effects import CommandEffect, ReloadEffect
from omni_core.fsm.stage_versions import StartWeights, VersionKeeper
from omni_core.fsm.worker_inputs import EffectCompleted, EffectRaised
from omni_core.fsm.worker_step import ALL_CAPABILITIES
from omni_core.protocol import (
    Ack,
    Capability,
    DiskSource,
    Nack,
    NackReason,
    ReloadWeights,
    SaveWeights,
    Status,
    TensorSpec,
    UpdateWeights,
    Wake,
)
from omni_core.protocol import StageState as S
from omni_core.protocol import WorkerState as W
from omni_testing.envelope import NO_MEMORY
from omni_testing.network import Simulator


def _save(directory: str = "/saves/v2", ranks: int = 2, task_id: str = "save") -> I.CommandCall:
    return I.CommandCall(SaveWeights(task_id=task_id, epoch=0, directory=directory, ranks=ranks), 5.0)


def _memory_update(h) -> None:  # type: ignore[no-untyped-def]
    shm = _shm(64, TensorSpec(name="w", dtype="float32", shape=(4,)))
    h.complete(stage_inputs.update_weights(h.stage, "u", 2, shm, h.now, 5.0))
    assert (h.stage.weights_version, h.stage.versions.kind) == (2, "memory")


def test_a_save_every_rank_acked_makes_the_version_durable_for_a_restart() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    _memory_update(h)
    step = h.stage.step(_save(), h.now)
    assert {o.command.directory for o in step.sends} == {"/saves/v2"}  # type: ignore[attr-defined]
    outcome = outcome_of(h.complete(step))
    assert (outcome.ok, outcome.command, outcome.state) == (True, "SaveWeights", S.RUNNING)
    assert (h.stage.versions.kind, h.stage.versions.source) == ("disk", "/saves/v2")
    h.sim.restart(10.0, hello=False)
    start = h.stage.start_weights
    assert start is not None and (start.source, start.version, start.needs_reload) == ("/saves/v2", 2, False)


def test_without_the_save_the_same_restart_comes_back_under_the_floor() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    _memory_update(h)
    h.sim.restart(10.0, hello=False)
    start = h.stage.start_weights
    assert start is not None and (start.needs_reload, start.floor) == (True, 2)


def test_a_save_one_rank_refused_records_nothing() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    _memory_update(h)
    step = h.stage.step(_save(), h.now)
    replies = h.to_workers(step, ranks={0})
    refused = Nack(
        task_id="save", epoch=0, rank=1, command="SaveWeights", reason=NackReason.INVALID_ARGUMENT, state=W.ACTIVE
    )
    outcome = outcome_of(h.feed([*replies, refused]))
    assert not outcome.ok and "SaveWeights refused by ranks [1]" in outcome.error
    assert (h.stage.versions.kind, h.stage.versions.source, h.stage.state) == ("memory", None, S.RUNNING)


def test_the_save_must_name_the_stages_rank_count() -> None:
    h = reach_stage(S.RUNNING, ranks=2)
    with pytest.raises(StageCommandError, match="has 2 ranks, and the SaveWeights says 1: send ranks=2"):
        h.stage.step(_save(ranks=1), h.now)
    assert h.stage.task_id is None


@pytest.mark.parametrize("state", [S.SLEEPING, S.NEEDS_RELOAD, S.PARTIAL])
def test_a_save_without_valid_weights_awake_is_refused_by_the_table(state: S) -> None:
    h = reach_stage(state, ranks=2)  # PARTIAL: kv_cache woke, the weights sleep
    with pytest.raises(StageCommandError, match=f"cannot save weights in {state.value}: valid weights must be awake"):
        h.stage.step(_save(), h.now)
    assert h.stage.state is state and h.stage.task_id is None


def test_a_paused_stage_saves_and_stays_paused() -> None:
    h = reach_stage(S.PAUSED, ranks=2)
    outcome = outcome_of(h.complete(h.stage.step(_save(), h.now)))
    assert outcome.ok and h.stage.state is S.PAUSED


# ----------------------------------------------------------------------- the worker


def _worker_save(task_id: str = "w-save") -> SaveWeights:
    return SaveWeights(task_id=task_id, epoch=0, directory="/saves/w")


@pytest.mark.parametrize("state", [W.ACTIVE, W.PARTIAL])
def test_a_worker_performs_a_save_by_the_generic_template_and_keeps_its_state(state: W) -> None:
    worker = reach_worker(state)
    if state is W.PARTIAL:  # kv_cache awake: wake the weights, kv_cache asleep, to be PARTIAL with them
        worker = reach_worker(W.SLEEPING)
        worker.run(Wake(task_id="wake-weights", epoch=0, tags=("weights",)))
        assert worker.w.state is W.PARTIAL
    step = worker.send(_worker_save())
    assert isinstance(step.effect, CommandEffect) and step.effect.command == _worker_save()
    done = worker.w.step(EffectCompleted("w-save", output="/saves/w"))
    (reply,) = done.replies
    assert isinstance(reply, Ack) and (reply.command, reply.state) == ("SaveWeights", worker.w.state)


@pytest.mark.parametrize("state", [W.SLEEPING, W.NEEDS_RELOAD, W.PARTIAL])
def test_a_worker_without_valid_weights_awake_refuses_invalid_state(state: W) -> None:
    worker = reach_worker(state)  # PARTIAL here: kv_cache awake, the weights asleep
    reply = worker.run(_worker_save())
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_STATE
    assert "SaveWeights needs valid weights awake" in reply.detail and worker.w.state is state


def test_a_worker_without_the_capability_refuses_unsupported() -> None:
    worker = reach_worker(W.ACTIVE, capabilities=tuple(c for c in ALL_CAPABILITIES if c is not Capability.SAVE_WEIGHTS))
    reply = worker.run(_worker_save())
    assert isinstance(reply, Nack) and reply.reason is NackReason.UNSUPPORTED
    assert "capability 'save_weights' not declared" in reply.detail


def test_a_save_that_raises_is_that_commands_refusal_and_the_rank_serves_on() -> None:
    worker = reach_worker(W.ACTIVE)
    worker.send(_worker_save())
    (reply,) = worker.w.step(EffectRaised("w-save", "OSError: No space left on device")).replies
    assert isinstance(reply, Nack) and reply.reason is NackReason.INVALID_ARGUMENT
    assert "No space left on device" in reply.detail and worker.w.state is W.ACTIVE


@pytest.mark.parametrize("state", [S.RUNNING, S.PAUSED, S.PARTIAL])
def test_a_stage_saves_wherever_valid_weights_are_awake_and_keeps_its_state(state: S) -> None:
    h = reach_stage(S.PAUSED if state is S.PAUSED else S.RUNNING, ranks=2)
    if state is S.PARTIAL:  # the weights awake, kv_cache asleep
        h.complete(stage_inputs.sleep(h.stage, "sleep", 1, None, h.now, 5.0))
        h.complete(stage_inputs.wake(h.stage, "wake", ("weights",), h.now, 5.0))
    assert h.stage.state is state
    outcome = outcome_of(h.complete(h.stage.step(_save(), h.now)))
    assert (outcome.ok, outcome.state, h.stage.versions.source) == (True, state, "/saves/v2")


# ----------------------------------------------------------------------- dummy weights


def _dummy_stage(ranks: int = 2) -> Simulator:
    sim = Simulator(StageCore("rollout", ranks, dummy_weights=True), record=False)
    sim.start(10.0)
    sim.deliver_all()
    return sim


def test_a_dummy_stage_starts_needs_reload_at_version_zero_and_says_why() -> None:
    sim = _dummy_stage()
    stage = sim.stage
    assert (stage.state, stage.weights_version, stage.versions.kind) == (S.NEEDS_RELOAD, 0, "dummy")
    assert "started with dummy weights" in stage.versions.dummy_detail("rollout")
    with pytest.raises(StageCommandError, match="Model reloading with dummy format"):
        stage.step(I.ReloadCall("r", None, 5.0), sim.now)
    assert stage.task_id is None and stage.state is S.NEEDS_RELOAD


def test_a_dummy_stage_whose_ranks_say_active_fails_the_start() -> None:
    """A rank that claims to serve weights nobody loaded is a divergence, not a start."""
    sim = Simulator(StageCore("rollout", 1, dummy_weights=True), record=False)
    sim.start(10.0, hello=False)
    sim.stage.step(I.Received(sim.hello(0, state=W.ACTIVE)), sim.now)
    assert sim.stage.state is S.FAILED and "started in ACTIVE, not NEEDS_RELOAD" in sim.stage.failure


@pytest.mark.parametrize(
    ("committed", "want"),
    [
        (None, StartWeights(needs_reload=True)),  # nothing came: dummy again
        ("disk", StartWeights(source="/ckpt", version=3)),  # a disk update: reloaded at 3
        ("memory", StartWeights(needs_reload=True, floor=3)),  # from memory: under the floor
    ],
)
def test_a_dummy_stages_restart_never_claims_checkpoint_weights(committed: str | None, want: StartWeights) -> None:
    keeper = VersionKeeper(dummy=True)
    version = 0
    if committed == "disk":
        keeper.committed(UpdateWeights(task_id="u", epoch=0, version=3, source=DiskSource(path="/ckpt")), 3)
        version = 3
    elif committed == "memory":
        shm = _shm(16, TensorSpec(name="w", dtype="float32", shape=(4,)))
        keeper.committed(UpdateWeights(task_id="u", epoch=0, version=3, source=shm), 3)
        version = 3
    assert keeper.plan_restart(version, 1, from_checkpoint=False) == want
    assert keeper.plan_restart(version, 2, from_checkpoint=True) == StartWeights(needs_reload=True)
    assert keeper.kind == "dummy"


# ----------------------------------------------------------------------- a reload of a save


def _reload_save(h, versions: dict[int, int], source: str = "/saves/v3"):  # type: ignore[no-untyped-def]
    """The stage reloads `source`; rank r ACKs at `versions[r]` (the version its save's index names)."""
    step = h.stage.step(I.ReloadCall("reload-save", source, 5.0), h.now)
    replies = [msgspec.structs.replace(r, weights_version=versions[r.rank]) for r in h.to_workers(step)]
    return h.feed(replies)


def test_a_reload_of_a_save_commits_the_version_its_ranks_ack_and_keeps_it_durable() -> None:
    h = reach_stage(S.NEEDS_RELOAD, ranks=2)
    outcome = outcome_of(_reload_save(h, {0: 3, 1: 3}))
    assert (outcome.ok, outcome.state, h.stage.weights_version) == (True, S.RUNNING, 3)
    assert (h.stage.versions.kind, h.stage.versions.source) == ("disk", "/saves/v3")
    h.sim.restart(10.0, hello=False)
    start = h.stage.start_weights
    assert start is not None and (start.source, start.version, start.needs_reload) == ("/saves/v3", 3, False)


def test_a_reload_whose_ranks_ack_different_versions_fails_the_stage() -> None:
    h = reach_stage(S.NEEDS_RELOAD, ranks=2)
    _reload_save(h, {0: 3, 1: 2})
    assert h.stage.state is S.FAILED
    assert "ACKed ReloadWeights at weights version 2; the stage expected version 3" in h.stage.failure


def test_a_reload_of_the_runners_own_weights_must_ack_version_zero() -> None:
    h = reach_stage(S.NEEDS_RELOAD, ranks=2)
    step = h.stage.step(I.ReloadCall("own", None, 5.0), h.now)
    h.feed([msgspec.structs.replace(r, weights_version=3) for r in h.to_workers(step)])
    assert h.stage.state is S.FAILED and "the stage expected version 0" in h.stage.failure


def _under_floor_two() -> StageHarness:
    h = reach_stage(S.RUNNING, ranks=2)
    _memory_update(h)
    h.restart()
    assert (h.stage.state, h.stage.versions.floor) == (S.NEEDS_RELOAD, 2)
    return h


def test_under_a_floor_a_reload_of_a_save_at_the_floor_serves_it() -> None:
    h = _under_floor_two()
    with pytest.raises(StageCommandError, match="a reload would serve version 0, below the floor"):
        h.stage.step(I.ReloadCall("own", None, 5.0), h.now)
    outcome = outcome_of(_reload_save(h, {0: 2, 1: 2}))
    assert (outcome.ok, h.stage.state, h.stage.weights_version, h.stage.versions.floor) == (True, S.RUNNING, 2, 0)


def test_under_a_floor_a_reload_of_an_older_save_fails_and_never_serves_it() -> None:
    h = _under_floor_two()
    _reload_save(h, {0: 1, 1: 1})
    assert h.stage.state is S.FAILED and "reloaded weights version 1" in h.stage.failure
    assert "below the stage's floor 2" in h.stage.failure and h.stage.versions.floor == 2


def test_a_rank_reloads_at_the_version_the_shell_read_and_takes_updates_above_it_only() -> None:
    worker = reach_worker(W.NEEDS_RELOAD)
    step = worker.send(ReloadWeights(task_id="rl", epoch=0, source="/saves/v3"))
    assert isinstance(step.effect, ReloadEffect)
    (ack,) = worker.w.step(EffectCompleted("rl", memory=NO_MEMORY, weights_version=3)).replies
    assert isinstance(ack, Ack) and (ack.state, ack.weights_version) == (W.ACTIVE, 3)
    stale = worker.run(UpdateWeights(task_id="u3", epoch=0, version=3, source=DiskSource(path="/ckpt")))
    assert isinstance(stale, Nack) and stale.reason is NackReason.STALE_VERSION


def test_a_reload_commits_where_it_read_and_a_memory_update_after_it_does_not() -> None:
    keeper = VersionKeeper()
    shm = _shm(16, TensorSpec(name="w", dtype="float32", shape=(4,)))
    keeper.committed(UpdateWeights(task_id="u", epoch=0, version=3, source=shm), 3)
    keeper.committed(ReloadWeights(task_id="r", epoch=0, source="/saves/v3"), 3)  # a save of v3 read back
    assert keeper.plan_restart(3, 1, from_checkpoint=False) == StartWeights(source="/saves/v3", version=3)
    keeper.committed(UpdateWeights(task_id="u2", epoch=0, version=4, source=shm), 4)
    assert keeper.plan_restart(4, 2, from_checkpoint=False) == StartWeights(needs_reload=True, floor=4)
    # Status and the like write no weights: where the version lives is unchanged.
    keeper.committed(Status(task_id="s", epoch=0), 4)
    assert keeper.kind == "memory"
