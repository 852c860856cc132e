"""The stage's tables: its states, triggers and rows, and how each lifecycle call goes out,
as data.

`STAGE_TRANSITIONS` is the one source the stage core, the docs and the generated TLA+ read;
`STAGE_STATE_OF_RANK` is the stage state a settled rank's state stands for; `CALLS` is each
command's row for the one template of `stage_calls`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omni_core.fsm.settle import REFIT_ASLEEP, refused_rows
from omni_core.fsm.stage_step import StageCommandError
from omni_core.fsm.table import Transition
from omni_core.protocol import (
    AddAdapter,
    Command,
    InitWeightGroup,
    ListAdapters,
    PinAdapter,
    Profile,
    ReloadWeights,
    RemoveAdapter,
    ResetPrefixCache,
    SaveWeights,
    ShareWeights,
    Sleep,
    TransferIn,
    TransferOut,
    TransferRelease,
    UpdateWeights,
    Wake,
    WorkerState,
    profile_prefix_problem,
)
from omni_core.protocol import StageState as S

SERVING = (S.RUNNING, S.PAUSED, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)  # settled, no task in flight
IN_TASK = (S.DRAINING, S.TRANSITIONING, S.WAKING)

STAGE_TRANSITIONS: tuple[Transition[S], ...] = (
    Transition("started", (S.STARTING,), S.RUNNING, "every rank said Hello"),
    Transition(
        "started_needs_reload",
        (S.STARTING,),
        S.NEEDS_RELOAD,
        "every rank said Hello NEEDS_RELOAD: a restart whose version lived in memory only (a version floor)",
    ),
    Transition("drain", (S.RUNNING,), S.DRAINING, "sleep(): admission closed"),
    Transition("drained", (S.DRAINING,), S.TRANSITIONING, "no request in flight: Sleep sent to every rank"),
    Transition(
        "drain_timeout",
        (S.DRAINING,),
        S.RUNNING,
        "requests did not drain by the deadline; nothing was sent, sleep abandoned",
    ),
    Transition(
        "sleep",
        (S.PAUSED, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
        S.TRANSITIONING,
        "sleep (more) tags; nothing executes here, so nothing to drain",
    ),
    Transition(
        "sleep_already",
        (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
        None,
        "every requested tag already asleep: ALREADY (P-4)",
    ),
    Transition("slept", (S.TRANSITIONING,), S.SLEEPING, "every rank ACKed the Sleep (P-5)"),
    Transition("wake", (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD), S.WAKING, "Wake sent to every rank"),
    Transition("wake_already", SERVING, None, "every requested tag resident: ALREADY (P-4)"),
    Transition("reload", (S.NEEDS_RELOAD,), S.WAKING, "ReloadWeights sent to every rank"),
    Transition(
        "reload_refused",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank refused the source (INVALID_ARGUMENT): nothing was written",
    ),
    *refused_rows(
        Wake,
        S.WAKING,
        (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
        "every rank refused the Wake for lack of free device memory (NO_MEMORY): nothing stayed mapped",
    ),
    Transition("woke_running", (S.WAKING,), S.RUNNING, "every rank ACKed, all resident (P-5)"),
    Transition("woke_partial", (S.WAKING,), S.PARTIAL, "every rank ACKed, tags still asleep"),
    Transition(
        "woke_needs_reload", (S.WAKING,), S.NEEDS_RELOAD, "every rank ACKed; weights mapped but discarded at level 2"
    ),
    Transition(
        "woke_paused",
        (S.WAKING,),
        S.PAUSED,
        "every rank ACKed a wake or a reload, all resident, of a stage paused before it slept: paused until resume()",
    ),
    Transition(
        "update_drain",
        (S.RUNNING,),
        S.DRAINING,
        "update_weights(): admission closed (queued or refused per policy), in-flight requests finish",
    ),
    Transition("update_drained", (S.DRAINING,), S.WAKING, "no request in flight: UpdateWeights sent to every rank"),
    Transition(
        "update",
        (S.PAUSED, S.PARTIAL, S.NEEDS_RELOAD),
        S.WAKING,
        "UpdateWeights sent to every rank (weights resident; nothing executes here, nothing to drain)",
    ),
    *refused_rows(
        UpdateWeights,
        S.WAKING,
        (S.RUNNING, S.PAUSED, S.PARTIAL, S.NEEDS_RELOAD),
        "every rank refused the update before writing (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        "update_paused",
        (S.WAKING,),
        S.PAUSED,
        "every rank ACKed the update of a PAUSED stage (P-5): still paused, at the new version",
    ),
    Transition(
        "update_failed",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank failed the update once writing began (UPDATE_FAILED): weights invalid, version as before",
    ),
    Transition(
        "update_asleep",
        (S.SLEEPING,),
        S.WAKING,
        "UpdateWeights sent to every rank with the weights asleep at level 1 (host_refit): written into "
        "their host copies, nothing mapped on the device",
    ),
    *refused_rows(
        UpdateWeights,
        S.WAKING,
        (S.SLEEPING,),
        "every rank refused the update before writing its host copy (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        REFIT_ASLEEP.stage_commit,
        (S.WAKING,),
        REFIT_ASLEEP.stage_state,
        "every rank ACKed the update into its host copy (P-5): still asleep, at the new version",
    ),
    Transition(
        REFIT_ASLEEP.stage_failed,
        (S.WAKING,),
        REFIT_ASLEEP.stage_state,
        "every rank failed writing its host copy (UPDATE_FAILED): still asleep, weights invalid (a wake "
        "lands NEEDS_RELOAD), version as before",
    ),
    Transition(
        "weight_group",
        SERVING,
        None,
        "InitWeightGroup sent to every rank; the state never changes, whatever they answer",
    ),
    Transition(
        "share",
        (S.RUNNING, S.PARTIAL),
        None,
        "ShareWeights sent to every rank (valid weights awake); the state never changes, requests go on",
    ),
    Transition(
        "reset_prefix_cache",
        (S.RUNNING, S.PAUSED, S.PARTIAL),
        None,
        "ResetPrefixCache sent to every rank (caches resident); the state never changes, no memory moves",
    ),
    Transition(
        "save_weights",
        (S.RUNNING, S.PAUSED, S.PARTIAL),
        None,
        "SaveWeights sent to every rank (valid weights awake); the state never changes; once every rank "
        "ACKed, a restart reloads that directory",
    ),
    Transition(
        "add_adapter",
        (S.RUNNING, S.PAUSED, S.PARTIAL),
        None,
        "AddAdapter sent to every rank (valid weights awake, P-20); the state never changes, requests go on",
    ),
    Transition(
        "remove_adapter",
        (S.RUNNING, S.PAUSED, S.PARTIAL),
        None,
        "RemoveAdapter sent to every rank (P-20); the state never changes",
    ),
    Transition(
        "pin_adapter", (S.RUNNING, S.PAUSED, S.PARTIAL), None, "PinAdapter sent to every rank (P-20); nothing moves"
    ),
    Transition("list_adapters", SERVING, None, "ListAdapters sent to every rank (P-20): gone and stale adapters named"),
    Transition(
        "transfer_out",
        (S.RUNNING,),
        None,
        "TransferOut sent to every rank (P-22): the request's tensors held until released; sleep and update wait",
    ),
    Transition(
        "transfer_in",
        (S.RUNNING,),
        None,
        "TransferIn sent to every rank (P-22): where its request may run; elsewhere it queues or wakes by policy",
    ),
    Transition(
        "transfer_release",
        SERVING,
        None,
        "TransferRelease sent to every rank (P-22): what they hold for the request is dropped",
    ),
    Transition("execute", (S.RUNNING,), None, "admission is open only in RUNNING (P-7)"),
    Transition(
        "pause_drain",
        (S.RUNNING,),
        S.DRAINING,
        "pause(): admission closed; in-flight requests finish (wait, keep) or their callers hear ABORTED (abort)",
    ),
    Transition(
        "pause_drained",
        (S.DRAINING,),
        S.PAUSED,
        "no request in flight: paused; nothing was sent to the ranks, nothing released",
    ),
    Transition("pause_already", (S.PAUSED,), None, "already paused: ALREADY, nothing changes"),
    Transition("resume", (S.PAUSED,), S.RUNNING, "resume(): admission open again, the queue is served; nothing sent"),
    Transition("resume_already", (S.RUNNING,), None, "nothing is paused: ALREADY, nothing changes"),
    Transition(
        "resume_asleep",
        (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
        None,
        "resume() of a stage paused before it slept: the pause ends, the stage stays asleep; nothing sent",
    ),
    Transition(
        "profile", SERVING, None, "Profile sent to every rank; the state never changes, whatever they answer (P-15)"
    ),
    Transition("fail", (S.STARTING,) + SERVING + IN_TASK, S.FAILED, "NACK, deadline, or a rank died (P-8, P-9)"),
    Transition("restart", SERVING + (S.FAILED, S.STOPPED), S.STARTING, "fresh rank processes under a new epoch"),
    Transition("stop", (S.STARTING, S.FAILED) + SERVING + IN_TASK, S.STOPPED, "shutdown"),
)

# A PAUSED stage's ranks are ACTIVE too: the pause lives in the orchestrator's admission.
STAGE_STATE_OF_RANK = {
    WorkerState.ACTIVE: S.RUNNING,
    WorkerState.SLEEPING: S.SLEEPING,
    WorkerState.PARTIAL: S.PARTIAL,
    WorkerState.NEEDS_RELOAD: S.NEEDS_RELOAD,
}


@dataclass(frozen=True)
class CallRow:
    """How one kind of lifecycle call goes out: the triggers of STAGE_TRANSITIONS it fires."""

    verb: str  # what the stage cannot do, in a refusal ("cannot {verb}")
    trigger: str  # fired when the command goes to the ranks at once
    drain: str = ""  # fired instead where the table allows it: requests in flight finish first
    drained: str = ""  # fired once that drain ends, as the command goes out
    already: str = ""  # fired when nothing is left to do: ALREADY, nothing sent
    asleep: str = ""  # fired instead where the command writes the ranks' host copies (HOST_REFIT)
    # A task in a settled state that never changes it: every NACK is that rank's refusal, and
    # the command may come as a generic `CommandCall`. Such a row may add what its arguments
    # must satisfy (`check`: raise StageCommandError naming why) and where it is legal beyond
    # its trigger (`legal`, with `why` appended to the refusal).
    stateless: bool = False
    check: Callable[[Any, Any], None] | None = None
    legal: Callable[[Any], bool] | None = None
    why: str = ""
    # Run once every rank ACKed the command (core, command): what the stage remembers of it.
    done: Callable[[Any, Any], None] | None = None


def _profile_arguments(core: Any, command: Profile) -> None:
    if type(command.start) is not bool:
        raise StageCommandError(f"profile start must be True or False, got {command.start!r}")
    problem = profile_prefix_problem(command.prefix) if command.start else None
    if problem is not None:
        raise StageCommandError(f"stage {core.name!r}: {problem}")


def _weight_group_arguments(core: Any, command: InitWeightGroup) -> None:
    if command.rank_offset + len(core.ranks) > command.world_size:
        raise StageCommandError(
            f"stage {core.name!r}: world_size {command.world_size} has no room for "
            f"{len(core.ranks)} ranks from rank_offset {command.rank_offset}"
        )


def _save_arguments(core: Any, command: SaveWeights) -> None:
    if command.ranks != len(core.ranks):
        raise StageCommandError(
            f"stage {core.name!r} has {len(core.ranks)} ranks, and the SaveWeights says {command.ranks}: "
            f"send ranks={len(core.ranks)}, so that each rank writes its own shard where a restart reads it"
        )


def _saved(core: Any, command: SaveWeights) -> None:
    # Every rank wrote the version it holds: that directory now brings it back (a restart).
    core.versions.saved(command.directory, core.weights_version)


def _valid_weights_awake(core: Any) -> bool:
    return bool(core.residency.weights_resident and core.residency.weights_valid)


def _transfer_in_arguments(core: Any, command: TransferIn) -> None:
    expected = command.expect_version
    if expected is not None and expected != command.producer_version:
        raise StageCommandError(
            f"stage {core.name!r}: the request was declared for producer weights version {expected}, the "
            f"transfer carries version {command.producer_version}; nothing was sent: run the request "
            "again on the producer's version, or declare none"
        )


def _transfer_out_room(core: Any, command: TransferOut) -> None:
    problem = core.transfers.room_problem(core.name, command.request_id)
    if problem is not None:
        raise StageCommandError(problem)


_ADAPTERS_WHERE = ": valid weights must be awake (RUNNING, PAUSED, or PARTIAL with 'weights' awake)"

CALLS: Mapping[type, CallRow] = MappingProxyType(
    {
        Sleep: CallRow("sleep", "sleep", drain="drain", drained="drained", already="sleep_already"),
        Wake: CallRow("wake", "wake", already="wake_already"),
        ReloadWeights: CallRow("reload weights", "reload"),
        UpdateWeights: CallRow(
            "update weights", "update", drain="update_drain", drained="update_drained", asleep="update_asleep"
        ),
        ShareWeights: CallRow(
            "share weights",
            "share",
            stateless=True,
            legal=_valid_weights_awake,
            why=": valid weights must be awake (RUNNING, or PARTIAL with 'weights' awake)",
        ),
        InitWeightGroup: CallRow("join a weight group", "weight_group", stateless=True, check=_weight_group_arguments),
        Profile: CallRow("profile", "profile", stateless=True, check=_profile_arguments),
        AddAdapter: CallRow(
            "add an adapter", "add_adapter", stateless=True, legal=_valid_weights_awake, why=_ADAPTERS_WHERE
        ),
        RemoveAdapter: CallRow(
            "remove an adapter", "remove_adapter", stateless=True, legal=_valid_weights_awake, why=_ADAPTERS_WHERE
        ),
        PinAdapter: CallRow(
            "pin an adapter", "pin_adapter", stateless=True, legal=_valid_weights_awake, why=_ADAPTERS_WHERE
        ),
        ListAdapters: CallRow("list adapters", "list_adapters", stateless=True),
        ResetPrefixCache: CallRow(
            "reset the prefix cache",
            "reset_prefix_cache",
            stateless=True,
            why=": the ranks' caches must be resident (RUNNING, PAUSED or PARTIAL)",
        ),
        SaveWeights: CallRow(
            "save weights",
            "save_weights",
            stateless=True,
            check=_save_arguments,
            legal=_valid_weights_awake,
            why=": valid weights must be awake (RUNNING, PAUSED, or PARTIAL with 'weights' awake)",
            done=_saved,
        ),
        TransferOut: CallRow(
            "export a transfer",
            "transfer_out",
            stateless=True,
            check=_transfer_out_room,
            why=": requests run only in RUNNING",
        ),
        TransferIn: CallRow(
            "import a transfer",
            "transfer_in",
            stateless=True,
            check=_transfer_in_arguments,
            why=": a transfer lands only where its request may run (RUNNING)",
        ),
        TransferRelease: CallRow("release a transfer", "transfer_release", stateless=True),
    }
)
STATELESS: tuple[type[Command], ...] = tuple(kind for kind, row in CALLS.items() if row.stateless)
