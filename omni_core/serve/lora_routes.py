"""The anchors' LoRA routes (P-20): vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (its dynamic LoRA loading) and SGLang's `POST /load_lora_adapter` and
`/unload_lora_adapter`, each the protocol's AddAdapter or RemoveAdapter on `[server]
default_stage` or every stage; SGLang's `/load_lora_adapter_from_tensors` (an RL trainer's
adapter-only sync) with omni-core's typed `source` for its pickled tensors. A path is checked
against allowed_reload_sources as a reload's is; the adapter's rank and modules are read from
its adapter_config.json. vLLM answers text ("Success: LoRA adapter 'x' added successfully."),
SGLang `{"success", "error_message", "loaded_adapters"}`; errors are omni-core's JSON, SGLang's
fields beside them."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omni_core.protocol import AdapterTensors, DiskSource
from omni_core.protocol.messages import MAX_LORA_ALPHA
from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.feed import dumps
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import answer, lifecycle_tid, on_stages, run_post
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState

TENSOR_PATH = "__tensor__"  # SGLang's lora_path of an adapter loaded from tensors
MAX_LISTED_PATHS = 1024  # the names this server loaded, with their paths (for /v1/models, SGLang's answer)


def vllm_failed(error: Answer) -> Answer:
    """A refusal (omni-core's 409: a state, a capacity, a source the runner cannot use) is the
    anchors' 400, as both answer a LoRA load they cannot do; the body is omni-core's."""
    return Answer(400, error.body, error.headers) if error.status == 409 else error


def _refused(status: int, message: str, field: str, kind: str = "RequestValidationError") -> ApiError:
    return ApiError(status, message, kind=kind, extra={"fields": [field]})


def tensor_source(state: ServeState, body: m.LoadLoraTensorsBody) -> AdapterTensors:
    """The body's adapter tensors as the protocol's type, or the refusal saying what to send."""
    if body.serialized_tensors:
        raise _refused(
            400,
            "serialized_tensors is not served: SGLang's are pickles, and unpickling bytes from the network "
            "runs code. Share the adapter's tensors with omni_core.weights_sender.WeightSender and send "
            "msgspec.to_builtins(sender.share(tensors)) as `source`",
            "serialized_tensors",
            "NotServed",
        )
    for field in ("load_format", "added_tokens_config"):
        if getattr(body, field) is not None:
            raise _refused(400, f"{field} is not served: send null (the tensors come whole, by PEFT's names)", field)
    if body.source is None:
        raise _refused(422, "source is required: the adapter's tensors, as WeightSender.share returns them", "source")
    source = state.weight_source(body.source)
    if isinstance(source, DiskSource):
        raise _refused(
            422,
            "a disk source is a PEFT directory: POST /load_lora_adapter takes it; this route takes tensors",
            "source",
        )
    return source


def peft_fields(config: dict[str, Any]) -> dict[str, Any]:
    """rank, target_modules and lora_alpha from a PEFT config_dict, each checked; absent: None."""
    rank, modules, alpha = config.get("r"), config.get("target_modules"), config.get("lora_alpha")
    if isinstance(modules, str):
        modules = [modules]
    if rank is not None and type(rank) is not int:
        raise _refused(422, f"config_dict.r must be an integer, got {rank!r:.100}", "config_dict.r")
    if modules is not None and not (isinstance(modules, list) and all(isinstance(x, str) for x in modules)):
        raise _refused(422, "config_dict.target_modules must be a list of module names", "config_dict.target_modules")
    if alpha is not None and (type(alpha) not in (int, float) or not 0 < alpha <= MAX_LORA_ALPHA):
        raise _refused(422, f"config_dict.lora_alpha must be in (0, {MAX_LORA_ALPHA:g}]", "config_dict.lora_alpha")
    return {"rank": rank, "target_modules": modules, "lora_alpha": None if alpha is None else float(alpha)}


def refit(engine: Any, stage: str, body: m.LoadLoraTensorsBody, source: AdapterTensors, task_id: str | None) -> Any:
    """One stage's AddAdapter from tensors; without a version, one above the one it holds and
    every one sent for it."""
    version = body.version
    if version is None:
        held = [a.version for a in engine.list_adapters(stage).adapters if a.name == body.lora_name]
        version = max([*held, engine.refit_floor(stage, body.lora_name)], default=0) + 1
    fields = peft_fields(body.config_dict)
    return engine.add_adapter(
        stage, body.lora_name, tensors=source, version=version, pinned=body.pinned, task_id=task_id, **fields
    )


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])
    paths: dict[str, str] = state.lora_paths

    def work(command: str, call: Callable[[str], Callable[[], Any]], shape: Any, failed: Any) -> Any:
        names = state.targets()

        async def run() -> Answer:
            reports, error = await on_stages(state, names, command, call)
            if error is not None:
                return failed(error)
            return shape(reports)

        return run

    def add_call(request: Request, body: m.LoadLoraBody, path: str) -> Callable[[str], Callable[[], Any]]:
        engine, tid = state.require_engine(), lifecycle_tid(request)
        task_id = None if tid is None else f"{tid}/add_adapter"
        return lambda name: functools.partial(
            engine.add_adapter, name, body.lora_name, path, pinned=body.pinned, task_id=task_id
        )

    def remove_call(request: Request, lora_name: str) -> Callable[[str], Callable[[], Any]]:
        engine, tid = state.require_engine(), lifecycle_tid(request)
        task_id = None if tid is None else f"{tid}/remove_adapter"
        return lambda name: functools.partial(engine.remove_adapter, name, lora_name, task_id=task_id)

    def loaded(name: str, path: str | None) -> None:
        paths.pop(name, None)
        if path is not None and len(paths) < MAX_LISTED_PATHS:
            paths[name] = path

    def text(message: str, name: str, path: str | None) -> Callable[[dict[str, Any]], Answer]:
        def shape(reports: dict[str, Any]) -> Answer:
            loaded(name, path)
            return Answer(200, message.encode(), (("content-type", "text/plain; charset=utf-8"),))

        return shape

    def sglang(name: str, path: str | None) -> Callable[[dict[str, Any]], Answer]:
        def shape(reports: dict[str, Any]) -> Answer:
            loaded(name, path)
            return answer(
                200, {"success": True, "error_message": "", "loaded_adapters": dict(paths), "stages": reports}
            )

        return shape

    def sglang_failed(error: Answer) -> Answer:
        error = vllm_failed(error)
        body = json.loads(error.body)
        fields = {"success": False, "error_message": body["error"]["message"], "loaded_adapters": dict(paths)}
        return Answer(error.status, dumps(dict(body, **fields)), error.headers)

    @api.post(
        "/v1/load_lora_adapter",
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's dynamic LoRA load, as the protocol's AddAdapter on the default stage (or every "
        "stage): lora_path (a PEFT directory under allowed_reload_sources) loaded as lora_name, bound to "
        "the weights the stage holds; answers vLLM's text. A refusal (capacity, rank, a source the runner "
        "cannot use, a stage asleep) is omni-core's error naming it; nothing is loaded.",
    )
    async def vllm_load(request: Request, body: m.LoadLoraBody) -> Response:
        path = state.check_source(body.lora_path)
        assert path is not None
        done = f"Success: LoRA adapter '{body.lora_name}' added successfully."
        return await run_post(
            state,
            request,
            work("add_adapter", add_call(request, body, path), text(done, body.lora_name, path), vllm_failed),
        )

    @api.post(
        "/v1/unload_lora_adapter",
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's LoRA unload, as the protocol's RemoveAdapter on the default stage (or every "
        "stage); an adapter not loaded is nothing to do. Answers vLLM's text.",
    )
    async def vllm_unload(request: Request, body: m.UnloadLoraBody) -> Response:
        done = f"Success: LoRA adapter '{body.lora_name}' removed successfully."
        shape = text(done, body.lora_name, None)
        return await run_post(
            state, request, work("remove_adapter", remove_call(request, body.lora_name), shape, vllm_failed)
        )

    @api.post(
        "/load_lora_adapter",
        response_model=m.SglangLoraModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's LoRA load (pinned: never evicted), as the protocol's AddAdapter; answers "
        "{success, error_message, loaded_adapters}, on errors too (success false).",
    )
    async def sglang_load(request: Request, body: m.LoadLoraBody) -> Response:
        path = state.check_source(body.lora_path)
        assert path is not None
        call = add_call(request, body, path)
        return await run_post(state, request, work("add_adapter", call, sglang(body.lora_name, path), sglang_failed))

    @api.post(
        "/unload_lora_adapter",
        response_model=m.SglangLoraModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's LoRA unload, as the protocol's RemoveAdapter; answers as its load does.",
    )
    async def sglang_unload(request: Request, body: m.UnloadLoraBody) -> Response:
        call = remove_call(request, body.lora_name)
        return await run_post(state, request, work("remove_adapter", call, sglang(body.lora_name, None), sglang_failed))

    @api.post(
        "/load_lora_adapter_from_tensors",
        response_model=m.SglangLoraModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's LoRA load from tensors (an RL trainer's adapter-only sync), as the protocol's "
        "AddAdapter with tensors: `source` carries them through the weight planes (shm buckets, typed CUDA "
        "IPC handles, or the weight group's broadcast), checked as a weight update's are; serialized_tensors "
        "(pickles) are 400. An adapter of the name loaded is refit in place at `version` (null: one above "
        "its own); config_dict's r, lora_alpha and target_modules are read. Answers as /load_lora_adapter.",
    )
    async def sglang_load_tensors(request: Request, body: m.LoadLoraTensorsBody) -> Response:
        source = tensor_source(state, body)
        engine, tid = state.require_engine(), lifecycle_tid(request)
        task_id = None if tid is None else f"{tid}/add_adapter"

        def call(name: str) -> Callable[[], Any]:
            return functools.partial(refit, engine, name, body, source, task_id)

        shape = sglang(body.lora_name, TENSOR_PATH)
        return await run_post(state, request, work("add_adapter", call, shape, sglang_failed))

    return api
