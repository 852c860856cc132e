"""vLLM's weight-update bracket: POST /start_weight_update, any number of POST /update_weights,
POST /finish_weight_update {weight_version}.

In vLLM the bracket opens a layerwise reload that the updates fill and the finish processes.
In omni-core every update is whole and commits a version of its own; what the bracket adds is
that no request runs between two of its updates on a mix of old and new tensors: the start
pauses a RUNNING stage (mode wait: requests in flight finish first) and the finish resumes the
stages the start paused, after labelling the version the last update committed with
`weight_version` (absent: its integer). A stage the client paused itself stays paused.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from omni_core.serve import models as m
from omni_core.serve import rl_models as rm
from omni_core.serve.errors import ApiError
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import answer, error_answer, on_stages, run_post
from omni_core.serve.rl_calls import paused_here, sub_task
from omni_core.serve.state import ServeState
from omni_core.serve.versions import check_label


def bracket_routes(api: APIRouter, state: ServeState) -> None:
    @api.post(
        "/start_weight_update",
        response_model=rm.WeightLabelModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="Open vLLM's weight-update bracket on the stages acted on: a RUNNING stage pauses "
        "(in-flight requests finish first) so that no request runs between two updates; a stage "
        "already in a bracket is 409. is_checkpoint_format false is 400 (the ranks take checkpoint names).",
    )
    async def start_weight_update(request: Request, body: rm.StartWeightUpdateBody | None = None) -> Response:
        if not (body or rm.StartWeightUpdateBody()).is_checkpoint_format:
            raise ApiError(
                400,
                "is_checkpoint_format false is not served: the ranks take weights under the checkpoint's "
                "names (the runner's weight_specs) and convert nothing; send true",
                kind="InvalidArgumentError",
                extra={"fields": ["is_checkpoint_format"]},
            )
        return await run_post(state, request, _start_work(state, request))

    @api.post(
        "/finish_weight_update",
        response_model=rm.WeightLabelModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="Close the bracket: label the version the stage holds with weight_version (absent: "
        "its integer) and resume the stages /start_weight_update paused. Without an open bracket 409.",
    )
    async def finish_weight_update(request: Request, body: rm.FinishWeightUpdateBody | None = None) -> Response:
        label = (body or rm.FinishWeightUpdateBody()).weight_version
        if label is not None:
            check_label(label, "weight_version")
        return await run_post(state, request, _finish_work(state, request, label))


def _conflict(message: str) -> Answer:
    """A bracket call out of order: 409, nothing done."""
    return error_answer(ApiError(409, message, kind="InvalidStateError"))


def _start_work(state: ServeState, request: Request) -> Any:
    engine, names = state.require_engine(), state.targets()

    async def work() -> Answer:
        open_now = [name for name in names if name in state.weight_brackets]
        if open_now:
            return _conflict(
                f"a weight update is already open on {open_now} (POST /start_weight_update); send its "
                "POST /finish_weight_update first"
            )
        try:
            status = await state.status()
        except Exception as exc:
            return error_answer(exc)
        running = [name for name in names if status[name]["state"] == "RUNNING"]
        pause_id = sub_task(request, "pause")
        per_stage, error = await on_stages(
            state, running, "pause", lambda n: functools.partial(engine.pause, n, "wait", task_id=pause_id)
        )
        if error is not None:
            return error
        ours = set(paused_here(per_stage))
        for name in names:
            state.weight_brackets[name] = name in ours
        return answer(200, {"success": True, "message": "Weight update started", "stages": per_stage})

    return work


def _finish_work(state: ServeState, request: Request, label: str | None) -> Any:
    engine, names = state.require_engine(), state.targets()

    async def work() -> Answer:
        closed = [name for name in names if name not in state.weight_brackets]
        if closed:
            return _conflict(
                f"no weight update is open on {closed}: send POST /start_weight_update, then the "
                "updates, then POST /finish_weight_update"
            )
        try:
            status = await state.status()
        except Exception as exc:
            return error_answer(exc)
        for name in names:
            state.labels.set(name, status[name]["weights_version"], label)
        paused_here = [name for name in names if state.weight_brackets.pop(name)]
        resume_id = sub_task(request, "resume")
        per_stage, error = await on_stages(
            state, paused_here, "resume", lambda n: functools.partial(engine.resume, n, task_id=resume_id)
        )
        if error is not None:
            return error
        shown = {name: state.labels.label(name, status[name]["weights_version"]) for name in names}
        body = {"success": True, "message": "Weight update finished", "weight_version": shown[names[0]]}
        return answer(200, dict(body, stages=per_stage))

    return work
