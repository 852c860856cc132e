"""vLLM-Omni's lifecycle routes (`/v1/omni/sleep`, `/v1/omni/wakeup`): stages named by
`stage_ids` (positions in the config, or names), answered as `OmniACK`s, one per rank."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omni_core.serve import models as m
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import (
    answer,
    error_answer,
    lifecycle_route,
    lifecycle_work,
    not_awake,
    run_post,
    sleep_call,
    wake_call,
)
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)], tags=["vLLM-Omni"])

    def omni_shape(per_stage: dict[str, Any]) -> dict[str, Any]:
        """vLLM-Omni's answer: SUCCESS and one OmniACK-shaped entry per rank; a stage that had
        nothing to do (ALREADY, answered without asking its ranks) gets one with rank null."""
        acks: list[dict[str, Any]] = []
        for name, report in per_stage.items():
            stage_id = state.names.index(name)
            ranks = list(report["ranks"].values()) or [
                {
                    "rank": None,
                    "status": report["status"],
                    "freed_bytes": 0,
                    "restored_bytes": 0,
                    "state": report["state"],
                }
            ]
            acks.extend(
                {
                    "task_id": report["task_id"],
                    "status": rr["status"],
                    "stage_id": stage_id,
                    "rank": rr["rank"],
                    "freed_bytes": rr["freed_bytes"],
                    "restored_bytes": rr["restored_bytes"],
                    "metadata": {"stage": name, "state": rr["state"]},
                }
                for rr in ranks
            )
        return {"status": "SUCCESS", "acks": acks, "stages": per_stage}

    @api.post(
        "/v1/omni/sleep",
        response_model=m.OmniLifecycleModel,
        responses=m.ERROR_RESPONSES,
        description='vLLM-Omni\'s sleep: {"stage_ids": [0, 1], "level": 2}; stage_ids required and not '
        "empty, level 2 unless given (its OmniSleepRequest)",
    )
    async def omni_sleep(request: Request, body: m.OmniSleepBody) -> Response:
        names = state.stage_list(body.stage_ids)
        return await lifecycle_route(
            state, request, names, "sleep", sleep_call(state, body.level, body.tags), omni_shape, level=body.level
        )

    @api.post(
        "/v1/omni/wakeup",
        response_model=m.OmniLifecycleModel,
        responses=m.ERROR_RESPONSES,
        description='vLLM-Omni\'s wake-up: {"stage_ids": [0]}; SKIPPED when none of them sleeps',
    )
    async def omni_wake(request: Request, body: m.OmniWakeBody) -> Response:
        names = state.stage_list(body.stage_ids)
        wake = lifecycle_work(state, request, names, "wake", wake_call(state, body.tags), omni_shape)

        async def work() -> Answer:
            try:
                status = await state.status()
            except Exception as exc:
                return error_answer(exc)
            if not any(not_awake(status[n]) for n in names):
                return answer(
                    200,
                    {
                        "status": "SKIPPED",
                        "acks": [],
                        "stages": {},
                        "message": f"none of the stages {names} sleeps; nothing was woken",
                    },
                )
            return await wake()

        return await run_post(state, request, work)

    return api
