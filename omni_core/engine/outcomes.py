"""What a caller of the Engine gets when a stage's core settles its task, its request or its
start: the report or output, or the error that names what went wrong and what to do. No IO."""

from __future__ import annotations

from typing import Any

from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    NoMemoryError,
    OmniCoreError,
    ProfileRefusedError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    TaskAbandonedError,
    WeightUpdateFailedError,
)
from omni_core.engine.report import LifecycleReport, ProfileReport, RestartReport
from omni_core.engine.stage_slot import StageSlot
from omni_core.fsm import TaskOutcome
from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.protocol import StageState

_REQUEST_ERRORS: dict[RequestError, type[OmniCoreError]] = {
    RequestError.REJECTED: RequestRejectedError,
    RequestError.FAILED: RequestFailedError,
    RequestError.ABORTED: RequestFailedError,
    RequestError.OVERLOADED: RequestFailedError,
    RequestError.CLOSED: EngineClosedError,
}


def task_answer(slot: StageSlot, outcome: TaskOutcome) -> tuple[Any, BaseException | None]:
    """(report, None) for a task that completed, else (None, the error its callers raise)."""
    name = slot.spec.name
    if outcome.command == "Profile" and (outcome.ok or outcome.refused):
        # The core just recorded the task under its signature ("Profile", start, prefix).
        (_, start, _), _ = slot.core.completed.get(outcome.task_id)  # type: ignore[misc]
        report = ProfileReport.from_outcome(name, outcome, start)
        if outcome.ok:
            return report, None
        return None, ProfileRefusedError(
            name, f"{outcome.error}; the stage stays {outcome.state.value}", outcome.refusals, report
        )
    if outcome.ok:
        return LifecycleReport.from_outcome(name, outcome, slot.core.weights_version), None
    if outcome.command in ("InitWeightGroup", "ShareWeights") and outcome.refused:
        return None, InvalidArgumentError(f"{outcome.error}; the stage stays {outcome.state.value}")
    if outcome.command == "UpdateWeights" and outcome.state is StageState.NEEDS_RELOAD and not outcome.refused:
        return None, WeightUpdateFailedError(name, outcome.error, slot.core.weights_version, outcome.failures)
    if outcome.refused and outcome.command == "Wake":
        return None, NoMemoryError(
            name,
            f"stage {name!r}: {outcome.error}; the stage stays "
            f"{outcome.state.value}. To fix: free what the holders keep "
            "(put that stage to sleep: `omni-core sleep STAGE`, "
            "Engine.sleep; or end that process), then wake it again",
            outcome.refusals,
        )
    if outcome.refused:
        return None, InvalidArgumentError(f"stage {name!r}: {outcome.error}; the stage stays {outcome.state.value}")
    if outcome.state is StageState.FAILED:
        return None, StageFailedError(name, outcome.error, outcome.failures, slot.nodes)
    return None, TaskAbandonedError(outcome.error)


def request_error(answer: RequestOutcome) -> OmniCoreError:
    """The error a request's caller raises when the core answered it with one."""
    assert answer.error is not None
    return _REQUEST_ERRORS[answer.error](answer.detail)


def start_error(slot: StageSlot, state: StageState) -> StageFailedError | None:
    """None when the stage started (RUNNING, or NEEDS_RELOAD under a restart's version floor),
    else the error its start's callers raise."""
    if state in (StageState.RUNNING, StageState.NEEDS_RELOAD):
        return None
    name = slot.spec.name
    return StageFailedError(
        name, slot.core.failure or f"stage {name!r} is {state.value}", slot.core.failed_ranks, slot.nodes
    )


def start_report(slot: StageSlot) -> RestartReport:
    """What a start's callers are answered once it settled RUNNING or NEEDS_RELOAD: the epoch,
    the version and, after a restart, what became of the version the stage held."""
    core, name = slot.core, slot.spec.name
    plan, reset = core.start_weights, core.versions.last_reset
    reset_now = reset is not None and reset.epoch == core.epoch
    if reset_now:
        assert reset is not None
        detail = (
            f"stage {name!r} restarted from its checkpoint as asked (from_checkpoint=True): weights "
            f"version reset from {reset.from_version} to 0"
        )
    elif core.versions.floor:
        detail = core.versions.floor_detail(name)
    elif plan is not None and plan.source is not None:
        detail = f"stage {name!r} restarted at weights version {core.weights_version}, reloaded from {plan.source}"
    else:
        detail = f"stage {name!r} started at weights version {core.weights_version}"
    return RestartReport(
        stage=name,
        state=core.state.value,
        epoch=core.epoch,
        weights_version=core.weights_version,
        version_floor=core.versions.floor,
        version_reset_from=reset.from_version if reset_now and reset is not None else None,
        weights_source=core.versions.kind,
        detail=detail,
    )
