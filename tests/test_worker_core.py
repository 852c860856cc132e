"""WorkerCore, one scripted case at a time: legality from the table, ALREADY no-ops, reply
cache, fencing, capabilities, BUSY, failures. Every message goes through the codec."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import test_save_weights_core as save_cases
from lifecycle_helpers import WorkerDriver, fresh, reach_worker, record_transitions, table_pairs, wire
from test_transfers_core import TRANSFER_WORKER_SCENARIOS
from test_worker_adapters import ADAPTER_SCENARIOS
from test_worker_hold import hold_scenario

from omni_core.fsm import (
    STAGE_TRANSITIONS,
    WORKER_TRANSITIONS,
    BoundedCache,
    CommandEffect,
    ExecuteEffect,
    InvariantViolation,
    ProfileEffect,
    ReloadEffect,
    ShutdownEffect,
    SleepEffect,
    StatusEffect,
    WakeEffect,
    WorkerCore,
)
from omni_core.fsm.worker import (
    MAX_EPOCH_AHEAD,
    BadFrame,
    EffectCompleted,
    EffectDeclined,
    EffectRaised,
    Loaded,
    LoadFailed,
    WorkerStep,
)
from omni_core.protocol import (
    Ack,
    AckStatus,
    Capability,
    Command,
    DiskSource,
    Execute,
    LinkShare,
    MemoryReport,
    Nack,
    NackReason,
    Profile,
    ProtocolError,
    ReloadWeights,
    ResetPrefixCache,
    Result,
    Shutdown,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
    WorkerState,
    decode,
)

W = WorkerState
BOOM = "cuMemUnmap returned CUDA_ERROR_INVALID_VALUE"

# Which table triggers make a command legal (a command is forbidden in a state when none of
# its triggers lists that state as a source).
TRIGGERS_OF: dict[str, tuple[str, ...]] = {
    "Sleep": ("sleep", "sleep_already"),
    "Wake": ("wake", "wake_already"),
    "ReloadWeights": ("reload",),
    "Execute": ("execute",),
    "Status": ("status",),
    "Shutdown": ("shutdown", "shutdown_already"),
    "Profile": ("profile", "profile_already"),
    "ResetPrefixCache": ("reset_prefix_cache",),
}
COMMANDS: dict[str, Callable[[str, int], Command]] = {
    "Sleep": lambda t, e: Sleep(task_id=t, epoch=e, level=1),
    "Wake": lambda t, e: Wake(task_id=t, epoch=e),
    "ReloadWeights": lambda t, e: ReloadWeights(task_id=t, epoch=e, source="ckpt"),
    "Execute": lambda t, e: Execute(task_id=t, epoch=e, payload={"prompt": "hi"}),
    "Status": lambda t, e: Status(task_id=t, epoch=e),
    "Shutdown": lambda t, e: Shutdown(task_id=t, epoch=e),
    "Profile": lambda t, e: Profile(task_id=t, epoch=e, start=True, prefix="p"),
    "ResetPrefixCache": lambda t, e: ResetPrefixCache(task_id=t, epoch=e),
}
TRANSIENT = (W.OFFLOADING, W.RESTORING, W.RELOADING)


def legal_states(command: str) -> set[WorkerState]:
    return {s for t in WORKER_TRANSITIONS if t.trigger in TRIGGERS_OF[command] for s in t.sources}


def snapshot(w: WorkerCore) -> tuple:
    return (w.state, w.residency.asleep, w.residency.weights_valid, w.busy, len(w.cache), w.failure, w.epoch)


FORBIDDEN = [(s, c) for c in COMMANDS for s in W if s not in legal_states(c)]


def test_forbidden_cases_are_what_the_table_says() -> None:
    # A guard on the matrix below: Status is legal everywhere, Shutdown everywhere but in the
    # transient states (an effect is in progress there: BUSY), Execute only in ACTIVE.
    assert legal_states("Status") == set(W)
    assert legal_states("Shutdown") == set(W) - set(TRANSIENT)
    assert legal_states("Execute") == {W.ACTIVE}
    assert legal_states("Profile") == {W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD}
    assert legal_states("ResetPrefixCache") == {W.ACTIVE, W.PARTIAL}
    assert len(FORBIDDEN) == 6 + 6 + 8 + 9 + 3 + 6 + 8


@pytest.mark.parametrize(("state", "name"), FORBIDDEN, ids=[f"{c}-in-{s.value}" for s, c in FORBIDDEN])
def test_forbidden_command_is_refused_without_effect(state: WorkerState, name: str) -> None:
    d = reach_worker(state)
    before = snapshot(d.w)
    step = d.send(COMMANDS[name](fresh(), d.epoch))
    assert step.effect is None
    (nack,) = step.replies
    nack = wire(nack)
    assert isinstance(nack, Nack)
    assert nack.command == name
    assert nack.state is state
    # A refusal changes nothing; only a BUSY to an Execute, a Profile or a command of the generic
    # template is remembered (the BUSY hole).
    recorded = 1 if (state in TRANSIENT and name in ("Execute", "Profile", "ResetPrefixCache")) else 0
    assert snapshot(d.w)[:4] + (len(d.w.cache) - recorded,) + snapshot(d.w)[5:] == before, "a refusal changed"
    if state in TRANSIENT:
        # A transient state always has an effect in progress: the refusal is BUSY.
        assert nack.reason is NackReason.BUSY
        assert "in progress" in nack.detail
    elif state is W.FAILED:
        assert nack.reason is NackReason.FAILED
        assert "FAILED" in nack.detail and BOOM in nack.detail
    else:
        assert nack.reason is NackReason.INVALID_STATE
        assert f"{name} is not allowed in state {state.value}" in nack.detail


@pytest.mark.parametrize("state", [s for s in W if s not in TRANSIENT and s is not W.FAILED])
def test_execute_is_refused_everywhere_but_active(state: WorkerState) -> None:
    d = reach_worker(state)
    step = d.send(Execute(task_id=fresh(), epoch=0))
    if state is W.ACTIVE:
        assert step.effect == ExecuteEffect(step.effect.task_id, None)  # type: ignore[union-attr]
        return
    assert step.effect is None
    (nack,) = step.replies
    assert nack.reason is NackReason.INVALID_STATE and state.value in nack.detail


def test_shutdown_in_transient_states_waits_for_the_effect() -> None:
    # The table allows Shutdown from OFFLOADING/RESTORING/RELOADING, but those states always
    # hold an effect in progress, so the core answers BUSY (retry after the reply).
    for state in TRANSIENT:
        d = reach_worker(state)
        (nack,) = d.send(Shutdown(task_id=fresh(), epoch=0)).replies
        assert nack.reason is NackReason.BUSY and d.w.state is state


# ----------------------------------------------------------------------- happy paths


def test_load_then_level1_sleep_and_wake() -> None:
    d = WorkerDriver()
    assert d.w.state is W.LOADING
    d.w.step(Loaded())
    step = d.send(Sleep(task_id="s1", epoch=0, level=1))
    assert step.replies == ()
    assert step.effect == SleepEffect("s1", frozenset({"weights"}), frozenset({"kv_cache"}))
    assert d.w.state is W.OFFLOADING
    memory = MemoryReport(pool_bytes_before={"weights": 10}, pool_bytes_after={"weights": 0})
    (ack,) = d.w.step(EffectCompleted("s1", memory=memory, duration_s=0.5)).replies
    assert isinstance(ack, Ack)
    assert (ack.state, ack.status, ack.command) == (W.SLEEPING, AckStatus.OK, "Sleep")
    assert ack.asleep_tags == ("kv_cache", "weights")
    assert (ack.memory, ack.duration_s, ack.rank, ack.epoch) == (memory, 0.5, 0, 0)
    step = d.send(Wake(task_id="w1", epoch=0))
    assert step.effect == WakeEffect("w1", frozenset({"weights", "kv_cache"}))
    assert d.w.state is W.RESTORING
    (ack,) = d.w.step(EffectCompleted("w1")).replies
    assert (ack.state, ack.asleep_tags) == (W.ACTIVE, ())


def test_level2_sleep_needs_reload_before_execute() -> None:
    d = reach_worker(W.ACTIVE)
    step = d.send(Sleep(task_id="s2", epoch=0, level=2))
    assert step.effect == SleepEffect("s2", frozenset(), frozenset({"weights", "kv_cache"}))
    d.w.step(EffectCompleted("s2"))
    ack = d.run(Wake(task_id="w2", epoch=0))
    assert ack.state is W.NEEDS_RELOAD  # memory mapped, weights garbage (P-8)
    (nack,) = d.send(Execute(task_id="x", epoch=0)).replies
    assert nack.reason is NackReason.INVALID_STATE and "NEEDS_RELOAD" in nack.detail
    step = d.send(ReloadWeights(task_id="r1", epoch=0, source="/ckpt"))
    assert step.effect == ReloadEffect("r1", "/ckpt") and d.w.state is W.RELOADING
    (ack,) = d.w.step(EffectCompleted("r1")).replies
    assert ack.state is W.ACTIVE
    result = d.run(Execute(task_id="x2", epoch=0, payload=[1, 2]), output={"tokens": 3}, duration_s=0.25)
    assert isinstance(result, Result) and result.output == {"tokens": 3} and result.duration_s == 0.25


def test_partial_wake_then_the_rest() -> None:
    d = reach_worker(W.SLEEPING)
    ack = d.run(Wake(task_id="w-kv", epoch=0, tags=("kv_cache",)))
    assert (ack.state, ack.asleep_tags) == (W.PARTIAL, ("weights",))
    (nack,) = d.send(Execute(task_id="x", epoch=0)).replies
    assert nack.reason is NackReason.INVALID_STATE and "PARTIAL" in nack.detail
    ack = d.run(Wake(task_id="w-w", epoch=0, tags=("weights",)))
    assert (ack.state, ack.asleep_tags) == (W.ACTIVE, ())


def test_level2_partial_wake_of_weights_then_reload_ends_partial() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(Sleep(task_id="s", epoch=0, level=2))
    ack = d.run(Wake(task_id="w", epoch=0, tags=("weights",)))
    assert (ack.state, ack.asleep_tags) == (W.NEEDS_RELOAD, ("kv_cache",))
    ack = d.run(ReloadWeights(task_id="r", epoch=0))
    assert (ack.state, ack.asleep_tags) == (W.PARTIAL, ("kv_cache",))
    ack = d.run(Wake(task_id="w2", epoch=0))
    assert ack.state is W.ACTIVE


def test_level2_wake_of_scratch_only_stays_partial() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(Sleep(task_id="s", epoch=0, level=2))
    ack = d.run(Wake(task_id="w", epoch=0, tags=("kv_cache",)))
    assert (ack.state, ack.asleep_tags) == (W.PARTIAL, ("weights",))
    ack = d.run(Wake(task_id="w2", epoch=0))
    assert ack.state is W.NEEDS_RELOAD


def test_sleep_more_tags_from_each_asleep_state() -> None:
    # SLEEPING with only kv_cache asleep, then the weights too.
    d = reach_worker(W.ACTIVE)
    assert d.run(Sleep(task_id="a", epoch=0, tags=("kv_cache",))).asleep_tags == ("kv_cache",)
    step = d.send(Sleep(task_id="b", epoch=0))
    assert step.effect == SleepEffect("b", frozenset({"weights"}), frozenset())
    d.w.step(EffectCompleted("b"))
    # PARTIAL -> sleep the awake tag.
    d = reach_worker(W.PARTIAL)
    step = d.send(Sleep(task_id="c", epoch=0))
    assert step.effect == SleepEffect("c", frozenset(), frozenset({"kv_cache"}))
    assert d.w.step(EffectCompleted("c")).replies[0].state is W.SLEEPING
    # NEEDS_RELOAD -> level-1 sleep keeps the (garbage) weights invalid.
    d = reach_worker(W.NEEDS_RELOAD)
    assert d.run(Sleep(task_id="d", epoch=0)).state is W.SLEEPING
    assert d.run(Wake(task_id="e", epoch=0)).state is W.NEEDS_RELOAD


def test_reload_while_active_swaps_weights_in_place() -> None:
    d = reach_worker(W.ACTIVE)
    step = d.send(ReloadWeights(task_id="r", epoch=0, source="step-200"))
    assert step.effect == ReloadEffect("r", "step-200") and d.w.state is W.RELOADING
    assert d.w.step(EffectCompleted("r")).replies[0].state is W.ACTIVE


def test_reload_refused_by_the_runner_returns_to_the_state_it_came_from() -> None:
    """Issue 10: an unusable source is refused (INVALID_ARGUMENT), never fatal; the answer is
    kept, so a copy is not tried again."""
    for start in (W.NEEDS_RELOAD, W.ACTIVE):
        d = reach_worker(start)
        step = d.send(ReloadWeights(task_id="r", epoch=0, source="/nope"))
        assert d.w.state is W.RELOADING and step.effect == ReloadEffect("r", "/nope")
        (nack,) = d.w.step(EffectDeclined("r", "RunnerArgumentError: no checkpoint at /nope")).replies
        assert nack.reason is NackReason.INVALID_ARGUMENT and nack.state is start and d.w.state is start
        assert "/nope" in nack.detail and "nothing was written" in nack.detail
        assert not d.w.failure
        again = d.send(ReloadWeights(task_id="r", epoch=0, source="/nope"))
        assert again.effect is None and again.replies == (nack,) and d.w.state is start
        (reused,) = d.send(ReloadWeights(task_id="r", epoch=0, source="/good")).replies
        assert reused.reason is NackReason.TASK_ID_REUSED


def test_only_a_pending_reload_can_be_refused() -> None:
    d = reach_worker(W.ACTIVE)
    d.send(Sleep(task_id="s", epoch=0))
    with pytest.raises(InvariantViolation):
        d.w.step(EffectDeclined("s", "not a reload"))


def test_wake_refused_for_memory_returns_to_the_state_it_came_from() -> None:
    """P-16: a wake that found too little free device memory in time unmapped what it mapped;
    the rank is where it was, NACK NO_MEMORY, kept for a copy of the task."""
    level2_then_weights = reach_worker(W.ACTIVE)
    level2_then_weights.run(Sleep(task_id="l2", epoch=0, level=2))
    level2_then_weights.run(Wake(task_id="ww", epoch=0, tags=("weights",)))
    for start, d in (
        (W.SLEEPING, reach_worker(W.SLEEPING)),
        (W.PARTIAL, reach_worker(W.PARTIAL)),
        (W.NEEDS_RELOAD, level2_then_weights),
    ):
        asleep = frozenset(d.w.residency.asleep)
        assert d.w.state is start and asleep
        tags = tuple(sorted(asleep))
        step = d.send(Wake(task_id="w", epoch=0, tags=tags, memory_wait_s=5.0))
        assert d.w.state is W.RESTORING and step.effect == WakeEffect("w", asleep, 5.0)
        (nack,) = d.w.step(
            EffectDeclined("w", "needed 2 GiB, 1 GiB free; held by pid 42", NackReason.NO_MEMORY)
        ).replies
        assert nack.reason is NackReason.NO_MEMORY and nack.state is start and d.w.state is start
        assert "held by pid 42" in nack.detail and d.w.residency.asleep == asleep and not d.w.failure
        again = d.send(Wake(task_id="w", epoch=0, tags=tags, memory_wait_s=5.0))
        assert again.effect is None and again.replies == (nack,) and d.w.state is start
        (reused,) = d.send(Wake(task_id="w", epoch=0, tags=tags, memory_wait_s=9.0)).replies
        assert reused.reason is NackReason.TASK_ID_REUSED


def test_a_refusal_must_carry_the_reason_of_its_command() -> None:
    d = reach_worker(W.SLEEPING)
    d.send(Wake(task_id="w", epoch=0))
    with pytest.raises(InvariantViolation):
        d.w.step(EffectDeclined("w", "no room", NackReason.INVALID_ARGUMENT))


def test_waiting_for_memory_needs_the_swap_capability() -> None:
    d = reach_worker(W.SLEEPING, capabilities=(Capability.LEVEL2, Capability.PARTIAL_WAKE))
    (nack,) = d.send(Wake(task_id="w", epoch=0, memory_wait_s=1.0)).replies
    assert nack.reason is NackReason.UNSUPPORTED and "swap" in nack.detail and d.w.state is W.SLEEPING
    assert d.send(Wake(task_id="w2", epoch=0)).effect is not None  # without waiting it wakes


def test_a_link_plan_needs_the_multi_path_capability_and_reaches_the_effect() -> None:
    plan = (LinkShare(None, 1.0), LinkShare(1, 1.0))
    for command, start in (
        (Sleep(task_id="s", epoch=0, links=plan), W.ACTIVE),
        (Wake(task_id="w", epoch=0, links=plan), W.SLEEPING),
    ):
        without = reach_worker(start, capabilities=(Capability.LEVEL2, Capability.PARTIAL_WAKE))
        (nack,) = without.send(command).replies
        assert nack.reason is NackReason.UNSUPPORTED and "multi_path" in nack.detail and without.w.state is start
        planned = reach_worker(start, capabilities=(Capability.LEVEL2, Capability.PARTIAL_WAKE, Capability.MULTI_PATH))
        assert planned.send(command).effect.links == plan


def test_epochs_far_ahead_are_refused_and_do_not_fence_the_rank() -> None:
    """Issue 10: epoch 2**64-1 once was adopted and the rank refused every normal epoch after."""
    d = reach_worker(W.ACTIVE)
    (nack,) = d.send(Status(task_id="far", epoch=2**64 - 1)).replies
    assert nack.reason is NackReason.EPOCH_AHEAD and d.w.epoch == 0
    assert d.w.counters.epoch_ahead_refused == 1
    assert d.send(Execute(task_id="x", epoch=0)).effect is not None  # still serves its epoch
    d.w.step(EffectCompleted("x"))
    assert d.send(Status(task_id="near", epoch=MAX_EPOCH_AHEAD)).effect is not None  # inside the window


def test_reply_cache_keeps_digests_and_stays_within_its_bytes() -> None:
    """Issue 10: six 100 MB Executes once grew a worker by 700 MB; the cache now holds a
    digest of each command and replies within a byte budget."""
    d = WorkerDriver(reply_cache_bytes=64 << 10)
    d.w.step(Loaded())
    for i in range(20):
        d.send(Execute(task_id=f"x{i}", epoch=0, payload=b"p" * 100_000))
        d.w.step(EffectCompleted(f"x{i}", output=b"o" * 10_000))
    assert d.w.cache.size_bytes <= 64 << 10 and len(d.w.cache) < 20
    big = Execute(task_id="big", epoch=0, payload=b"p")
    d.send(big)
    (result,) = d.w.step(EffectCompleted("big", output=b"o" * (32 << 10))).replies  # over a quarter of the budget
    assert isinstance(result, Result) and d.w.counters.replies_not_kept == 1
    (nack,) = d.send(big).replies  # answered already: no second run, and says why no copy
    assert nack.reason is NackReason.REPLY_NOT_KEPT and d.w.busy is False
    (reused,) = d.send(Execute(task_id="big", epoch=0, payload=b"q")).replies
    assert reused.reason is NackReason.TASK_ID_REUSED


def test_status_everywhere_changes_nothing_and_is_never_cached() -> None:
    for state in W:
        d = reach_worker(state)
        before = snapshot(d.w)
        step = d.send(Status(task_id="st", epoch=0))
        if d.w.busy and step.effect is None:
            (ack,) = step.replies  # busy: answered at once from what the core knows
        else:
            assert step.effect == StatusEffect("st")
            (ack,) = d.w.step(EffectCompleted("st")).replies
        assert (ack.state, ack.command, ack.status) == (state, "Status", AckStatus.OK)
        assert snapshot(d.w) == before
        # Never cached: the same task_id measures again.
        if not d.w.busy:
            assert d.send(Status(task_id="st", epoch=0)).effect == StatusEffect("st")


def test_shutdown_from_active_then_already() -> None:
    d = reach_worker(W.ACTIVE)
    step = d.send(Shutdown(task_id="bye", epoch=0))
    assert step.effect == ShutdownEffect("bye") and d.w.state is W.STOPPED
    (ack,) = d.w.step(EffectCompleted("bye")).replies
    assert (ack.state, ack.status) == (W.STOPPED, AckStatus.OK)
    again = d.run(Shutdown(task_id="bye-2", epoch=0))
    assert (again.state, again.status) == (W.STOPPED, AckStatus.ALREADY)


def test_shutdown_while_loading() -> None:
    d = reach_worker(W.LOADING)
    assert d.run(Shutdown(task_id="bye", epoch=0)).state is W.STOPPED


# ----------------------------------------------------------------------- ALREADY (P-4)


@pytest.mark.parametrize("state", [W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD])
def test_sleep_of_asleep_tags_is_already(state: WorkerState) -> None:
    d = reach_worker(state)
    if state is W.NEEDS_RELOAD:  # nothing asleep there yet: put kv_cache to sleep... by a wake
        d = reach_worker(W.ACTIVE)
        d.run(Sleep(task_id=fresh(), epoch=0, level=2))
        d.run(Wake(task_id=fresh(), epoch=0, tags=("weights",)))
        assert d.w.state is W.NEEDS_RELOAD
    asleep = tuple(sorted(d.w.residency.asleep))
    before = snapshot(d.w)
    step = d.send(Sleep(task_id="again", epoch=0, level=2, tags=asleep))
    assert step.effect is None
    (ack,) = step.replies
    assert (ack.status, ack.state, ack.asleep_tags) == (AckStatus.ALREADY, state, asleep)
    assert snapshot(d.w)[:4] == before[:4]
    # Recorded like any answer: the duplicate gets the very same reply.
    (dup,) = d.send(Sleep(task_id="again", epoch=0, level=2, tags=asleep)).replies
    assert dup is ack


@pytest.mark.parametrize("state", [W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD])
def test_wake_of_resident_tags_is_already(state: WorkerState) -> None:
    d = reach_worker(state)
    if state is W.SLEEPING:  # only kv_cache asleep, so the weights are resident
        d = reach_worker(W.ACTIVE)
        d.run(Sleep(task_id=fresh(), epoch=0, tags=("kv_cache",)))
    resident = tuple(sorted(set(d.w.tags) - d.w.residency.asleep))
    step = d.send(Wake(task_id="w", epoch=0, tags=resident))
    assert step.effect is None
    (ack,) = step.replies
    assert (ack.status, ack.state) == (AckStatus.ALREADY, state)


def test_wake_everything_while_active_is_already() -> None:
    d = reach_worker(W.ACTIVE)
    ack = d.run(Wake(task_id="w", epoch=0))
    assert (ack.status, ack.state) == (AckStatus.ALREADY, W.ACTIVE)


# ----------------------------------------------------------------------- cache and task_ids (P-1, P-2)


def test_duplicate_while_in_progress_is_ignored_then_answered_once() -> None:
    d = reach_worker(W.ACTIVE)
    sleep = Sleep(task_id="s", epoch=0)
    assert d.send(sleep).effect is not None
    for _ in range(3):
        assert d.send(sleep) == WorkerStep()  # no reply, no effect
    assert d.send(msgspec.structs.replace(sleep, epoch=1)) == WorkerStep()  # a retry from a newer epoch too
    assert d.w.counters.duplicates_in_flight_ignored == 4
    (ack,) = d.w.step(EffectCompleted("s")).replies
    assert ack.epoch == 1  # the worker's epoch now: the newer sender will take it
    (dup,) = d.send(msgspec.structs.replace(sleep, epoch=1)).replies
    assert dup is ack
    assert d.w.counters.duplicates_answered_from_cache == 1
    (stale,) = d.send(sleep).replies  # the epoch-0 copy is fenced off now
    assert stale.reason is NackReason.STALE_EPOCH


def test_duplicate_after_completion_has_no_second_effect() -> None:
    d = reach_worker(W.ACTIVE)
    execute = Execute(task_id="x", epoch=0, payload=1)
    result = d.run(execute, output="out")
    for _ in range(2):
        step = d.send(execute)
        assert step.effect is None and step.replies[0] == result


def test_same_command_from_a_newer_epoch_is_still_a_duplicate() -> None:
    d = reach_worker(W.ACTIVE)
    ack = d.run(Sleep(task_id="s", epoch=0))
    step = d.send(Sleep(task_id="s", epoch=1))
    assert step.effect is None and step.replies[0] == ack and d.w.epoch == 1


def test_task_id_reused_after_completion() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(Sleep(task_id="t", epoch=0))
    before = snapshot(d.w)
    (nack,) = d.send(Wake(task_id="t", epoch=0)).replies
    assert nack.reason is NackReason.TASK_ID_REUSED
    assert "'t'" in nack.detail and "fresh task_id" in nack.detail
    (nack,) = d.send(Sleep(task_id="t", epoch=0, level=2)).replies  # same type, other fields
    assert nack.reason is NackReason.TASK_ID_REUSED
    assert snapshot(d.w) == before


def test_task_id_reused_while_in_progress() -> None:
    """P-2: a different command under the task_id in progress is refused, not swallowed."""
    d = reach_worker(W.ACTIVE)
    assert d.send(Sleep(task_id="t", epoch=0)).effect is not None
    for other in (Wake(task_id="t", epoch=0), Sleep(task_id="t", epoch=0, level=2), Status(task_id="t", epoch=0)):
        step = d.send(other)
        assert step.effect is None
        (nack,) = step.replies
        assert nack.reason is NackReason.TASK_ID_REUSED and nack.state is W.OFFLOADING
    (ack,) = d.w.step(EffectCompleted("t")).replies
    assert ack.state is W.SLEEPING


def test_duplicate_of_an_answered_task_while_busy_gets_the_recorded_reply() -> None:
    """P-1/P-2: an answered task keeps its one reply, even while another task runs (not BUSY)."""
    d = reach_worker(W.ACTIVE)
    sleep = Sleep(task_id="s", epoch=0)
    d.send(sleep)
    (ack,) = d.w.step(EffectCompleted("s")).replies
    d.send(Wake(task_id="w", epoch=0))  # in progress now
    step = d.send(sleep)
    assert step.effect is None and step.replies[0] is ack
    (nack,) = d.send(Execute(task_id="s", epoch=0)).replies  # reuse still refused as reuse
    assert nack.reason is NackReason.TASK_ID_REUSED


def test_refusals_are_not_cached() -> None:
    d = reach_worker(W.SLEEPING)
    (nack,) = d.send(Execute(task_id="x", epoch=0)).replies
    assert nack.reason is NackReason.INVALID_STATE
    d.run(Wake(task_id="w", epoch=0))
    assert d.send(Execute(task_id="x", epoch=0)).effect is not None  # a fresh answer now


def test_reply_cache_is_bounded_lru() -> None:
    d = WorkerDriver(reply_cache_entries=2)
    d.w.step(Loaded())
    first = d.run(Sleep(task_id="a", epoch=0))
    d.run(Wake(task_id="b", epoch=0))
    assert d.send(Sleep(task_id="a", epoch=0)).replies[0] == first  # touch "a": now most recent
    d.run(Execute(task_id="c", epoch=0))  # evicts "b"
    assert len(d.w.cache) == 2 and d.w.cache.stats.evictions == 1
    assert "b" not in d.w.cache and "a" in d.w.cache
    # Past the window a retry counts as new (documented: callers retry within the bound).
    step = d.send(Wake(task_id="b", epoch=0))
    assert step.replies[0].status is AckStatus.ALREADY


def test_bounded_cache_unit() -> None:
    cache: BoundedCache[str, int] = BoundedCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1 and cache.stats.hits == 1
    cache.put("c", 3)
    assert "b" not in cache and len(cache) == 2 and cache.get("missing") is None
    with pytest.raises(ValueError, match="max_entries"):
        BoundedCache(0)


# ----------------------------------------------------------------------- fencing (P-6)


def test_stale_epoch_is_refused_and_newer_epoch_adopted() -> None:
    d = WorkerDriver(epoch=3)
    d.w.step(Loaded())
    before = snapshot(d.w)
    (nack,) = d.send(Sleep(task_id="old", epoch=2)).replies
    assert nack.reason is NackReason.STALE_EPOCH and nack.epoch == 2
    assert "epoch 2" in nack.detail and "epoch 3" in nack.detail
    assert snapshot(d.w) == before and d.w.counters.stale_epoch_refused == 1
    d.run(Status(task_id="st", epoch=5))
    assert d.w.epoch == 5
    (nack,) = d.send(Execute(task_id="x", epoch=4)).replies
    assert nack.reason is NackReason.STALE_EPOCH


def test_stale_copy_of_an_answered_task_is_stale_not_a_duplicate() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(Sleep(task_id="s", epoch=0))
    d.run(Status(task_id="st", epoch=1))
    (nack,) = d.send(Sleep(task_id="s", epoch=0)).replies
    assert nack.reason is NackReason.STALE_EPOCH


def test_stale_epoch_wins_over_busy() -> None:
    d = WorkerDriver(epoch=1)
    d.w.step(Loaded())
    d.send(Sleep(task_id="s", epoch=1))
    (nack,) = d.send(Wake(task_id="w", epoch=0)).replies
    assert nack.reason is NackReason.STALE_EPOCH


# ----------------------------------------------------------------------- tags and capabilities


def test_unknown_tag_names_the_valid_ones() -> None:
    for command in (Sleep(task_id="s", epoch=0, tags=("weights", "lora")), Wake(task_id="w", epoch=0, tags=("lora",))):
        d = reach_worker(W.SLEEPING)
        (nack,) = d.send(command).replies
        assert nack.reason is NackReason.UNKNOWN_TAG
        assert "lora" in nack.detail and "weights" in nack.detail and "kv_cache" in nack.detail
        assert d.w.state is W.SLEEPING


def test_level2_without_the_capability_is_unsupported() -> None:
    d = WorkerDriver(capabilities=(Capability.PARTIAL_WAKE,))
    d.w.step(Loaded())
    (nack,) = d.send(Sleep(task_id="s", epoch=0, level=2)).replies
    assert nack.reason is NackReason.UNSUPPORTED and "level2" in nack.detail
    assert d.w.state is W.ACTIVE
    assert d.run(Sleep(task_id="s1", epoch=0, level=1)).state is W.SLEEPING


def test_partial_wake_without_the_capability_is_unsupported() -> None:
    d = WorkerDriver(capabilities=(Capability.LEVEL2,))
    d.w.step(Loaded())
    d.run(Sleep(task_id="s", epoch=0))
    (nack,) = d.send(Wake(task_id="w", epoch=0, tags=("kv_cache",))).replies
    assert nack.reason is NackReason.UNSUPPORTED and "partial wake" in nack.detail
    assert d.w.state is W.SLEEPING
    # Naming every asleep tag is not a partial wake.
    assert d.run(Wake(task_id="w2", epoch=0, tags=("weights", "kv_cache"))).state is W.ACTIVE


# ----------------------------------------------------------------------- BUSY


@pytest.mark.parametrize("state", TRANSIENT)
def test_busy_while_an_effect_is_pending(state: WorkerState) -> None:
    d = reach_worker(state)
    before = snapshot(d.w)
    for name, make in COMMANDS.items():
        step = d.send(make(fresh(), 0))
        assert step.effect is None
        (reply,) = step.replies
        if name == "Status":
            assert isinstance(reply, Ack) and reply.state is state  # answered, not refused
        else:
            assert reply.reason is NackReason.BUSY and "in progress" in reply.detail
    # The BUSY refusals of the Execute, the Profile and the ResetPrefixCache are kept (the stage
    # takes them as answers).
    assert snapshot(d.w)[:4] == before[:4] and len(d.w.cache) == before[4] + 3


def test_a_busy_refusal_of_an_execute_is_recorded_so_a_copy_never_runs() -> None:
    """Issue 11, the BUSY hole: the stage takes BUSY as the rank's answer to the request, so a
    copy of that Execute arriving after the task in progress must get BUSY again, not run."""
    d = reach_worker(W.ACTIVE)
    d.send(Execute(task_id="a", epoch=0))
    (busy,) = d.send(Execute(task_id="b", epoch=0)).replies
    assert busy.reason is NackReason.BUSY
    d.w.step(EffectCompleted("a"))
    again = d.send(Execute(task_id="b", epoch=0))
    assert again.effect is None and again.replies == (busy,)
    d.send(Execute(task_id="c", epoch=0))
    (sleep_busy,) = d.send(Sleep(task_id="s", epoch=0)).replies
    assert sleep_busy.reason is NackReason.BUSY
    d.w.step(EffectCompleted("c"))
    assert d.send(Sleep(task_id="s", epoch=0)).effect is not None  # lifecycle refusals stay unrecorded


def test_busy_during_execute() -> None:
    d = reach_worker(W.ACTIVE)
    d.send(Execute(task_id="x", epoch=0))
    (nack,) = d.send(Sleep(task_id="s", epoch=0)).replies
    assert nack.reason is NackReason.BUSY and "'x'" in nack.detail


# ----------------------------------------------------------------------- failures (P-11)


def test_backend_error_fails_the_worker_and_every_later_reply_says_why() -> None:
    d = reach_worker(W.ACTIVE)
    done = d.run(Sleep(task_id="s-ok", epoch=0))
    d.send(Wake(task_id="w", epoch=0))
    (nack,) = d.w.step(EffectRaised("w", BOOM)).replies
    nack = wire(nack)
    assert (nack.reason, nack.state) == (NackReason.BACKEND_ERROR, W.FAILED)
    assert BOOM in nack.detail and "Wake task 'w'" in nack.detail
    assert d.w.state is W.FAILED and BOOM in d.w.failure
    later: list = []
    # Every new reply, whatever it is, carries the failure text.
    later += d.send(Wake(task_id="w2", epoch=0)).replies  # FAILED
    later += d.send(Execute(task_id="x", epoch=0)).replies  # FAILED
    later += d.send(Sleep(task_id="s-ok", epoch=0, level=2)).replies  # TASK_ID_REUSED
    later += d.send(Status(task_id="st-busy", epoch=0)).replies  # Status starts an effect...
    assert d.w.busy
    later += d.send(Sleep(task_id="s3", epoch=0)).replies  # ...so this is BUSY
    later += d.send(Status(task_id="st-2", epoch=0)).replies  # Status while busy: Ack at once
    later += d.w.step(EffectCompleted("st-busy")).replies
    later += d.w.step(BadFrame(ProtocolError("undecodable message (1 bytes): junk"))).replies
    later += d.send(Sleep(task_id="old", epoch=0)).replies
    d.run(Status(task_id="new-epoch", epoch=1))
    later += d.send(Sleep(task_id="stale", epoch=0)).replies  # STALE_EPOCH
    reasons = [getattr(r, "reason", None) for r in later]
    assert NackReason.FAILED in reasons and NackReason.TASK_ID_REUSED in reasons
    assert NackReason.BUSY in reasons and NackReason.STALE_EPOCH in reasons
    assert NackReason.BAD_MESSAGE in reasons
    for reply in later:
        assert BOOM in wire(reply).detail, reply
    # Answers recorded before the failure are re-sent as they were (P-2).
    assert d.send(Sleep(task_id="s-ok", epoch=1)).replies[0] == done
    # Only Shutdown leaves FAILED; its Ack still says why.
    step = d.send(Shutdown(task_id="bye", epoch=1))
    assert d.w.state is W.STOPPED
    (ack,) = d.w.step(EffectCompleted("bye")).replies
    assert BOOM in ack.detail
    for reply in (
        d.send(Wake(task_id="w9", epoch=1)).replies[0],  # INVALID_STATE in STOPPED
        d.run(Shutdown(task_id="bye2", epoch=1)),
    ):  # ALREADY
        assert BOOM in reply.detail, reply
    assert step.effect == ShutdownEffect("bye")


def test_failure_text_survives_a_long_refusal_detail() -> None:
    d = reach_worker(W.FAILED)
    err = ProtocolError("invalid " + "X" * 5000 + ": Object contains unknown field `y`")
    (nack,) = d.w.step(BadFrame(err)).replies
    nack = wire(nack)
    assert len(nack.detail) <= 4096 and BOOM in nack.detail


def test_failed_task_duplicate_gets_the_same_nack() -> None:
    d = reach_worker(W.ACTIVE)
    sleep = Sleep(task_id="s", epoch=0)
    d.send(sleep)
    (nack,) = d.w.step(EffectRaised("s", BOOM)).replies
    assert d.send(sleep).replies[0] is nack


@pytest.mark.parametrize("state", [W.OFFLOADING, W.RESTORING, W.RELOADING])
def test_effect_error_in_each_transient_state(state: WorkerState) -> None:
    d = reach_worker(state)
    task_id = d.w.work.pending.command.task_id  # type: ignore[union-attr]
    (nack,) = d.w.step(EffectRaised(task_id, BOOM)).replies
    assert nack.reason is NackReason.BACKEND_ERROR and d.w.state is W.FAILED


@pytest.mark.parametrize("state", [W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD, W.LOADING])
def test_status_measurement_error_fails_the_worker(state: WorkerState) -> None:
    d = reach_worker(state)
    d.send(Status(task_id="st", epoch=0))
    (nack,) = d.w.step(EffectRaised("st", "nvmlDeviceGetComputeRunningProcesses failed")).replies
    assert nack.reason is NackReason.BACKEND_ERROR and d.w.state is W.FAILED


def test_status_error_does_not_poison_the_task_id() -> None:
    """Status is never cached, also when it fails: the task_id is not 'used' afterwards."""
    d = reach_worker(W.ACTIVE)
    d.send(Status(task_id="st", epoch=0))
    d.w.step(EffectRaised("st", BOOM))
    assert "st" not in d.w.cache
    (nack,) = d.send(Sleep(task_id="st", epoch=0)).replies
    assert nack.reason is NackReason.FAILED  # not TASK_ID_REUSED


def test_shutdown_error_stays_stopped() -> None:
    d = reach_worker(W.ACTIVE)
    d.send(Shutdown(task_id="bye", epoch=0))
    (nack,) = d.w.step(EffectRaised("bye", BOOM)).replies
    assert (nack.reason, nack.state, d.w.state) == (NackReason.BACKEND_ERROR, W.STOPPED, W.STOPPED)


def test_execute_error_stays_active() -> None:
    d = reach_worker(W.ACTIVE)
    execute = Execute(task_id="x", epoch=0, payload="bad prompt")
    d.send(execute)
    (nack,) = d.w.step(EffectRaised("x", "ValueError: prompt too long")).replies
    assert (nack.reason, nack.state) == (NackReason.EXECUTE_ERROR, W.ACTIVE)
    assert "prompt too long" in nack.detail
    assert d.w.state is W.ACTIVE and d.w.failure == ""
    assert d.send(execute).replies[0] is nack  # recorded: no second run
    assert isinstance(d.run(Execute(task_id="x3", epoch=0)), Result)


def test_load_failure() -> None:
    d = WorkerDriver()
    d.w.step(LoadFailed("weights file missing"))
    assert d.w.state is W.FAILED and "weights file missing" in d.w.failure
    (nack,) = d.send(Sleep(task_id="s", epoch=0)).replies
    assert nack.reason is NackReason.FAILED and "weights file missing" in nack.detail


def test_bad_bytes_get_bad_message_and_the_worker_goes_on() -> None:
    d = reach_worker(W.ACTIVE)
    for data in (b"\xc1", msgspec.msgpack.encode({"type": "Sleep", "v": 1, "task_id": "t9", "epoch": 0, "level": 5})):
        try:
            decode(data)
        except ProtocolError as err:
            (nack,) = d.w.step(BadFrame(err)).replies
        nack = wire(nack)
        assert nack.reason is NackReason.BAD_MESSAGE and nack.command == "?"
    assert nack.task_id == "t9" and "$.level" in nack.detail
    assert d.w.counters.bad_messages == 2 and d.w.state is W.ACTIVE
    assert d.run(Sleep(task_id="s", epoch=0)).state is W.SLEEPING


def test_completion_for_another_task_is_a_bug() -> None:
    d = reach_worker(W.OFFLOADING)
    with pytest.raises(InvariantViolation, match="pending"):
        d.w.step(EffectCompleted("not-the-pending-task"))
    with pytest.raises(InvariantViolation):
        reach_worker(W.ACTIVE).w.step(EffectRaised("nothing-pending", BOOM))


# ----------------------------------------------------------------------- same input, same output


def test_same_inputs_same_outputs() -> None:
    def run() -> list:
        d = WorkerDriver()
        d.w.step(Loaded())
        out = []
        for cmd in (
            Sleep(task_id="a", epoch=0, level=2),
            Wake(task_id="b", epoch=0),
            ReloadWeights(task_id="c", epoch=0),
            Execute(task_id="d", epoch=0),
            Sleep(task_id="a", epoch=0),
            Status(task_id="e", epoch=3),
        ):
            step = d.send(cmd)
            out.append(step)
            if step.effect is not None:
                out.append(d.w.step(EffectCompleted(cmd.task_id)))
        return out

    assert run() == run()


# ----------------------------------------------------------------------- transition coverage

# (trigger, source) pairs the table allows but the core can never take. None since the
# table stopped listing Shutdown from the transient states, which answer BUSY.
UNREACHABLE: set[tuple[str, str, str]] = set()

SCENARIOS = (
    [
        test_reload_refused_by_the_runner_returns_to_the_state_it_came_from,
        test_wake_refused_for_memory_returns_to_the_state_it_came_from,
        test_load_then_level1_sleep_and_wake,
        test_level2_sleep_needs_reload_before_execute,
        test_partial_wake_then_the_rest,
        test_level2_partial_wake_of_weights_then_reload_ends_partial,
        test_level2_wake_of_scratch_only_stays_partial,
        test_sleep_more_tags_from_each_asleep_state,
        test_reload_while_active_swaps_weights_in_place,
        test_status_everywhere_changes_nothing_and_is_never_cached,
        test_shutdown_from_active_then_already,
        test_shutdown_while_loading,
        test_backend_error_fails_the_worker_and_every_later_reply_says_why,
        test_load_failure,
        test_execute_error_stays_active,
        test_reload_while_active_swaps_weights_in_place,
    ]
    + [lambda s=s: test_sleep_of_asleep_tags_is_already(s) for s in (W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)]
    + [lambda s=s: test_wake_of_resident_tags_is_already(s) for s in (W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)]
    + [lambda s=s: test_effect_error_in_each_transient_state(s) for s in TRANSIENT]
    + [
        lambda s=s: test_status_measurement_error_fails_the_worker(s)
        for s in (W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD, W.LOADING)
    ]
    + [lambda: _shutdown_from_every_settled_state()]
)


def _shutdown_from_every_settled_state() -> None:
    for state in (W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD, W.FAILED):
        d = reach_worker(state)
        assert d.run(Shutdown(task_id="bye", epoch=0)).state is W.STOPPED


def _wake_from_needs_reload_with_tags_asleep() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(Sleep(task_id="s", epoch=0, level=2))
    d.run(Wake(task_id="w", epoch=0, tags=("weights",)))
    assert d.run(Wake(task_id="w2", epoch=0)).state is W.NEEDS_RELOAD


SCENARIOS.append(_wake_from_needs_reload_with_tags_asleep)
SCENARIOS += ADAPTER_SCENARIOS  # P-20: tests/test_worker_adapters.py
SCENARIOS.append(hold_scenario)  # pause keep: tests/test_worker_hold.py
SCENARIOS += TRANSFER_WORKER_SCENARIOS  # P-22: tests/test_transfers_core.py


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


def test_a_rank_loaded_under_a_version_floor_runs_nothing_until_an_update() -> None:
    """A restart whose version lived in memory only: the rank loads its checkpoint but says
    NEEDS_RELOAD (weights not to be served), refuses requests, and an update makes it ACTIVE."""
    d = WorkerDriver()
    (hello,) = [r for r in d.w.step(Loaded(needs_reload=True)).records if getattr(r, "reply", "") == "hello"]
    assert d.w.state is W.NEEDS_RELOAD and hello.state == "NEEDS_RELOAD"
    (nack,) = d.send(Execute(task_id="x", epoch=0, payload=1)).replies
    assert isinstance(nack, Nack) and nack.reason is NackReason.INVALID_STATE
    source = DiskSource(path="/ckpt/v3")
    step = d.send(UpdateWeights(task_id="u", epoch=0, version=3, source=source))
    assert d.w.state is W.RELOADING and step.effect is not None
    (ack,) = d.w.step(EffectCompleted("u")).replies
    assert (ack.state, ack.weights_version) == (W.ACTIVE, 3)


SCENARIOS.append(test_a_rank_loaded_under_a_version_floor_runs_nothing_until_an_update)


def test_every_worker_transition_is_exercised() -> None:
    with record_transitions() as fired:
        for scenario in SCENARIOS:
            scenario()
    fired = {f for f in fired if f[0] == "worker"}
    table = table_pairs("worker")
    assert fired <= table, f"fired outside the table: {sorted(fired - table)}"
    missing = table - fired - UNREACHABLE
    assert not missing, f"no scenario exercises {sorted(missing)}"
    # Every Transition of the table (each trigger) fired at least once.
    assert {t.trigger for t in WORKER_TRANSITIONS} == {trigger for _, trigger, _ in fired}


def test_a_level1_sleep_of_invalid_weights_discards_them_instead_of_copying_garbage() -> None:
    d = reach_worker(W.NEEDS_RELOAD)
    step = d.send(Sleep(task_id="s-again", epoch=0, level=1, tags=("weights",)))
    assert step.effect == SleepEffect("s-again", frozenset(), frozenset({"weights"}))


# ----------------------------------------------------------------------- Profile (P-15)

IDLE = (W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)


def _profile(task_id: str, start: bool, prefix: str | None = None, epoch: int = 0) -> Profile:
    return Profile(task_id=task_id, epoch=epoch, start=start, prefix=prefix)


@pytest.mark.parametrize("state", IDLE)
def test_profile_start_stop_never_changes_the_state(state: WorkerState) -> None:
    d = reach_worker(state)
    before = snapshot(d.w)
    step = d.send(_profile("p1", True, "wake"))
    assert step.replies == () and step.effect == ProfileEffect("p1", True, "wake")
    (ack,) = d.w.step(EffectCompleted("p1", duration_s=0.01)).replies
    ack = wire(ack)
    assert (ack.command, ack.status, ack.state, ack.trace_paths) == ("Profile", AckStatus.OK, state, ())
    assert d.w.profiling
    again = d.run(_profile("p2", True, "other"))  # start while running: ALREADY, nothing starts
    assert (again.status, again.state) == (AckStatus.ALREADY, state)
    step = d.send(_profile("p3", False))
    assert step.effect == ProfileEffect("p3", False, None)
    (ack,) = d.w.step(EffectCompleted("p3", trace_paths=("/tmp/s-rank0-wake-1.json.gz",))).replies
    assert wire(ack).trace_paths == ("/tmp/s-rank0-wake-1.json.gz",) and not d.w.profiling
    none = d.run(_profile("p4", False))  # stop while none runs: ALREADY, no paths
    assert (none.status, none.trace_paths, none.state) == (AckStatus.ALREADY, (), state)
    assert snapshot(d.w)[:3] == before[:3]


SCENARIOS += [lambda s=s: test_profile_start_stop_never_changes_the_state(s) for s in IDLE]


def test_profile_spans_a_sleep_and_a_wake() -> None:
    d = reach_worker(W.ACTIVE)
    assert d.run(_profile("on", True, "cycle")).state is W.ACTIVE
    assert d.run(Sleep(task_id="s", epoch=0, level=1)).state is W.SLEEPING
    assert d.w.profiling
    assert d.run(Wake(task_id="w", epoch=0)).state is W.ACTIVE
    ack = d.run(_profile("off", False), trace_paths=("/x/a.json.gz",))
    assert (ack.status, ack.state, ack.trace_paths) == (AckStatus.OK, W.ACTIVE, ("/x/a.json.gz",))


@pytest.mark.parametrize("prefix", ["a/b", "..", "x..y", "", "x" * 65, "a\x00b", "../etc", "é", "a b"])
def test_profile_prefix_that_is_no_safe_file_name_is_refused(prefix: str) -> None:
    d = reach_worker(W.ACTIVE)
    step = d.send(_profile("bad", True, prefix))
    assert step.effect is None and not d.w.profiling
    (nack,) = step.replies
    assert (nack.reason, nack.state) == (NackReason.INVALID_ARGUMENT, W.ACTIVE)
    assert "profile prefix" in nack.detail and "[A-Za-z0-9_.-]" in nack.detail
    # Refusals are not recorded: the same task with a usable prefix goes ahead.
    assert d.send(_profile("bad", True, "ok")).effect == ProfileEffect("bad", True, "ok")


def test_profile_duplicates_are_answered_from_the_cache() -> None:
    d = reach_worker(W.ACTIVE)
    d.run(_profile("on", True))
    step = d.send(_profile("off", False))
    assert d.send(_profile("off", False)) == WorkerStep()  # a copy while in progress: silent (P-1)
    (first,) = d.w.step(EffectCompleted("off", trace_paths=("/p/one.json.gz",))).replies
    (copy,) = d.send(_profile("off", False)).replies  # after: the same reply, paths included (P-2)
    assert copy == first and copy.trace_paths == ("/p/one.json.gz",)
    assert step.effect is not None and not d.w.profiling
    (reused,) = d.send(_profile("off", True)).replies
    assert reused.reason is NackReason.TASK_ID_REUSED


def test_profile_of_an_older_epoch_is_fenced() -> None:
    d = reach_worker(W.ACTIVE, epoch=3)
    (nack,) = d.send(_profile("old", True, epoch=2)).replies
    assert nack.reason is NackReason.STALE_EPOCH and not d.w.profiling


def test_profiler_error_keeps_the_state_and_says_none_runs() -> None:
    d = reach_worker(W.SLEEPING)
    d.send(_profile("on", True))
    (nack,) = d.w.step(EffectRaised("on", "RuntimeError: profiler already enabled on this thread")).replies
    assert (nack.reason, nack.state) == (NackReason.PROFILE_ERROR, W.SLEEPING)
    assert "no profile is running" in nack.detail and not d.w.profiling and not d.w.failure
    assert d.run(Wake(task_id="w", epoch=0)).state is W.ACTIVE  # serving on, not FAILED


def test_profile_refused_while_busy_failed_or_after_shutdown() -> None:
    d = reach_worker(W.OFFLOADING)
    (busy,) = d.send(_profile("p", True)).replies
    assert busy.reason is NackReason.BUSY
    d = reach_worker(W.FAILED)
    (failed,) = d.send(_profile("p", True)).replies
    assert failed.reason is NackReason.FAILED and BOOM in failed.detail
    d = reach_worker(W.ACTIVE)
    d.run(_profile("on", True))
    assert d.run(Shutdown(task_id="bye", epoch=0)).state is W.STOPPED
    assert not d.w.profiling  # the shell dropped it with the process
    (stopped,) = d.send(_profile("off", False)).replies
    assert stopped.reason is NackReason.INVALID_STATE and "STOPPED" in stopped.detail


def test_a_busy_refusal_of_a_profile_is_recorded_so_a_copy_never_runs_after_it() -> None:
    # TLC's find (model profile, asynchronous shell): a rank busy with a request answered a
    # Profile BUSY, the stage took that as the rank's answer, and a copy arriving after the
    # request ran the Profile: two verdicts for one task (P-1).
    d = reach_worker(W.ACTIVE)
    d.send(Execute(task_id="q", epoch=0))
    (busy,) = d.send(_profile("p", True)).replies
    assert busy.reason is NackReason.BUSY
    d.w.step(EffectCompleted("q"))
    step = d.send(_profile("p", True))
    assert step.effect is None and step.replies == (busy,) and not d.w.profiling


def test_step_is_the_only_door() -> None:
    """Every input reaches the core through `step` (commands: epoch fence, reply cache, BUSY
    first; every input: the invariants after it); `state` and `busy` are read-only, and
    `restore` builds a state (a case, a test's start), no input."""
    public = {name for name in dir(WorkerCore) if not name.startswith("_")}
    data = {"rank", "weights_version", "weight_group", "tags", "epoch", "capabilities", "residency", "lifecycle"}
    data |= {"cache", "counters", "failure", "profiling", "work"}
    assert public - data == {"step", "state", "busy", "in_progress", "max_in_flight", "restore", "holding"}
    for name in ("state", "busy", "in_progress", "max_in_flight"):
        prop = getattr(WorkerCore, name)
        assert isinstance(prop, property) and prop.fset is None
    with pytest.raises(InvariantViolation, match="takes no input"):
        WorkerCore(0).step(Sleep(task_id="s", epoch=0))  # type: ignore[arg-type]


def test_the_invariants_are_checked_after_every_input(monkeypatch: pytest.MonkeyPatch) -> None:
    d = WorkerDriver()
    checked: list[W] = []
    monkeypatch.setattr(WorkerCore, "_check_invariants", lambda self: checked.append(self.state))
    d.w.step(Loaded())
    d.w.step(BadFrame(ProtocolError("undecodable message (1 bytes): junk")))
    d.send(Sleep(task_id="s", epoch=0))
    d.w.step(EffectCompleted("s"))
    d.send(Wake(task_id="w", epoch=0, memory_wait_s=1.0))
    d.w.step(EffectDeclined("w", "needed 2 GiB, 1 GiB free", NackReason.NO_MEMORY))
    d.send(Wake(task_id="w2", epoch=0))
    d.w.step(EffectCompleted("w2"))
    d.send(Execute(task_id="x", epoch=0))
    d.w.step(EffectRaised("x", "ValueError: prompt too long"))
    asleep = [W.OFFLOADING, W.SLEEPING, W.RESTORING, W.SLEEPING, W.RESTORING]
    assert checked == [W.ACTIVE, W.ACTIVE, *asleep, W.ACTIVE, W.ACTIVE, W.ACTIVE]
    WorkerDriver().w.step(LoadFailed("weights file missing"))
    assert checked[-1] is W.FAILED


def test_every_refused_row_returns_where_the_command_started() -> None:
    from omni_core.fsm.settle import REFUSAL_REASON, refused_trigger
    from omni_core.fsm.worker_table import REFUSED

    assert {kind for kind, _ in REFUSED} == set(REFUSAL_REASON)
    for table in (WORKER_TRANSITIONS, STAGE_TRANSITIONS):
        for t in table:
            for kind in REFUSAL_REASON:
                if t.dest is not None and t.trigger == refused_trigger(kind, t.dest):
                    assert t.trigger.endswith(t.dest.value.lower()) and len(t.sources) == 1
    worker_rows = {t.trigger: t for t in WORKER_TRANSITIONS}
    for (kind, state), trigger in REFUSED.items():
        assert worker_rows[trigger].dest is state and trigger == refused_trigger(kind, state)


# ------------------------------------------------------- ResetPrefixCache (the generic template)


def _reset(task_id: str = "r", epoch: int = 0) -> ResetPrefixCache:
    return ResetPrefixCache(task_id=task_id, epoch=epoch)


@pytest.mark.parametrize("state", (W.ACTIVE, W.PARTIAL))
def test_reset_prefix_cache_is_performed_whole_and_never_changes_the_state(state: WorkerState) -> None:
    d = reach_worker(state)
    before = snapshot(d.w)
    step = d.send(_reset())
    assert step.replies == () and step.effect == CommandEffect("r", _reset())
    memory = MemoryReport(pool_bytes_before={"kv_cache": 64}, pool_bytes_after={"kv_cache": 64})
    (ack,) = d.w.step(EffectCompleted("r", memory=memory)).replies
    ack = wire(ack)
    assert (ack.command, ack.status, ack.state, ack.memory) == ("ResetPrefixCache", AckStatus.OK, state, memory)
    assert snapshot(d.w)[:4] == before[:4]  # state, residency, idle: only the reply cache grew
    (copy,) = d.send(_reset()).replies  # a copy afterwards: the same reply, from the cache (P-2)
    assert copy == ack


SCENARIOS += [
    lambda s=s: test_reset_prefix_cache_is_performed_whole_and_never_changes_the_state(s) for s in (W.ACTIVE, W.PARTIAL)
]


@pytest.mark.parametrize("state", (W.SLEEPING, W.NEEDS_RELOAD, W.STOPPED))
def test_reset_prefix_cache_is_refused_by_its_row_where_the_caches_are_not_resident(state: WorkerState) -> None:
    d = reach_worker(state)
    step = d.send(_reset())
    (nack,) = step.replies
    assert step.effect is None and (nack.reason, nack.state) == (NackReason.INVALID_STATE, state)
    assert f"ResetPrefixCache is not allowed in state {state.value}" in nack.detail
    assert "ACTIVE or PARTIAL" in nack.detail


def test_reset_prefix_cache_that_raises_is_its_own_nack_and_the_rank_serves_on() -> None:
    d = reach_worker(W.ACTIVE)
    d.send(_reset())
    (nack,) = d.w.step(EffectRaised("r", "RuntimeError: vLLM refused to reset its prefix cache")).replies
    assert (nack.reason, nack.state) == (NackReason.EXECUTE_ERROR, W.ACTIVE) and not d.w.failure
    assert "ResetPrefixCache task 'r' failed" in nack.detail and "still ACTIVE" in nack.detail
    assert d.run(Sleep(task_id="s", epoch=0, level=1)).state is W.SLEEPING  # serving on, not FAILED


def test_a_busy_refusal_of_reset_prefix_cache_is_recorded_so_a_copy_never_runs_after_it() -> None:
    d = reach_worker(W.ACTIVE)
    d.send(Execute(task_id="q", epoch=0))
    (busy,) = d.send(_reset()).replies
    assert busy.reason is NackReason.BUSY
    d.w.step(EffectCompleted("q"))
    step = d.send(_reset())
    assert step.effect is None and step.replies == (busy,)


def test_reset_prefix_cache_of_an_older_epoch_is_fenced_and_failed_ranks_refuse_it() -> None:
    d = reach_worker(W.ACTIVE, epoch=3)
    (nack,) = d.send(_reset(epoch=2)).replies
    assert nack.reason is NackReason.STALE_EPOCH
    (failed,) = reach_worker(W.FAILED).send(_reset()).replies
    assert failed.reason is NackReason.FAILED


# SaveWeights, the other command of the generic template: its cases live in test_save_weights_core.py.
SCENARIOS += [
    lambda s=s: save_cases.test_a_worker_performs_a_save_by_the_generic_template_and_keeps_its_state(s)
    for s in (W.ACTIVE, W.PARTIAL)
]
