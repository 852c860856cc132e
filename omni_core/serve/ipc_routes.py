"""SGLang's `POST /update_weights_from_ipc` (`UpdateWeightsFromIPCReqInput`), over omni-core's
typed buckets instead of its ZMQ sockets.

SGLang's body names a ZMQ socket per GPU (`zmq_handles`), through which checkpoint-engine then
sends the tensors' CUDA IPC handles as pickles (`recv_pyobj`); unpickling bytes from a peer runs
code, so those sockets are never opened here. The same update carries, in `source`, the buckets
`WeightSender.share` describes: CUDA IPC handles as typed fields (`CudaIpcHandle`) on a GPU,
shared-memory files on the host, each checked on decode and again on the rank before anything
is opened (docs/security.md). SGLang's other fields keep their meaning: `weight_version` an
optional, opaque label, `flush_cache`, `abort_all_requests`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from pydantic import Field

from omni_core.protocol import IpcSource, ShmSource, WeightSource
from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.labelled_update import LabelledUpdate, update_work
from omni_core.serve.lifecycle import run_post
from omni_core.serve.middleware import require_key
from omni_core.serve.models import _Strict
from omni_core.serve.sglang_routes import sglang_failed
from omni_core.serve.state import ServeState
from omni_core.serve.versions import check_label
from omni_core.serve.weight_routes import updated

SOURCE_DOC = (
    "omni-core's typed buckets: msgspec.to_builtins of what WeightSender.share returns, "
    '{"type": "ipc", "buckets": [...]} (CUDA IPC, each handle in typed fields) or {"type": "shm", ...}'
)


class SglangUpdateFromIpcBody(_Strict):
    """SGLang's POST /update_weights_from_ipc, with omni-core's `source` for its ZMQ handles."""

    source: dict[str, Any] | None = Field(None, description=SOURCE_DOC)
    zmq_handles: dict[str, str] | None = Field(
        None, description="refused unless empty: checkpoint-engine's sockets carry pickles; send `source`"
    )
    flush_cache: bool = Field(True, description=m.FLUSH_CACHE_DOC)
    abort_all_requests: bool = Field(False, description="true: in-flight requests are aborted (409) first")
    weight_version: str | None = Field(None, description="the new version's label (opaque); null: the next version")
    torch_empty_cache: bool = Field(False, description="false only: the ranks' memory is released by a sleep")


def ipc_source(state: ServeState, body: SglangUpdateFromIpcBody) -> WeightSource:
    """The body's buckets as the protocol's type, or the refusal that says what to send."""
    if body.zmq_handles:
        raise ApiError(
            400,
            f"zmq_handles ({len(body.zmq_handles)} sockets) are not served: checkpoint-engine sends the "
            "tensors' CUDA IPC handles over them as pickles, and unpickling bytes from a peer runs code. "
            "Share the tensors with omni_core.weights_sender.WeightSender and send "
            "msgspec.to_builtins(sender.share(tensors)) as `source`",
            kind="NotServed",
            extra={"fields": ["zmq_handles"]},
        )
    if body.torch_empty_cache:
        raise ApiError(
            400,
            "torch_empty_cache true is not served: the ranks' allocator returns memory only through a "
            "sleep (POST /release_memory_occupation); send false",
            kind="InvalidArgumentError",
            extra={"fields": ["torch_empty_cache"]},
        )
    if body.source is None:
        raise ApiError(
            422,
            f"source is required: {SOURCE_DOC}",
            kind="RequestValidationError",
            extra={"fields": ["source"]},
        )
    source = state.weight_source(body.source)
    if not isinstance(source, IpcSource | ShmSource):
        raise ApiError(
            422,
            f"source of type {body.source.get('type')!r} is not an inter-process bucket: this route takes "
            "'ipc' or 'shm'; a checkpoint goes to /update_weights_from_disk, a broadcast to "
            "/update_weights_from_distributed",
            kind="RequestValidationError",
            extra={"fields": ["source.type"]},
        )
    return source


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])

    @api.post(
        "/update_weights_from_ipc",
        response_model=m.SglangResultModel,
        responses=m.ERROR_RESPONSES,
        tags=["SGLang"],
        description="SGLang's update from IPC on the default stage (or every stage), with the buckets "
        "WeightSender shares as `source` (typed CUDA IPC handles or shared memory; no pickle): "
        "zmq_handles are 400 (checkpoint-engine sends pickles over them). weight_version is an "
        "optional, opaque label (absent: the next version). " + m.FLUSH_CACHE_DOC,
    )
    async def sglang_update_from_ipc(request: Request, body: SglangUpdateFromIpcBody) -> Response:
        label = None if body.weight_version is None else check_label(body.weight_version, "weight_version")
        update = LabelledUpdate(
            ipc_source(state, body),
            label,
            abort_all_requests=body.abort_all_requests,
            flush_cache=body.flush_cache,
        )
        shape = updated(f"updated {state.targets()} from IPC buckets")
        return await run_post(state, request, update_work(state, request, update, shape, sglang_failed))

    return api
