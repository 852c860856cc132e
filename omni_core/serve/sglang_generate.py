"""SGLang's generation route, `POST /generate` (`entrypoints/http_server.py`, the body of
`GenerateReqInput`), on the stage a request naming no model gets (`[server] default_stage`,
else the one stage whose runner generates text), as the OpenAI routes run it: each prompt one
request of the stage, through its admission policy, in flight together.

`lora_path` names the LoRA adapter (P-20) a prompt runs with, as SGLang takes it: the
`lora_name` of an adapter loaded through `/load_lora_adapter` (or vLLM's route), one for every
prompt or a list with one per prompt (null: the base weights). A name no adapter here has is
a 400 naming it and the adapters loaded. The answer is SGLang's (`text`, `output_ids`,
`meta_info`; a list for a batch), its `meta_info` naming the weights version and the adapter's
name and version beside SGLang's fields.

What the runners cannot do is refused naming it, never dropped: `stream`, `return_logprob`,
`n` above 1, `top_p` below 1, `min_p`, penalties.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from omni_core.serve import models as m
from omni_core.serve.errors import ApiError
from omni_core.serve.middleware import require_key
from omni_core.serve.openai_models import MAX_NEW_TOKENS, MAX_PROMPTS, MAX_STOPS, CompletionBody
from omni_core.serve.openai_routes import completion_prompts, resolve_stage, run_prompts
from omni_core.serve.state import ServeState

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's SamplingParams default


class SglangSampling(BaseModel):
    """SGLang's `sampling_params` that omni-core's runners honour, and those they refuse."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(SGLANG_MAX_NEW_TOKENS, ge=1, le=MAX_NEW_TOKENS, description="new tokens at most")
    temperature: float = Field(1.0, ge=0, le=100, description="0: greedy")
    top_k: int = Field(-1, ge=-1, le=1 << 20, description="-1: every token")
    top_p: float = Field(1.0, ge=0, le=1, description="only 1 (every token) is served")
    min_p: float = Field(0.0, ge=0, le=1, description="only 0 is served")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOPS} strings; the text ends before one")
    ignore_eos: bool = Field(False, description="go on past the end-of-sequence token")
    n: int = Field(1, ge=1, le=128, description="only 1 is served")
    sampling_seed: int | None = Field(None, ge=0, lt=2**63, description="a sampled request's seed")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="only 0 is served")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="only 0 is served")
    repetition_penalty: float = Field(1.0, gt=0, le=2, description="only 1 is served")


class SglangGenerateBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = Field(None, description="a prompt, or a batch of them")
    input_ids: list[int] | list[list[int]] | None = Field(None, description="token ids, or a batch of them")
    sampling_params: SglangSampling = Field(default_factory=SglangSampling)
    lora_path: str | list[str | None] | None = Field(
        None,
        max_length=MAX_PROMPTS,
        description="the lora_name of a loaded adapter for every prompt, or a list with one per prompt "
        "(null: the base weights)",
    )
    stream: bool = Field(False, description="not served: false")
    return_logprob: bool = Field(False, description="not served: false")
    timeout_s: float | None = Field(None, gt=0, le=86400, description="omni-core's: each request's deadline")


def _bad(message: str) -> ApiError:
    return ApiError(400, message, kind="InvalidArgumentError")


def _prompts(body: SglangGenerateBody) -> tuple[Any, bool]:
    """The prompt (a completion body's `prompt`), and whether it is a batch."""
    if (body.text is None) == (body.input_ids is None):
        raise _bad("give exactly one of `text` and `input_ids`")
    if body.text is not None:
        return body.text, isinstance(body.text, list)
    assert body.input_ids is not None
    return body.input_ids, bool(body.input_ids) and isinstance(body.input_ids[0], list)


def _adapters(state: ServeState, lora_path: str | list[str | None] | None, count: int) -> list[str | None]:
    """The adapter of each prompt, each checked against the adapters loaded here."""
    named = list(lora_path) if isinstance(lora_path, list) else [lora_path] * count
    if len(named) != count:
        raise _bad(f"`lora_path` names {len(named)} adapters for {count} prompts: give one, or one per prompt")
    for name in dict.fromkeys(named):
        if name is not None and name not in state.lora_paths:
            raise _bad(
                f"lora_path {name!r:.200} names no LoRA adapter loaded here (loaded: {sorted(state.lora_paths)}); "
                "load it first: POST /load_lora_adapter {lora_name, lora_path}"
            )
    return named


def _completion(body: SglangGenerateBody, prompt: Any) -> CompletionBody:
    """The same request as an OpenAI completion, refused where the runners cannot honour it."""
    sp = body.sampling_params
    asks = {
        "stream": body.stream,
        "return_logprob": body.return_logprob,
        "min_p": sp.min_p > 0,
        "repetition_penalty": sp.repetition_penalty != 1,
    }
    unserved = sorted(name for name, asked in asks.items() if asked)
    if unserved:
        raise _bad(f"{unserved} ask for what omni-core's runners do not do: leave them at their defaults")
    return CompletionBody(
        prompt=prompt,
        max_tokens=sp.max_new_tokens,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        seed=sp.sampling_seed,
        ignore_eos=sp.ignore_eos,
        stop=sp.stop,
        n=sp.n,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        timeout_s=body.timeout_s,
    )


def _shaped(choice: dict[str, Any]) -> dict[str, Any]:
    """One prompt's answer as SGLang writes it, with omni-core's versions in `meta_info`."""
    meta = {
        "id": uuid.uuid4().hex,
        "finish_reason": {"type": choice["finish_reason"]},
        "prompt_tokens": choice["prompt_tokens"],
        "completion_tokens": len(choice["token_ids"]),
        "weights_version": choice["weights_version"],
        "version_spans": choice["version_spans"],
        "discarded_tokens": choice["discarded_tokens"],
    }
    meta |= {k: choice[k] for k in ("adapter", "adapter_version") if k in choice}
    return {"text": choice["text"], "output_ids": choice["token_ids"], "meta_info": meta}


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)], tags=["SGLang"])

    @api.post(
        "/generate",
        responses=m.ERROR_RESPONSES,
        description="SGLang's generation, on the default stage (or the one stage whose runner generates "
        "text): `text` or `input_ids` (a batch: a list), `sampling_params`, and `lora_path` naming a LoRA "
        "adapter loaded through /load_lora_adapter (one for all prompts, or one per prompt); an unknown "
        "adapter is 400 naming it. Each prompt is a request of the stage, through its admission policy. "
        "SGLang's answer (`text`, `output_ids`, `meta_info`; a list for a batch), `meta_info` naming the "
        "weights version and the adapter's name and version",
    )
    async def sglang_generate(body: SglangGenerateBody) -> Response:
        prompt, batch = _prompts(body)
        stage = resolve_stage(state, None)
        completion = _completion(body, prompt)
        prompts = completion_prompts(completion.prompt)
        ran = await run_prompts(state, stage, completion, prompts, _adapters(state, body.lora_path, len(prompts)))
        if isinstance(ran, JSONResponse):
            return ran
        answers = [_shaped(c) for c in ran[0]]
        return JSONResponse(answers if batch else answers[0])

    return api
