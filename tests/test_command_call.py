"""The generic lifecycle call: a stateless command given whole (`CommandCall`) goes out
through its row in `stage_table.CALLS`, as its own call does, checks and refusals included."""

from __future__ import annotations

import pytest
import stage_inputs
from test_stage_core import outcome_of, reach_stage

from omni_core.fsm import StageCommandError
from omni_core.fsm import inputs as I
from omni_core.fsm.stage_table import CALLS, STATELESS
from omni_core.protocol import (
    AckStatus,
    AddAdapter,
    InitWeightGroup,
    ListAdapters,
    PinAdapter,
    Profile,
    RemoveAdapter,
    ResetPrefixCache,
    SaveWeights,
    ShareWeights,
    Sleep,
    TransferIn,
    TransferOut,
    TransferRelease,
    arguments,
)
from omni_core.protocol import StageState as S


def _call(command: object, deadline_s: float = 5.0) -> I.CommandCall:
    return I.CommandCall(command, deadline_s)  # type: ignore[arg-type]


def test_the_stateless_commands_are_read_from_the_table() -> None:
    assert set(STATELESS) == {
        Profile,
        InitWeightGroup,
        ShareWeights,
        ResetPrefixCache,
        AddAdapter,
        RemoveAdapter,
        PinAdapter,
        ListAdapters,
        SaveWeights,
        TransferOut,
        TransferIn,
        TransferRelease,
    }
    assert all(CALLS[kind].stateless for kind in STATELESS)


def test_arguments_are_a_messages_own_fields_in_declaration_order() -> None:
    profile = Profile(task_id="p", epoch=3, start=True, prefix="x")
    assert arguments(profile) == {"start": True, "prefix": "x"}
    assert list(
        arguments(InitWeightGroup(task_id="g", epoch=0, group="rl", address="h", port=1, world_size=3, rank_offset=1))
    ) == [
        "group",
        "address",
        "port",
        "world_size",
        "rank_offset",
        "backend",
        "timeout_s",
        "join_timeout_s",
    ]


def test_a_command_call_goes_to_every_rank_stamped_with_the_stage_epoch() -> None:
    h = reach_stage(S.RUNNING)
    epoch = h.restart()
    h.complete(stage_inputs.sleep(h.stage, "s", 1, None, h.now, 5.0))
    assert epoch == 1 and h.stage.state is S.SLEEPING
    step = h.stage.step(_call(Profile(task_id="p", epoch=0, start=True, prefix="run")), h.now)
    assert [o.rank for o in step.sends] == [0, 1, 2]
    assert {o.command for o in step.sends} == {Profile(task_id="p", epoch=epoch, start=True, prefix="run")}
    outcome = outcome_of(h.complete(step))
    assert (outcome.ok, outcome.command, outcome.state, outcome.status) == (True, "Profile", S.SLEEPING, AckStatus.OK)


def test_a_command_call_and_the_own_call_are_one_task_by_their_signature() -> None:
    h = reach_stage(S.RUNNING)
    step = stage_inputs.profile(h.stage, "p", True, "a", h.now, 5.0)
    assert outcome_of(h.complete(step)).ok
    retries = h.stage.counters.retries
    again = h.stage.step(_call(Profile(task_id="p", epoch=0, start=True, prefix="a")), h.now)
    assert again.outcome is not None and again.outcome.ok and not again.sends
    assert h.stage.counters.retries == retries + 1
    with pytest.raises(StageCommandError, match="used for"):
        h.stage.step(_call(Profile(task_id="p", epoch=0, start=True, prefix="b")), h.now)


def test_a_command_call_keeps_the_rows_argument_checks() -> None:
    h = reach_stage(S.RUNNING)
    with pytest.raises(StageCommandError, match=r"contains '\.\.'"):
        h.stage.step(_call(Profile(task_id="p", epoch=0, start=True, prefix="..")), h.now)
    group = InitWeightGroup(task_id="g", epoch=0, group="rl", address="h", port=1, world_size=3, rank_offset=1)
    with pytest.raises(StageCommandError, match="world_size 3 has no room for 3 ranks from rank_offset 1"):
        h.stage.step(_call(group), h.now)
    assert h.stage.task_id is None


def test_a_command_call_is_held_to_the_wire_bounds() -> None:
    h = reach_stage(S.RUNNING)
    with pytest.raises(StageCommandError, match="invalid ShareWeights: Expected `int` >= 1"):
        h.stage.step(_call(ShareWeights(task_id="s", epoch=0, bucket_bytes=0)), h.now)
    assert h.stage.task_id is None


def test_a_command_call_is_refused_where_its_row_is_not_legal() -> None:
    h = reach_stage(S.SLEEPING)
    with pytest.raises(StageCommandError, match="cannot share weights in SLEEPING: valid weights must be awake"):
        h.stage.step(_call(ShareWeights(task_id="s", epoch=0)), h.now)
    assert h.stage.state is S.SLEEPING and h.stage.task_id is None


