"""The routes the RL frameworks poll and call around their training loops (slime, verl,
AReaL and OpenRLHF on SGLang's `entrypoints/http_server.py`; TRL and vLLM's weight-sync
clients on vLLM's `entrypoints/serve/dev/rlhf/api_router.py`): readiness, world size, model
and server info, version labels, request aborts, SGLang's pause and continue, the profiler.
Each maps onto an engine call (pause, resume, profile, status) or a composition of them
(`rl_calls.py`); what omni-core cannot do is refused, saying why. They act on
`[server] default_stage`, or on every stage when it is not set."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

import omni_core
from omni_core.engine.report import ProfileReport
from omni_core.serve import models as m
from omni_core.serve import rl_models as rm
from omni_core.serve.errors import ApiError
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import MakeCall, answer, error_answer, lifecycle_route, run_post
from omni_core.serve.middleware import require_key
from omni_core.serve.rl_calls import abort_in_flight, not_runnable, sub_task, version_answer
from omni_core.serve.sglang_routes import sglang_failed
from omni_core.serve.state import ServeState
from omni_core.serve.trl_routes import model_name
from omni_core.serve.versions import check_label

# SGLang's pause modes as omni-core's: a running request cannot be retracted or frozen on a
# rank (no command interrupts an Execute), so both finish first, as vLLM's keep does here.
SGLANG_PAUSE_MODES = {"abort": "abort", "retract": "wait", "in_place": "keep"}


def profile_json(report: ProfileReport) -> dict[str, Any]:
    return {
        "status": report.status,
        "state": report.state,
        "traces": {str(rank): list(paths) for rank, paths in report.paths.items()},
    }


def check_profile_body(body: rm.ProfileBody) -> None:
    """The ProfileReqInput fields omni-core cannot honour, refused by name."""
    defaults = rm.ProfileBody()
    refused = [name for name in rm.ProfileBody.model_fields if getattr(body, name) != getattr(defaults, name)]
    if refused:
        raise ApiError(
            400,
            f"{refused} not served: traces go to each stage's profile_dir from the config (the server "
            "writes no path a caller names), a profile runs from this call until POST /stop_profile, "
            "and the ranks' profiler records what it records; send none of these fields",
            kind="InvalidArgumentError",
            extra={"fields": refused},
        )


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])

    @api.get(
        "/health_generate",
        response_model=rm.HealthGenerateModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="200 only when a request can run now: every stage acted on is RUNNING (admission "
        "open, every tag resident, the weights valid); else 503 naming the first stage that is not, "
        "its state and what makes it RUNNING. slime and verl poll it at start-up, sending the API key "
        "as SGLang's server asks for it on every route; public_health opens /health only.",
    )
    async def health_generate() -> Response:
        status = await state.status()
        names = state.targets()
        states = {name: status[name]["state"] for name in names}
        waiting = [name for name in names if states[name] != "RUNNING"]
        if not waiting:
            return JSONResponse({"status": "ok", "stages": states})
        first = waiting[0]
        error = {"code": 503, "type": "NotRunning", "stage": first, "message": not_runnable(states[first], first)}
        return JSONResponse({"status": "unavailable", "stages": states, "error": error}, status_code=503)

    async def world_size(include_dp: bool = True) -> Response:
        # include_dp: vLLM's; a stage is one replica, so the answer is the same either way.
        return JSONResponse({"world_size": sum(state.specs[name].ranks for name in state.targets())})

    api.add_api_route(
        "/get_world_size",
        world_size,
        methods=["GET"],
        response_model=rm.WorldSizeModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="The ranks that join a trainer's weight group (every rank of the stages acted "
        "on); include_dp changes nothing (a stage is one replica). TRL's VLLMClient asks it.",
    )
    api.add_api_route("/get_world_size/", world_size, methods=["GET"], include_in_schema=False)  # TRL before 1.0

    @api.get(
        "/get_weight_version",
        response_model=rm.WeightVersionModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="The label of the weights version the stage holds (the integer itself when the "
        "update that made it named none)",
    )
    async def get_weight_version() -> Response:
        return JSONResponse(await version_answer(state, state.targets()))

    @api.get(
        "/weight_info",
        response_model=rm.WeightVersionModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's weight_info: the label of the weights version the stage holds",
    )
    async def weight_info() -> Response:
        return JSONResponse(await version_answer(state, state.targets()))

    @api.get(
        "/get_model_info",
        response_model=rm.ModelInfoModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's model info of the first stage acted on: its runner's model "
        "(runner_args.model, else the runner's name) and the label of its weights version",
    )
    async def get_model_info() -> Response:
        first = state.targets()[0]
        spec, label = state.specs[first], (await version_answer(state, state.targets()))["weight_version"]
        tokenizer = spec.runner_args.get("tokenizer", spec.runner_args.get("model"))
        return JSONResponse(
            {
                "model_path": model_name(state, first),
                "tokenizer_path": tokenizer if isinstance(tokenizer, str) else None,
                "is_generation": None,
                "preferred_sampling_params": None,
                "weight_version": label,
            }
        )

    @api.get(
        "/get_server_info",
        response_model=rm.ServerInfoModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's server info, as far as omni-core has its fields: the version, the first "
        "stage's model and ranks, the label of its weights, and every stage acted on",
    )
    async def get_server_info() -> Response:
        names = state.targets()
        status, versions = await state.status(), await version_answer(state, names)
        stages = {
            name: {
                "runner": state.specs[name].runner,
                "ranks": state.specs[name].ranks,
                "device": state.specs[name].device,
                "state": status[name]["state"],
                "weights_version": status[name]["weights_version"],
                "weight_version": versions["stages"][name],
            }
            for name in names
        }
        return JSONResponse(
            {
                "version": omni_core.__version__,
                "model_path": model_name(state, names[0]),
                "tp_size": state.specs[names[0]].ranks,
                "dp_size": 1,
                "weight_version": versions["weight_version"],
                "default_stage": state.server.default_stage,
                "stages": stages,
                "internal_states": [{"stage": name, **stages[name]} for name in names],
            }
        )

    _control_routes(api, state)
    _profile_routes(api, state)
    return api


def _abort_work(state: ServeState, request: Request, shape: Any) -> Any:
    async def work() -> Answer:
        names = state.targets()
        counts, error = await abort_in_flight(state, request, names)
        if error is not None:
            return error
        return answer(200, shape(counts))

    return work


def _control_routes(api: APIRouter, state: ServeState) -> None:
    """Aborts, SGLang's pause and continue, and version labels."""

    def abort_shape(counts: dict[str, int]) -> dict[str, Any]:
        return {"status": "aborted", "aborted": sum(counts.values()), "success": True, "stages": counts}

    def by_id_refused(field: str, ids: Any) -> ApiError:
        return ApiError(
            400,
            f"{field} {str(ids)[:80]} not served: omni-core's requests carry no client request id "
            "(POST /v1/stages/{name}/execute takes none), so one cannot be named; abort every request "
            "in flight instead (SGLang: abort_all true; vLLM: no request_ids)",
            kind="InvalidArgumentError",
            extra={"fields": [field]},
        )

    @api.post(
        "/abort_request",
        response_model=rm.AbortModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description='SGLang\'s abort: {"abort_all": true} aborts every request in flight on the stages '
        "acted on (each caller hears 409 aborted; the stage serves on). A rid is 400: omni-core's "
        "requests carry no client id.",
    )
    async def sglang_abort(request: Request, body: rm.SglangAbortBody) -> Response:
        if body.rid:
            raise by_id_refused("rid", body.rid)
        if not body.abort_all:
            raise ApiError(
                400,
                "nothing to abort: send abort_all true (a rid cannot be named here)",
                kind="InvalidArgumentError",
                extra={"fields": ["abort_all"]},
            )
        return await run_post(state, request, _abort_work(state, request, abort_shape))

    @api.post(
        "/abort_requests",
        response_model=rm.AbortModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's abort without a pause: no request_ids (or an empty list) aborts every "
        "request in flight on the stages acted on; each caller hears 409 aborted, the stage serves on. "
        "Named ids are 400: omni-core's requests carry no client id.",
    )
    async def vllm_abort(request: Request, body: rm.VllmAbortBody | None = None) -> Response:
        ids = (body or rm.VllmAbortBody()).request_ids
        if ids:
            raise by_id_refused("request_ids", ids)
        return await run_post(state, request, _abort_work(state, request, abort_shape))

    async def generation(request: Request, command: str, message: str, call: MakeCall) -> Response:
        return await lifecycle_route(
            state,
            request,
            state.targets(),
            command,
            call,
            lambda per: {"message": message, "status": "ok", "stages": per},
            failed=sglang_failed,
        )

    @api.post(
        "/pause_generation",
        response_model=rm.GenerationModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's pause, as omni-core's PAUSED: admission closes, memory stays. mode abort "
        "(SGLang's default): in-flight requests fail at once; retract, in_place: they finish first "
        "(a running request cannot be frozen on a rank). Then POST /continue_generation.",
    )
    async def pause_generation(request: Request, body: rm.SglangPauseBody | None = None) -> Response:
        mode = SGLANG_PAUSE_MODES[(body or rm.SglangPauseBody()).mode]
        engine = state.require_engine()
        state.level0_paused.difference_update(state.targets())  # this pause ends with a continue, not a wake
        return await generation(
            request,
            "pause",
            "Generation paused successfully.",
            lambda n, tid: functools.partial(engine.pause, n, mode, task_id=tid),
        )

    @api.post(
        "/continue_generation",
        response_model=rm.GenerationModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's continue: a PAUSED stage serves again, its held requests first",
    )
    async def continue_generation(request: Request) -> Response:
        engine = state.require_engine()
        state.level0_paused.difference_update(state.targets())
        return await generation(
            request,
            "resume",
            "Generation continued successfully.",
            lambda n, tid: functools.partial(engine.resume, n, task_id=tid),
        )

    @api.post(
        "/update_weight_version",
        response_model=rm.WeightLabelModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang", "vLLM"],
        description="A new label for the weights the stage holds, the weights and omni-core's integer "
        "version unchanged; abort_all_requests (SGLang's) aborts the requests in flight first",
    )
    async def update_weight_version(request: Request, body: rm.UpdateWeightVersionBody) -> Response:
        label = check_label(body.new_version, "new_version")

        async def work() -> Answer:
            names = state.targets()
            if body.abort_all_requests:
                _, error = await abort_in_flight(state, request, names)
                if error is not None:
                    return sglang_failed(error)
            try:
                status = await state.status()
            except Exception as exc:
                return sglang_failed(error_answer(exc))
            for name in names:
                state.labels.set(name, status[name]["weights_version"], label)
            message = f"Weight version updated to {label}"
            return answer(200, {"success": True, "message": message, "new_version": label})

        return await run_post(state, request, work)

    @api.post(
        "/destroy_weights_update_group",
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="400, not served: a rank leaves its weight group only when its process ends",
    )
    async def destroy_group(body: rm.DestroyGroupBody | None = None) -> Response:
        group = (body or rm.DestroyGroupBody()).group_name
        raise ApiError(
            400,
            f"destroy_weights_update_group ({group[:64]!r}) is not served: omni-core's ranks leave a weight "
            "group only when their processes end (POST /v1/stages/{name}/restart, which also reloads the "
            "weights as loaded at start). Joining the same group again is ALREADY, so a trainer that "
            "re-inits with the same group_name, address and port needs no destroy",
            kind="NotServed",
            extra={"fields": ["group_name"]},
        )


