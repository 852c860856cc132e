"""An OpenAI-compatible door: `POST /v1/completions` and `POST /v1/chat/completions`, as vLLM's
OpenAI server answers them (JSON, or server-sent events with `stream`), on the stages whose
runner generates text (`transformers`, `vllm`: the payload of runners/generation.py).

Each prompt is one request of the stage, through its admission policy like any other (under
sleep: queued, refused or waking the stage, as the stage says), and the ranks run the requests
in flight together. Every answer names the weights version that produced it (`weights_version`,
at the top and per choice) and the generated `token_ids` per choice, beside OpenAI's fields.

What omni-core's runners generate comes whole: a streamed answer sends each choice's text in
one chunk once it is generated, then the chunk with its finish reason, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omni_core.engine.api import WAIT_GRACE_S
from omni_core.engine.errors import OmniCoreError
from omni_core.serve import models as m
from omni_core.serve.errors import ApiError, outcome_label, to_http
from omni_core.serve.middleware import require_key
from omni_core.serve.openai_models import (
    MAX_PROMPT_CHARS,
    MAX_PROMPT_TOKENS,
    MAX_PROMPTS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    ChatBody,
    ChatMessage,
    CompletionBody,
    _OpenAIBody,
)
from omni_core.serve.state import ServeState
from omni_core.serve.trl_routes import model_name

GENERATING_RUNNERS = frozenset({"transformers", "vllm"})  # the payload of runners/generation.py
DEFAULT_MAX_TOKENS = 16  # vLLM's completions default; omni-core's for chat too (the cache bounds it)


def _bad(message: str) -> ApiError:
    return ApiError(400, message, kind="InvalidArgumentError")


def resolve_stage(state: ServeState, model: str | None) -> str:
    """The stage a request's `model` names: a stage's name or a model id of GET /v1/models;
    none: the default stage, else the one stage that generates text."""
    generating = [n for n in state.names if state.specs[n].runner in GENERATING_RUNNERS]
    if model is None:
        default = state.server.default_stage
        if default is not None:
            stage = default
        elif len(generating) == 1:
            stage = generating[0]
        else:
            raise _bad(f"give `model`: one of the stages {generating} (or their model ids, GET /v1/models)")
    elif model in state.specs:
        stage = model
    else:
        named = [n for n in state.names if model_name(state, n) == model]
        if not named:
            served = sorted({*generating, *(model_name(state, n) for n in generating)})
            raise ApiError(404, f"model {model!r} is not served here; served: {served}", kind="NotFoundError")
        stage = named[0]
    runner = state.specs[stage].runner
    if runner not in GENERATING_RUNNERS:
        raise _bad(
            f"stage {stage!r} runs the {runner!r} runner, which does not generate text; the OpenAI routes "
            f"serve stages of the runners {sorted(GENERATING_RUNNERS)} (others: POST /v1/stages/{stage}/execute)"
        )
    return stage


def resolve_target(state: ServeState, model: str | None) -> tuple[str, str | None]:
    """The stage and the LoRA adapter (P-20) a request's `model` names. As vLLM serves them, an
    adapter loaded through `/v1/load_lora_adapter` (or SGLang's) is a model of its own in GET
    /v1/models: named as `model`, it runs on the stage the loads went to, the one a request
    naming no model gets. A stage's name or model id is never taken for an adapter."""
    models = {*state.specs, *(model_name(state, n) for n in state.names)}
    if model is not None and model not in models and model in state.lora_paths:
        return resolve_stage(state, None), model
    return resolve_stage(state, model), None


def _refuse_unserved(body: _OpenAIBody) -> None:
    """A field asking for what the runners cannot do is refused, never silently dropped."""
    asks = {
        "n": body.n != 1,
        "top_p": body.top_p is not None and body.top_p < 1,
        "presence_penalty": bool(body.presence_penalty),
        "frequency_penalty": bool(body.frequency_penalty),
        "logit_bias": bool(body.logit_bias),
        "logprobs": body.logprobs not in (None, False),
    }
    if isinstance(body, CompletionBody):
        asks |= {"echo": body.echo, "best_of": body.best_of not in (None, 1), "suffix": body.suffix is not None}
    if isinstance(body, ChatBody):
        asks |= {
            "top_logprobs": body.top_logprobs not in (None, 0),
            "tools": bool(body.tools),
            "tool_choice": body.tool_choice not in (None, "none"),
        }
    unserved = sorted(name for name, asked in asks.items() if asked)
    if unserved:
        raise _bad(
            f"{unserved} ask for what omni-core's runners do not do (one greedy or seeded sample of "
            "top_k tokens per prompt, no penalties, no logprobs, no tools): leave them at their defaults"
        )


def _stops(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad(f"`stop` takes up to {MAX_STOPS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return stops


def _sampling(body: _OpenAIBody) -> str | dict[str, Any]:
    temperature = 1.0 if body.temperature is None else body.temperature
    if temperature == 0:
        return "greedy"
    sampling: dict[str, Any] = {
        "temperature": temperature,
        "seed": secrets.randbits(62) if body.seed is None else body.seed,
    }
    if body.top_k is not None and body.top_k > 0:
        sampling["top_k"] = body.top_k
    return sampling


def completion_prompts(prompt: Any) -> list[dict[str, Any]]:
    """Each prompt of a completion request as the runner's prompt field."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if not 1 <= len(prompts) <= MAX_PROMPTS:
        raise _bad(f"`prompt` must hold 1..{MAX_PROMPTS} prompts, got {len(prompts)}")
    out: list[dict[str, Any]] = []
    for p in prompts:
        if isinstance(p, str):
            if not p or len(p) > MAX_PROMPT_CHARS:
                raise _bad(f"a text prompt must have 1..{MAX_PROMPT_CHARS} characters")
            out.append({"prompt": p})
        else:
            if not p or len(p) > MAX_PROMPT_TOKENS:
                raise _bad(f"a token prompt must have 1..{MAX_PROMPT_TOKENS} token ids")
            out.append({"prompt_ids": list(p)})
    return out


@functools.lru_cache(maxsize=8)
def _chat_tokenizer(model_dir: str) -> Any:
    """The model's own tokenizer, for its chat template; None where there is none to read."""
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception:  # no transformers here, no tokenizer in the directory: the plain template
        return None
    return tokenizer if getattr(tokenizer, "chat_template", None) else None


def _text_of(message: ChatMessage) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise _bad(f"a message's content parts must be of type 'text' with a string 'text', got {str(part)[:200]}")
        parts.append(part["text"])
    return "".join(parts)


def chat_prompt(model_dir: str | None, messages: list[ChatMessage], add_generation_prompt: bool) -> str:
    """The conversation as the model's chat template writes it; a model without one gets
    omni-core's plain template: one `role: text` line per message, then `assistant:`."""
    turns = [{"role": msg.role, "content": _text_of(msg)} for msg in messages]
    tokenizer = _chat_tokenizer(model_dir) if model_dir else None
    if tokenizer is not None:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        return str(text)
    lines = "".join(f"{t['role']}: {t['content']}\n" for t in turns)
    return lines + ("assistant:" if add_generation_prompt else "")


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    found = [text.find(s) for s in stops if s in text]
    return (text[: min(found)], True) if found else (text, False)


async def _generate(
    state: ServeState, stage: str, body: _OpenAIBody, prompts: list[dict[str, Any]], adapter: str | None
) -> list[Any]:
    """Every prompt as one request of the stage (with `adapter`), in flight together; their ExecuteResults."""
    engine = state.require_engine()
    max_tokens = body.max_tokens
    if isinstance(body, ChatBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    common = {"max_new_tokens": max_tokens or DEFAULT_MAX_TOKENS, "sampling": _sampling(body)}
    common["stop_at_eos"] = not body.ignore_eos
    futures = [
        asyncio.wrap_future(
            engine.submit(stage, {**p, **common}, timeout_s=body.timeout_s, with_version=True, adapter=adapter)
        )
        for p in prompts
    ]
    budget_s = (body.timeout_s or state.specs[stage].request_timeout_s) + WAIT_GRACE_S
    try:
        return list(await asyncio.wait_for(asyncio.gather(*futures), budget_s))
    except asyncio.TimeoutError:
        raise OmniCoreError(
            f"no answer from the orchestrator within {budget_s:.1f} s; its deadlines should have fired: "
            "this is a bug, please report it"
        ) from None


def _choices(results: list[Any], stops: list[str]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    choices, prompt_tokens, completion_tokens = [], 0, 0
    for index, result in enumerate(results):
        out = result.output
        text, stopped = _cut(out.get("text", ""), stops)
        reason = "stop" if stopped else out["finish_reason"]
        prompt_tokens += out["prompt_tokens"]
        completion_tokens += len(out["token_ids"])
        choices.append(
            {
                "index": index,
                "text": text,
                "finish_reason": reason,
                "token_ids": out["token_ids"],
                "prompt_tokens": out["prompt_tokens"],
                "weights_version": result.weights_version,
                **_ran_with(result),
                # Held through an update (pause keep): which version computed which tokens.
                "version_spans": result.spans_json(),
                "discarded_tokens": result.discarded_tokens,
            }
        )
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    return choices, usage | {"total_tokens": prompt_tokens + completion_tokens}


def _ran_with(result: Any) -> dict[str, Any]:
    """P-20: the adapter and its version beside the weights version, when one ran."""
    if result.adapter is None:
        return {}
    return {"adapter": result.adapter, "adapter_version": result.adapter_version}


def _extra(choice: dict[str, Any]) -> dict[str, Any]:
    """A choice's fields beside OpenAI's: its tokens, the weights version (and its spans, held
    through an update), the adapter's."""
    fields = ("token_ids", "weights_version", "version_spans", "discarded_tokens", "adapter", "adapter_version")
    return {k: choice[k] for k in fields if k in choice}


def _answer(kind: str, model: str, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
    chat = kind == "chat"
    shaped = []
    for c in choices:
        extra = _extra(c)
        if chat:
            message = {"role": "assistant", "content": c["text"]}
            shaped.append({"index": c["index"], "message": message, "finish_reason": c["finish_reason"], **extra})
        else:
            text = {"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": c["finish_reason"]}
            shaped.append(text | extra)
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": shaped,
        "usage": usage,
        "weights_version": choices[0]["weights_version"],
    }


async def _events(answer: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """The answer as vLLM streams it: a chunk with each choice's text, one with its finish reason,
    the usage when asked for, then [DONE]."""
    chat = answer["object"] == "chat.completion"
    head = {k: answer[k] for k in ("id", "created", "model", "weights_version")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choices: list[dict[str, Any]], **more: Any) -> bytes:
        return f"data: {json.dumps(head | {'choices': choices} | more)}\n\n".encode()

    for c in answer["choices"]:
        extra = _extra(c)
        if chat:
            delta = {"role": "assistant", "content": c["message"]["content"]}
            yield chunk([{"index": c["index"], "delta": delta, "finish_reason": None, **extra}])
            yield chunk([{"index": c["index"], "delta": {}, "finish_reason": c["finish_reason"]}])
        else:
            yield chunk([{"index": c["index"], "text": c["text"], "logprobs": None, "finish_reason": None, **extra}])
            end = {"index": c["index"], "text": "", "logprobs": None, "finish_reason": c["finish_reason"]}
            yield chunk([end])
    if include_usage:
        yield chunk([], usage=answer["usage"])
    yield b"data: [DONE]\n\n"


async def run_prompts(
    state: ServeState, stage: str, body: _OpenAIBody, prompts: list[dict[str, Any]], adapters: list[str | None]
) -> tuple[list[dict[str, Any]], dict[str, int]] | JSONResponse:
    """Each prompt as a request of `stage` with its adapter (P-20; None: the base weights), in
    flight together: their choices and usage, or the first error as the HTTP answer (counted
    in the request metrics either way)."""
    try:
        _refuse_unserved(body)
        stops = _stops(body.stop)
        groups: dict[str | None, list[int]] = {}  # the prompts of each adapter: one generation each
        for index, adapter in enumerate(adapters):
            groups.setdefault(adapter, []).append(index)
        ran = await asyncio.gather(
            *(_generate(state, stage, body, [prompts[i] for i in g], a) for a, g in groups.items())
        )
        results: list[Any] = [None] * len(prompts)
        for indices, outs in zip(groups.values(), ran, strict=True):
            for index, result in zip(indices, outs, strict=True):
                results[index] = result
    except Exception as exc:
        err = to_http(exc, stage=stage)
        state.metrics.requests.labels(stage, outcome_label(err.status)).inc(len(prompts))
        return JSONResponse(err.body, status_code=err.status, headers=err.headers)
    state.metrics.requests.labels(stage, outcome_label(200)).inc(len(prompts))
    return _choices(results, stops)


async def _serve(
    state: ServeState,
    kind: str,
    body: _OpenAIBody,
    target: tuple[str, str | None],
    prompts: list[dict[str, Any]],
) -> Response:
    stage, adapter = target
    ran = await run_prompts(state, stage, body, prompts, [adapter] * len(prompts))
    if isinstance(ran, JSONResponse):
        return ran
    choices, usage = ran
    answer = _answer(kind, body.model or model_name(state, stage), choices, usage)
    if not body.stream:
        return JSONResponse(answer)
    include_usage = bool((body.stream_options or {}).get("include_usage"))
    return StreamingResponse(_events(answer, include_usage), media_type="text/event-stream")


def router(state: ServeState) -> APIRouter:
    api = APIRouter(dependencies=[Depends(require_key)])

    @api.post(
        "/v1/completions",
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="OpenAI's completions, as vLLM's OpenAI server answers them (stream: server-sent "
        "events), on a stage whose runner generates text; each prompt is a request of the stage, "
        "through its admission policy; the answer names the weights version",
    )
    async def completions(request: Request, body: CompletionBody) -> Response:
        target = resolve_target(state, body.model)
        return await _serve(state, "completion", body, target, completion_prompts(body.prompt))

    @api.post(
        "/v1/chat/completions",
        responses=m.ERROR_RESPONSES,
        tags=["vLLM"],
        description="OpenAI's chat completions, as vLLM's OpenAI server answers them (stream: "
        "server-sent events): the messages in the model's chat template (else `role: text` lines), "
        "one request of the stage through its admission policy; the answer names the weights version",
    )
    async def chat_completions(request: Request, body: ChatBody) -> Response:
        target = resolve_target(state, body.model)
        model = state.specs[target[0]].runner_args.get("model")
        messages, add = body.messages, body.add_generation_prompt
        prompt = await state.blocking(chat_prompt, model if isinstance(model, str) else None, messages, add)
        return await _serve(state, "chat", body, target, [{"prompt": prompt}])

    return api
