"""The anchors' LoRA routes (P-20): vLLM's `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (its dynamic LoRA loading) and SGLang's `POST /load_lora_adapter` and
`/unload_lora_adapter`, each the protocol's AddAdapter or RemoveAdapter on `[server]
default_stage` or every stage. A path is checked against allowed_reload_sources as a reload's
is; the adapter's rank and modules are read from its adapter_config.json. vLLM answers text
("Success: LoRA adapter 'x' added successfully."), SGLang `{"success", "error_message",
"loaded_adapters"}`; errors are omni-core's JSON, SGLang's fields beside them."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omni_core.serve import models as m
from omni_core.serve.feed import dumps
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import answer, lifecycle_tid, on_stages, run_post
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState

MAX_LISTED_PATHS = 1024  # the names this server loaded, with their paths (for /v1/models, SGLang's answer)


def vllm_failed(error: Answer) -> Answer:
    """A refusal (omni-core's 409: a state, a capacity, a source the runner cannot use) is the
    anchors' 400, as both answer a LoRA load they cannot do; the body is omni-core's."""
    return Answer(400, error.body, error.headers) if error.status == 409 else error


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

    return api