def _profile_routes(api: APIRouter, state: ServeState) -> None:
    def profile_work(request: Request, start: bool, message: str) -> Any:
        engine, names = state.require_engine(), state.targets()
        task_id = sub_task(request, "profile")

        async def work() -> Answer:
            calls = (
                state.lifecycle(n, "profile", functools.partial(engine.profile, n, start, task_id=task_id))
                for n in names
            )
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            stages: dict[str, dict[str, Any]] = {}
            for name, outcome in zip(names, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    return error_answer(outcome, name)
                stages[name] = profile_json(outcome)
            return answer(200, {"message": message, "success": True, "stages": stages})

        return work

    @api.post(
        "/start_profile",
        response_model=rm.ProfileModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang", "vLLM"],
        description="Start the profiler on every rank of the stages acted on (Engine.profile); traces "
        "go to each stage's profile_dir. SGLang's ProfileReqInput fields other than their defaults are "
        "400 (the message says why). ALREADY when profiling.",
    )
    async def start_profile(request: Request, body: rm.ProfileBody | None = None) -> Response:
        check_profile_body(body or rm.ProfileBody())
        return await run_post(state, request, profile_work(request, True, "Start profiling."))

    @api.post(
        "/stop_profile",
        response_model=rm.ProfileModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang", "vLLM"],
        description="Stop the profiler; each rank's traces are listed (the ranks compress them after answering)",
    )
    async def stop_profile(request: Request) -> Response:
        message = "Stop profiling. This will take some time."
        return await run_post(state, request, profile_work(request, False, message))
