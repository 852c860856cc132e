"""What the RL frameworks' routes compose from the engine's calls: aborting the requests in
flight (a pause with mode abort, then the resume: the stage serves on, each caller hears 409
aborted), the labels of the versions a stage holds, and the step each non-serving state
needs before a request can run."""

from __future__ import annotations

import functools
from typing import Any

from fastapi import Request

from omni_core.serve.errors import ApiError
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import CACHE_RESET_STEPS, error_answer, lifecycle_tid, on_stages
from omni_core.serve.state import ServeState

# What makes a stage in each state RUNNING again, for the answers that say why a request
# cannot run now.
TO_RUNNING = dict(
    CACHE_RESET_STEPS,
    PAUSED="resume it (POST /resume, or POST /continue_generation)",
    SLEEPING="wake it (POST /wake_up, or POST /resume_memory_occupation)",
    PARTIAL="wake its other tags (POST /wake_up)",
)


def sub_task(request: Request, step: str) -> str | None:
    """The task id of one step of a compound call, under the request's Idempotency-Key."""
    tid = lifecycle_tid(request)
    return None if tid is None else f"{tid}/{step}"


async def abort_in_flight(
    state: ServeState, request: Request, names: list[str]
) -> tuple[dict[str, int], Answer | None]:
    """Abort every request in flight on `names`: each stage with one goes through a pause with
    mode abort (its callers hear 409 aborted at once) and the resume (requests that arrive
    meanwhile queue and run after it). Returns the requests aborted per stage, or the first
    error. A stage whose own lifecycle call is draining it is refused (409): its requests
    finish under that call."""
    engine = state.require_engine()
    try:
        status = await state.status()
    except Exception as exc:
        return {}, error_answer(exc)
    counts = {name: status[name]["in_flight"] for name in names}
    busy = [name for name in names if counts[name]]
    for name in busy:
        if status[name]["state"] != "RUNNING":
            refusal = ApiError(
                409,
                f"stage {name!r} is {status[name]['state']}: its {counts[name]} requests in flight belong to the "
                "lifecycle call in progress; retry once it is RUNNING",
                kind="InvalidStateError",
                extra={"stage": name, "state": status[name]["state"]},
            )
            return {}, error_answer(refusal, name)
    pause_id, resume_id = sub_task(request, "abort"), sub_task(request, "resume")
    paused, error = await on_stages(
        state, busy, "pause", lambda n: functools.partial(engine.pause, n, "abort", task_id=pause_id)
    )
    if error is None:
        _, error = await on_stages(
            state, paused_here(paused), "resume", lambda n: functools.partial(engine.resume, n, task_id=resume_id)
        )
    return counts, error


def paused_here(reports: dict[str, Any]) -> list[str]:
    """The stages a pause of ours paused (OK): one another client paused first answered ALREADY,
    and its pause is that client's to end."""
    return [name for name, report in reports.items() if isinstance(report, dict) and report.get("status") == "OK"]


async def held_versions(state: ServeState, names: list[str]) -> dict[str, int]:
    status = await state.status()
    return {name: status[name]["weights_version"] for name in names}


async def version_answer(state: ServeState, names: list[str]) -> dict[str, Any]:
    """The labels of the versions `names` hold: the first stage's, and each one's."""
    held = await held_versions(state, names)
    labels = {name: state.labels.label(name, version) for name, version in held.items()}
    first = names[0]
    return {"weight_version": labels[first], "weights_version": held[first], "stages": labels}


def not_runnable(state_name: str, stage: str) -> str:
    what = TO_RUNNING.get(state_name, "wait until it is RUNNING").replace("{name}", stage)
    return f"stage {stage!r} is {state_name}, not RUNNING: no request can run on it now; {what}"
