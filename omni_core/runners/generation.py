"""The request format of the language-model runners (`transformers`, `vllm`), checked once.

Both runners take the same payload, so a stage can move from one to the other without its
clients noticing:

    {"prompt_ids": [int, ...] | [[int, ...], ...]}  or  {"prompt": str | [str, ...]}
    "max_new_tokens": int (default 16)
    "sampling": "greedy" (default) | {"temperature": float, "seed": int, "top_k": int}
    "stop_at_eos": bool (default true)

Every check names the field and what to send instead; nothing here touches a model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

DEFAULT_MAX_NEW_TOKENS = 16
T = TypeVar("T")
PAYLOAD_KEYS = frozenset({"prompt_ids", "prompt", "max_new_tokens", "sampling", "stop_at_eos"})


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class Sampling:
    temperature: float | None = None  # None: greedy
    seed: int = 0
    top_k: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    rows: list[list[int]]
    batched: bool  # the payload gave a list of prompts: answer with a list
    max_new_tokens: int
    sampling: Sampling
    stop_at_eos: bool


def parse_generation(
    payload: Any, *, tokenizer: Any, vocab_size: int, max_batch: int, max_seq_len: int, model_dir: Path
) -> GenerationRequest:
    """Check a payload against the runner's limits (`max_batch` prompts, `max_seq_len`
    tokens of prompt + generation); text needs a tokenizer."""
    if not isinstance(payload, dict):
        raise TypeError(
            f"the payload must be a dict like {{'prompt_ids': [1, 2, 3], 'max_new_tokens': 8}}, "
            f"got {type(payload).__name__}"
        )
    unknown = sorted(set(payload) - PAYLOAD_KEYS)
    if unknown:
        raise ValueError(f"unknown payload key(s) {unknown}; known: {sorted(PAYLOAD_KEYS)}")
    if ("prompt_ids" in payload) == ("prompt" in payload):
        raise ValueError("give exactly one of 'prompt_ids' (token ids) and 'prompt' (text)")
    if "prompt" in payload:
        rows, batched = _encode(payload["prompt"], tokenizer, model_dir)
    else:
        rows, batched = _ids(payload["prompt_ids"], vocab_size)
    if not 1 <= len(rows) <= max_batch:
        raise ValueError(f"{len(rows)} prompts in one request; this runner's max_batch is {max_batch}")
    max_new = payload.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if not is_int(max_new) or max_new < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new!r}")
    longest = max(len(r) for r in rows)
    if longest + max_new > max_seq_len:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens {max_new} exceeds the KV cache's "
            f"max_seq_len {max_seq_len}; shorten the request or raise max_seq_len"
        )
    stop = payload.get("stop_at_eos", True)
    if not isinstance(stop, bool):
        raise TypeError(f"stop_at_eos must be a bool, got {stop!r}")
    return GenerationRequest(rows, batched, max_new, parse_sampling(payload.get("sampling", "greedy")), stop)


def parse_each(payloads: Sequence[Any], parse: Callable[[Any], T]) -> list[T | Exception]:
    """Each payload of a batch parsed, or the exception that is that request's own error."""
    parsed: list[T | Exception] = []
    for payload in payloads:
        try:
            parsed.append(parse(payload))
        except Exception as exc:
            parsed.append(exc)
    return parsed


def _encode(prompt: Any, tokenizer: Any, model_dir: Path) -> tuple[list[list[int]], bool]:
    if tokenizer is None:
        raise ValueError(f"{model_dir} has no tokenizer, so 'prompt' text cannot be encoded; send 'prompt_ids'")
    batched = isinstance(prompt, list)
    texts = prompt if batched else [prompt]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise TypeError("'prompt' must be a non-empty string or a non-empty list of them")
    return [list(tokenizer(t)["input_ids"]) for t in texts], batched


def _ids(ids: Any, vocab_size: int) -> tuple[list[list[int]], bool]:
    if not isinstance(ids, list) or not ids:
        raise TypeError(f"'prompt_ids' must be a non-empty list of token ids (or of lists of them), got {ids!r}")
    batched = isinstance(ids[0], list)
    rows = ids if batched else [ids]
    for row in rows:
        if not isinstance(row, list) or not row or not all(is_int(i) and 0 <= i < vocab_size for i in row):
            raise ValueError(
                f"every prompt must be a non-empty list of ints in [0, {vocab_size}) (the vocab "
                f"size); got {str(row)[:200]}"
            )
    return [list(r) for r in rows], batched


def parse_sampling(spec: Any) -> Sampling:
    if spec == "greedy":
        return Sampling()
    if not isinstance(spec, dict) or set(spec) - {"temperature", "seed", "top_k"}:
        raise ValueError(
            f"sampling must be 'greedy' or {{'temperature': float, 'seed': int, 'top_k': int}}, got {spec!r}"
        )
    temperature, seed, top_k = spec.get("temperature", 1.0), spec.get("seed", 0), spec.get("top_k")
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ValueError(f"sampling temperature must be a number > 0 (use 'greedy' for argmax), got {temperature!r}")
    if not is_int(seed) or not 0 <= seed < 2**63:
        raise ValueError(f"sampling seed must be an int in [0, 2**63), got {seed!r}")
    if top_k is not None and (not is_int(top_k) or top_k < 1):
        raise ValueError(f"sampling top_k must be an int >= 1, got {top_k!r}")
    return Sampling(float(temperature), seed, top_k)
