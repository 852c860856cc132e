"""TRL's routes. TRL's `VLLMClient` (`trl/generation/vllm_client.py`, TRL 1.x) talks to a plain
`vllm serve` in dev mode: `/health`, `/v1/models` (its constructor), `/get_world_size`,
`/init_weight_transfer_engine`, `/start_weight_update`, `/update_weights`,
`/finish_weight_update`, `/reset_prefix_cache`; the routes served for vLLM's clients answer it,
and `GET /v1/models` is here.

TRL before 1.0 ran a server of its own (`trl vllm-serve`, `trl/scripts/vllm_serve.py`) whose
client (`trl/extras/vllm_client.py`) adds a trailing slash: `/health/`, `/get_world_size/` and
`/reset_prefix_cache/` are registered beside their unslashed routes, with the same endpoints
and dependencies. Its communicator routes are refused, saying why: that client builds vLLM's
`StatelessProcessGroup` with itself as the last rank and broadcasts with PyNccl, a rendezvous
omni-core's ranks do not join (they join a torch.distributed group with the trainer as rank 0:
`/init_weight_transfer_engine`, `/init_weights_update_group`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.middleware import require_key
from omni_core.serve.state import ServeState

OLD_TRL_GROUP = (
    "TRL's pre-1.0 client builds vLLM's StatelessProcessGroup with itself as the last rank and broadcasts "
    "with PyNccl; omni-core's ranks join a torch.distributed group with the trainer as rank 0. Use TRL 1.x "
    "(its VLLMClient sends vLLM's /init_weight_transfer_engine), or a trainer that sends "
    "/init_weights_update_group and /update_weights_from_distributed (omni_core.weights_sender.WeightSender)"
)
# The pre-1.0 routes omni-core refuses, each with what it would have done there.
OLD_TRL_REFUSED = {
    "/init_communicator/": "joins the client's weight group",
    "/update_named_param/": "receives one tensor over that group",
    "/batch_update_named_params/": "receives several tensors over that group",
    "/close_communicator/": "leaves that group",
    "/generate/": "generates with vLLM's sampling fields",
}
GENERATE_WHY = (
    "omni-core's requests run through POST /v1/stages/{name}/execute with the runner's payload "
    '({"prompt", "max_new_tokens", "sampling"}: runners/generation.py); TRL\'s n, top_p, min_p, '
    "repetition_penalty and guided decoding have no counterpart there"
)


def model_name(state: ServeState, stage: str) -> str:
    """What a stage serves, as the anchors name it: its runner's `model`, else the runner."""
    spec = state.specs[stage]
    model = spec.runner_args.get("model")
    return model if isinstance(model, str) else spec.runner


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])

    @api.get(
        "/v1/models",
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="The models the stages acted on serve, as vLLM's OpenAI server lists them (TRL's "
        "VLLMClient reads the first id in its constructor); POST /v1/completions and "
        "/v1/chat/completions take these ids as `model`",
    )
    async def models() -> Response:
        data: list[dict[str, str | None]] = [
            {"id": model_name(state, name), "object": "model", "owned_by": "omni-core", "root": model_name(state, name)}
            for name in state.targets()
        ]
        # The LoRA adapters loaded through /v1/load_lora_adapter or /load_lora_adapter, as vLLM
        # lists its LoRA modules: the adapter's name, its path, the base model as parent.
        parent = data[0]["id"] if data else None
        data += [
            {"id": name, "object": "model", "owned_by": "omni-core", "root": path, "parent": parent}
            for name, path in sorted(state.lora_paths.items())
        ]
        return JSONResponse({"object": "list", "data": data})

    def refused(path: str, does: str) -> Any:
        async def refuse(request: Request) -> Response:
            why = GENERATE_WHY if path == "/generate/" else OLD_TRL_GROUP
            raise ApiError(400, f"POST {path} (TRL's pre-1.0 server: it {does}) is not served: {why}", kind="NotServed")

        return refuse

    for path, does in OLD_TRL_REFUSED.items():
        api.add_api_route(
            path,
            refused(path, does),
            methods=["POST"],
            responses=m.ERROR_RESPONSES,
            tags=["TRL"],
            description=f"400, not served: TRL's pre-1.0 `trl vllm-serve` route (it {does}); the message says why",
        )
    return api