@pytest.mark.parametrize("command", [Sleep(task_id="s", epoch=0), "Profile"])
def test_a_command_call_carries_only_a_stateless_command(command: object) -> None:
    h = reach_stage(S.RUNNING)
    with pytest.raises(
        StageCommandError,
        match="a CommandCall carries one of ShareWeights, InitWeightGroup, Profile, AddAdapter, RemoveAdapter, "
        "PinAdapter, ListAdapters, ResetPrefixCache, SaveWeights, TransferOut, TransferIn, TransferRelease, not ",
    ):
        h.stage.step(_call(command), h.now)
    assert h.stage.state is S.RUNNING and h.stage.task_id is None


def test_a_scenario_sends_a_stateless_command_by_its_type_and_fields() -> None:
    from omni_testing.script import Script, ScriptError

    script = Script()
    script.run("stage ranks=2")
    lines = script.run("command Profile task=p start=true prefix=run deadline=5s")
    assert lines[0] == "stage <- CommandCall Profile p start=True prefix=run deadline=5s"
    assert "  send #3 stage->r0 Profile p e0 start prefix=run" in lines
    lines = script.run("settle")
    assert lines[-1] == "  outcome: Profile p: OK, stage RUNNING, ACKs from [0, 1], took 0s"
    with pytest.raises(ScriptError, match=r"Expected `bool`, got `str` - at `\$.start`"):
        script.run("command Profile task=q start=maybe")
    with pytest.raises(ScriptError, match="TYPE is one of"):
        script.run("command Sleep task=s")


def test_a_message_without_words_of_its_own_is_described_by_its_fields() -> None:
    from omni_core.protocol import Status
    from omni_testing.describe import describe, describe_input

    assert describe(Status(task_id="st", epoch=2)) == "Status st e2"
    group = InitWeightGroup(task_id="g", epoch=1, group="rl", address="h", port=7, world_size=3, rank_offset=1)
    call = describe_input(I.CommandCall(group, 2.5))
    assert call == (
        "CommandCall InitWeightGroup g group=rl address=h port=7 world_size=3 rank_offset=1 "
        "backend=gloo timeout_s=300 join_timeout_s=- deadline=2.5s"
    )
    assert describe_input(I.Tick()) == "Tick"


def test_every_message_type_is_exported_by_the_protocol_package() -> None:
    import omni_core.protocol as protocol
    from omni_core.protocol import MESSAGE_TYPES

    missing = [kind.__name__ for kind in MESSAGE_TYPES if kind.__name__ not in protocol.__all__]
    assert not missing, f"add {missing} to omni_core.protocol.messages.__all__"
    assert all(getattr(protocol, kind.__name__) is kind for kind in MESSAGE_TYPES)
    assert all(hasattr(protocol, name) for name in protocol.__all__)


def test_every_effect_is_exported_by_the_fsm_package() -> None:
    from typing import get_args

    import omni_core.fsm as fsm
    from omni_core.fsm.effects import Effect

    kinds = get_args(Effect)
    missing = [kind.__name__ for kind in kinds if kind.__name__ not in fsm.__all__]
    assert not missing, f"add {missing} to omni_core.fsm.effects.__all__"
    assert all(getattr(fsm, kind.__name__) is kind for kind in kinds)


def test_the_orchestrator_dispatches_a_command_call_as_a_lifecycle_task() -> None:
    from omni_core.engine.calls import LifecycleCall

    call = I.CommandCall(Profile(task_id="p", epoch=0, start=False), 4.0)
    assert isinstance(call, LifecycleCall)  # _dispatch's one list: waiters under its task_id
    assert (call.task_id, call.deadline_s) == ("p", 4.0)


def test_reset_prefix_cache_goes_out_by_its_rows_alone_and_back_through_the_ranks() -> None:
    """The real addition of the generic template: its struct and its rows (stage and worker)
    carry it from the stage to every simulated rank's core and back; refused asleep."""
    from omni_testing.script import Script

    script = Script()
    script.run("stage ranks=2")
    assert script.run("command ResetPrefixCache task=r")[1:] == [
        "  send #3 stage->r0 ResetPrefixCache r e0",
        "  send #4 stage->r1 ResetPrefixCache r e0",
    ]
    lines = script.run("settle")
    assert "  effect: perform ResetPrefixCache" in lines
    assert lines[-1] == "  outcome: ResetPrefixCache r: OK, stage RUNNING, ACKs from [0, 1], took 0s"
    script.run("sleep task=s level=1")
    script.run("settle")
    (_, refused) = script.run("command ResetPrefixCache task=r2")
    assert "cannot reset the prefix cache in SLEEPING" in refused
