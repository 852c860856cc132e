"""The anchors' weight-update routes: vLLM's weight transfer (`/init_weight_transfer_engine`,
`/update_weights`) and SGLang's (`/init_weights_update_group`,
`/update_weights_from_distributed`, `/update_weights_from_disk`, and the pickled
`/update_weights_from_tensor` it refuses). They act on `[server] default_stage`, or on every
stage when it is not set."""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from omni_core.protocol import CollectiveSource
from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.labelled_update import LabelledUpdate, UpdateShape, update_work
from omni_core.serve.lifecycle import MakeCall, lifecycle_route, run_post
from omni_core.serve.middleware import require_key
from omni_core.serve.sglang_routes import sglang_failed, sglang_shape
from omni_core.serve.state import ServeState
from omni_core.serve.weight_bracket import bracket_routes


def collective(
    names: list[str], dtypes: list[str], shapes: list[list[int]], fields: tuple[str, str, str]
) -> CollectiveSource:
    """An anchor's three parallel lists as the broadcast's typed source, decoded strictly."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ApiError(
            422,
            f"{', '.join(fields)} must be lists of one length (got {len(names)}, {len(dtypes)}, "
            f"{len(shapes)}): entry i describes tensor i",
            kind="RequestValidationError",
            extra={"fields": list(fields)},
        )
    tensors = [{"name": n, "dtype": d, "shape": sh} for n, d, sh in zip(names, dtypes, shapes, strict=True)]
    try:
        return msgspec.convert({"type": "collective", "tensors": tensors}, CollectiveSource, strict=True)
    except msgspec.ValidationError as exc:
        raise ApiError(
            422,
            f"{'/'.join(fields)} refused: {exc} (tensors[i] is entry i of the lists)",
            kind="RequestValidationError",
            extra={"fields": list(fields)},
        ) from None


def updated(message: str, **extra: Any) -> UpdateShape:
    """SGLang's answer to an update: its message, the label each stage now holds."""

    def shape(per_stage: dict[str, Any], versions: dict[str, int], label: str | None) -> dict[str, Any]:
        shown = label or ", ".join(str(v) for v in dict.fromkeys(versions.values()))
        text = f"{message}; weight version updated to {shown}"
        return {"success": True, "message": text, **extra, "weight_version": shown, "stages": per_stage}

    return shape


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])

    def group_call(
        address: str, port: int, world_size: int, rank_offset: int, backend: str | None, group: str
    ) -> MakeCall:
        engine = state.require_engine()
        # vLLM's init_info names no backend (its server's config does): NCCL on a GPU stage, gloo else.
        return lambda n, tid: functools.partial(
            engine.init_weight_group,
            n,
            address=address,
            port=port,
            world_size=world_size,
            rank_offset=rank_offset,
            backend=backend or ("nccl" if state.specs[n].device.startswith("cuda") else "gloo"),
            group=group,
            task_id=tid,
        )

    @api.post(
        "/update_weights_from_disk",
        response_model=m.SglangUpdateModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description='SGLang\'s update from disk on the default stage (or every stage): {"model_path", '
        '"weight_version"}; weight_version is an optional, opaque label (absent: the next '
        "version), model_path must lie under allowed_reload_sources. In-flight requests finish "
        "first, or are aborted with abort_all_requests true. " + m.FLUSH_CACHE_DOC,
    )
    async def sglang_update_from_disk(request: Request, body: m.SglangUpdateFromDiskBody) -> Response:
        if body.load_format not in (None, "safetensors"):
            raise ApiError(
                400,
                f"load_format {body.load_format!r} is not read here; the ranks read safetensors "
                "checkpoints: send null or 'safetensors'",
                extra={"fields": ["load_format"]},
            )
        update = LabelledUpdate.of(
            state.weight_source(body.model_path),
            body.weight_version,
            "weight_version",
            abort_all_requests=body.abort_all_requests,
            flush_cache=body.flush_cache,
        )
        shape = updated(f"updated {state.targets()} from {body.model_path}", num_paused_requests=0)
        return await run_post(state, request, update_work(state, request, update, shape, sglang_failed))

    @api.post(
        "/init_weight_transfer_engine",
        response_model=m.VllmMessageModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description='vLLM\'s weight-transfer init on the default stage (or every stage): {"init_info": '
        "{master_address, master_port, rank_offset, world_size}}; every rank joins the "
        "trainer's group (NCCL on a GPU stage, gloo on CPU). Then POST /update_weights.",
    )
    async def vllm_init_weight_transfer(request: Request, body: m.VllmInitWeightTransferBody) -> Response:
        info, names = body.init_info, state.targets()
        if info.packed:
            raise ApiError(
                400,
                "init_info.packed true is not served: the ranks take each tensor broadcast whole, in order, "
                "and do not unpack vLLM's packed buffers; send packed false (or none)",
                extra={"fields": ["init_info.packed"]},
            )
        make = group_call(
            info.master_address,
            info.master_port,
            info.world_size,
            info.rank_offset,
            None,
            "weights",
        )
        return await lifecycle_route(
            state,
            request,
            names,
            "weight-group",
            make,
            lambda per: {"message": "Weight transfer initialized", "stages": per},
        )

    @api.post(
        "/update_weights",
        response_model=m.VllmMessageModel,
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="vLLM's weight update over the group /init_weight_transfer_engine set up: "
        '{"update_info": {names, dtype_names, shapes, packed: false}, "version": N}; the '
        "trainer broadcasts each tensor whole, in order. `version` is omni-core's addition and "
        "required. ipc_handles_pickled is not taken: a pickle from the network runs code; send "
        "an ipc source to POST /v1/stages/{name}/update_weights instead.",
    )
    async def vllm_update_weights(request: Request, body: m.VllmUpdateWeightsBody) -> Response:
        info = body.update_info
        if info.packed:
            raise ApiError(
                400,
                "update_info.packed true is not served: the ranks take each tensor broadcast whole, "
                "in order, and do not unpack vLLM's packed buffers (packed_buffer_size_bytes, "
                "packed_num_buffers); send packed: false",
                extra={"fields": ["update_info.packed"]},
            )
        source = collective(
            info.names,
            info.dtype_names,
            info.shapes,
            ("update_info.names", "update_info.dtype_names", "update_info.shapes"),
        )
        update = LabelledUpdate(source, version=body.version)

        def shape(per: dict[str, Any], versions: dict[str, int], label: str | None) -> dict[str, Any]:
            return {"message": "Weights updated", "weights_version": versions, "stages": per}

        return await run_post(state, request, update_work(state, request, update, shape))

    @api.post(
        "/init_weights_update_group",
        response_model=m.SglangResultModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's weight-group init on the default stage (or every stage): master_address, "
        "master_port, rank_offset, world_size, group_name, backend (nccl or gloo).",
    )
    async def sglang_init_group(request: Request, body: m.SglangInitGroupBody) -> Response:
        if body.backend not in ("nccl", "gloo"):
            raise ApiError(
                400,
                f"backend {body.backend!r} is not served; send 'nccl' (GPU) or 'gloo' (CPU)",
                extra={"fields": ["backend"]},
            )
        names = state.targets()
        make = group_call(
            body.master_address,
            body.master_port,
            body.world_size,
            body.rank_offset,
            body.backend,
            body.group_name,
        )
        return await lifecycle_route(
            state,
            request,
            names,
            "weight-group",
            make,
            sglang_shape(f"{names} joined weight group {body.group_name!r}"),
            failed=sglang_failed,
        )

    @api.post(
        "/update_weights_from_distributed",
        response_model=m.SglangResultModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's update by broadcast over the group /init_weights_update_group set up: names, "
        "dtypes, shapes (parallel lists, each tensor whole, in order) and weight_version "
        "(an optional, opaque label: absent, the next version). " + m.FLUSH_CACHE_DOC,
    )
    async def sglang_update_from_distributed(request: Request, body: m.SglangUpdateFromDistributedBody) -> Response:
        source = collective(body.names, body.dtypes, body.shapes, ("names", "dtypes", "shapes"))
        update = LabelledUpdate.of(
            source,
            body.weight_version,
            "weight_version",
            abort_all_requests=body.abort_all_requests,
            flush_cache=body.flush_cache,
        )
        shape = updated(f"updated {state.targets()} by broadcast")
        return await run_post(state, request, update_work(state, request, update, shape, sglang_failed))

    bracket_routes(api, state)

    @api.post(
        "/update_weights_from_tensor",
        responses=m.NOT_SERVED_RESPONSES,
        tags=["SGLang"],
        description="Not served (501): see docs/http_routes.md",
    )
    async def sglang_update_from_tensor() -> Response:
        raise ApiError(
            501,
            "update_weights_from_tensor is not served: its serialized_named_tensors are pickles, "
            "and unpickling bytes from the network runs code. Share the tensors with "
            "omni_core.weights_sender.WeightSender (CUDA IPC or shared memory) and POST its source "
            "to /v1/stages/{name}/update_weights (or Engine.update_weights)",
            kind="NotServed",
        )

    return api
