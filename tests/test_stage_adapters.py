"""The stage's adapter calls (P-20), sans-IO: AddAdapter, RemoveAdapter, PinAdapter and
ListAdapters go to every rank as generic CommandCalls, where the stage's table allows them,
and never change the state; an adapter-bound request carries its adapter to every rank and
its outcome names the adapter and version every rank ran."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import stage_inputs
from test_stage_core import outcome_of, reach_stage

from omni_core.fsm import inputs as I
from omni_core.fsm.stage_step import StageCommandError
from omni_core.protocol import AckStatus, AddAdapter, Execute, ListAdapters, PinAdapter, RemoveAdapter, StageState
from omni_core.protocol import StageState as S

ADD = AddAdapter(task_id="a", epoch=0, name="sql", adapter_id=1, source="/a", rank=4, target_modules=("q",))


def _call(h, command, state: StageState):
    step = h.stage.step(I.CommandCall(command, 5.0), h.now)
    assert [o.rank for o in step.sends] == [0, 1, 2] and {o.command for o in step.sends} == {command}
    outcome = outcome_of(h.complete(step))
    assert (outcome.ok, outcome.command, outcome.state) == (True, type(command).__name__, state)
    assert h.stage.state is state
    return outcome


def _weights_awake(state: StageState):
    if state is not S.PARTIAL:
        return reach_stage(state)
    h = reach_stage(S.RUNNING)
    h.complete(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0))
    h.complete(stage_inputs.wake(h.stage, "w", ("weights",), h.now, 5.0))
    assert h.stage.state is S.PARTIAL
    return h


@pytest.mark.parametrize("state", (S.RUNNING, S.PAUSED, S.PARTIAL))
def test_adapter_calls_go_to_every_rank_and_keep_the_state(state: StageState) -> None:
    h = _weights_awake(state)
    added = _call(h, ADD, state)
    assert all([a.name for a in ack.adapters] == ["sql"] for ack in added.acks.values())
    _call(h, PinAdapter(task_id="p", epoch=0, name="sql"), state)
    listed = _call(h, ListAdapters(task_id="l", epoch=0), state)
    assert all(ack.adapters[0].pinned for ack in listed.acks.values())
    removed = _call(h, RemoveAdapter(task_id="r", epoch=0, name="sql"), state)
    assert all(ack.adapters == () for ack in removed.acks.values())


@pytest.mark.parametrize("state", (S.SLEEPING, S.NEEDS_RELOAD))
def test_asleep_a_stage_lists_its_adapters_and_refuses_to_add_naming_why(state: StageState) -> None:
    h = reach_stage(state)
    _call(h, ListAdapters(task_id="l", epoch=0), state)
    with pytest.raises(StageCommandError, match=f"cannot add an adapter in {state.value}: valid weights must be awake"):
        h.stage.step(I.CommandCall(ADD, 5.0), h.now)


def test_a_request_carries_its_adapter_and_its_outcome_names_it() -> None:
    h = reach_stage(S.RUNNING)
    _call(h, ADD, S.RUNNING)
    step = h.stage.step(I.Submit("q1", [1], 5.0, adapter="sql"), h.now)
    assert [o.command for o in step.sends] == [Execute(task_id="q1", epoch=0, payload=[1], adapter="sql")] * 3
    (answer,) = _answers(h, step)
    assert answer.ok and (answer.adapter, answer.adapter_version) == ("sql", 1)
    (answer,) = _answers(h, h.stage.step(I.Submit("q2", None, 5.0, adapter="chat"), h.now))
    assert not answer.ok and "ADAPTER_UNAVAILABLE" in answer.detail and "adapter 'chat'" in answer.detail
    assert h.stage.state is S.RUNNING


def _answers(h, step) -> list:
    return [a for reply in h.to_workers(step) for a in stage_inputs.on_reply(h.stage, reply, h.now).requests]


def _already_scenario() -> None:
    h = reach_stage(S.RUNNING)
    outcome = _call(h, RemoveAdapter(task_id="r", epoch=0, name="none"), S.RUNNING)
    assert {ack.status for ack in outcome.acks.values()} == {AckStatus.ALREADY}


STAGE_ADAPTER_SCENARIOS: list[Callable[[], None]] = [
    *(lambda s=s: test_adapter_calls_go_to_every_rank_and_keep_the_state(s) for s in (S.RUNNING, S.PAUSED, S.PARTIAL)),
    *(
        lambda s=s: test_asleep_a_stage_lists_its_adapters_and_refuses_to_add_naming_why(s)
        for s in (S.SLEEPING, S.NEEDS_RELOAD)
    ),
    _already_scenario,
]


def test_a_request_answered_at_two_adapter_versions_is_discarded_naming_them() -> None:
    from omni_core.protocol import Result

    h = reach_stage(S.RUNNING)
    step = h.stage.step(I.Submit("q1", [1], 5.0, adapter="sql"), h.now)
    epoch = step.sends[0].command.epoch
    answers = []
    for rank, version in ((0, 2), (1, 2), (2, 1)):
        reply = Result(task_id="q1", epoch=epoch, rank=rank, output=[rank], adapter="sql", adapter_version=version)
        answers += h.stage.step(I.Received(reply), h.now).requests
    (answer,) = answers
    assert (
        not answer.ok
        and "adapter 'sql' at versions {0: 2, 1: 2, 2: 1}: a refit reached only some ranks" in answer.detail
    )
    assert h.stage.state is S.RUNNING  # the stage serves on: the refit's own failure was reported


def _refit(h, task_id: str, version: int, *, refused_by: frozenset[int] = frozenset()):
    """A refit of 'sql' from tensors sent to every rank; the ranks in `refused_by` refuse it."""
    from omni_core.protocol import Bucket, ShmSource, TensorSpec

    spec = TensorSpec(name="base_model.model.q.lora_A.weight", dtype="float32", shape=(4, 8))
    bucket = Bucket(handle="/dev/shm/omni-weights-1-00000000-0", nbytes=128, sender_pid=1, tensors=(spec,))
    tensors = ShmSource(buckets=(bucket,))
    command = msgspec.structs.replace(ADD, task_id=task_id, source="tensors:shm", version=version, tensors=tensors)
    return _partly(h, command, refused_by)


def _partly(h, command, refused_by: frozenset[int]):
    """`command` sent to every rank; the ranks in `refused_by` refuse it (as a rank that could
    not open a bucket does: Nack INVALID_ARGUMENT, nothing written), the others perform it."""
    from omni_core.protocol import Nack, NackReason, WorkerState

    step = h.stage.step(I.CommandCall(command, 5.0), h.now)
    replies = h.to_workers(step, ranks=set(h.stage.ranks) - refused_by)
    kind = type(command).__name__
    replies += [
        Nack(
            task_id=command.task_id,
            epoch=h.stage.epoch,
            rank=rank,
            command=kind,
            reason=NackReason.INVALID_ARGUMENT,
            detail=f"{kind} 'sql' refused: bucket /dev/shm/omni-weights-1-00000000-0 cannot be opened",
            state=WorkerState.ACTIVE,
        )
        for rank in sorted(refused_by)
    ]
    return outcome_of(h.feed(replies))


def test_a_refit_some_ranks_refused_is_refused_to_every_request_until_added_on_every_rank() -> None:
    """All or none: a refit taken by ranks 0 and 1 and refused by rank 2 leaves the ranks on two
    versions of 'sql'. The stage says so in the refit's error, then refuses each request naming
    the adapter at once, sending nothing to any rank (so none runs on a mix, even where two
    ranks report one version for different tensors); other requests run on. A refit every
    rank takes makes the adapter whole again."""
    h = reach_stage(S.RUNNING)
    _call(h, ADD, S.RUNNING)
    refit = _refit(h, "refit-2", 2, refused_by=frozenset({2}))
    assert not refit.ok and "refused by ranks [2]" in refit.error
    assert "the stage now refuses requests naming adapter 'sql' until an AddAdapter of it" in refit.error
    assert h.stage.state is S.RUNNING

    step = h.stage.step(I.Submit("q1", [1], 5.0, adapter="sql"), h.now)
    assert step.sends == ()  # refused before any rank ran it
    (answer,) = step.requests
    assert not answer.ok and answer.error is I.RequestError.REJECTED
    assert "adapter 'sql' is split across the ranks" in answer.detail
    assert "taken by ranks 0 (version 2), 1 (version 2) and refused by ranks [2]" in answer.detail
    (plain,) = _answers(h, h.stage.step(I.Submit("q2", [1], 5.0), h.now))
    assert plain.ok  # the base weights serve on

    assert _refit(h, "refit-3", 3).ok  # every rank took version 3: one adapter again
    step = h.stage.step(I.Submit("q3", [1], 5.0, adapter="sql"), h.now)
    (answer,) = _answers(h, step)
    assert answer.ok and answer.adapter_version == 3


def test_a_remove_some_ranks_refused_splits_the_adapter_and_a_restart_forgets_it() -> None:
    h = reach_stage(S.RUNNING)
    _call(h, ADD, S.RUNNING)
    removed = _partly(h, RemoveAdapter(task_id="r", epoch=0, name="sql"), frozenset({0}))
    assert not removed.ok and "refuses requests naming adapter 'sql'" in removed.error
    step = h.stage.step(I.Submit("q1", [1], 5.0, adapter="sql"), h.now)
    assert step.sends == ()
    assert "RemoveAdapter was taken by ranks 1 (none), 2 (none) and refused by ranks [0]" in step.requests[0].detail
    h.restart()  # fresh ranks hold no adapters: nothing is split
    (answer,) = _answers(h, h.stage.step(I.Submit("q2", [1], 5.0, adapter="sql"), h.now))
    assert not answer.ok and "ADAPTER_UNAVAILABLE" in answer.detail  # the ranks' own refusal
