"""The bodies of the OpenAI-compatible door (`/v1/completions`, `/v1/chat/completions`), with
the request fields vLLM's OpenAI server takes for sampling (`vllm/entrypoints/openai/protocol.py`:
OpenAI's fields plus `top_k`, `ignore_eos`), each bounded.

A field omni-core's runners cannot honour is refused when it asks for something (a 400 naming
it, in `openai_routes`), never taken and ignored: `n` above 1, `top_p` below 1, penalties,
logprobs, `echo`, `best_of`, tools. A field the model does not declare at all is a 422.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_PROMPT_CHARS = 1 << 20  # one prompt's text
MAX_PROMPTS = 256  # prompts of one completion request (each runs as a request of its own)
MAX_PROMPT_TOKENS = 1 << 16
MAX_MESSAGES = 1024
MAX_NEW_TOKENS = 1 << 16
MAX_STOPS = 4  # OpenAI's bound
MAX_STOP_CHARS = 256

Prompt = str | list[str] | list[int] | list[list[int]]


class _OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = Field(None, max_length=4096, description="a stage's name, or a model id of GET /v1/models")
    max_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="new tokens at most")
    temperature: float | None = Field(
        None, ge=0, le=100, description="0: greedy; null: 1.0, as vLLM without a generation config"
    )
    top_k: int | None = Field(None, ge=-1, le=1 << 20, description="vLLM's: -1 or 0 for every token")
    top_p: float | None = Field(None, ge=0, le=1, description="only 1 (every token) is served")
    seed: int | None = Field(None, ge=0, lt=2**63, description="a sampled request's seed; null: a fresh one")
    ignore_eos: bool = Field(False, description="vLLM's: go on past the end-of-sequence token")
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOPS} strings; the text ends before one")
    stream: bool = Field(False, description="answer as server-sent events, ending with `data: [DONE]`")
    stream_options: dict[str, Any] | None = Field(None, description="{'include_usage': bool}")
    n: int = Field(1, ge=1, le=128, description="choices per prompt: only 1 is served")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="only 0 is served")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="only 0 is served")
    logit_bias: dict[str, float] | None = Field(None, description="only empty is served")
    logprobs: Any = Field(None, description="not served: null")
    user: str | None = Field(None, max_length=4096, description="ignored, as vLLM ignores it")
    timeout_s: float | None = Field(None, gt=0, le=86400, description="omni-core's: the request's deadline")


class CompletionBody(_OpenAIBody):
    prompt: Prompt = Field(..., description="text, token ids, or a list of either (each its own choice)")
    echo: bool = Field(False, description="not served: false")
    best_of: int | None = Field(None, ge=1, le=128, description="not served: 1 or null")
    suffix: str | None = Field(None, description="not served: null")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = Field(None, description="text, or parts of type 'text'")
    name: str | None = Field(None, max_length=256)


class ChatBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_NEW_TOKENS, description="OpenAI's max_tokens")
    top_logprobs: int | None = Field(None, description="not served: null")
    tools: list[Any] | None = Field(None, description="not served: null or empty")
    tool_choice: Any = Field(None, description="not served: null or 'none'")
    parallel_tool_calls: bool | None = Field(None, description="ignored, as vLLM ignores it")
    add_generation_prompt: bool = Field(True, description="vLLM's: end the prompt with the assistant's turn")
