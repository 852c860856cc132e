"""A toy language model with continuous batching and holds (pause mode keep), for the tests
of in-flight refit. Named by import path (`tests.engine.token_runner:TokenRunner`).

Generation is real in the one way these tests need: each token is computed from the weights
and the token before it (`next_token`: the argmax of the row of weight `w0` the previous token
picks), one token per request per step, so a request frozen at token k and resumed on new
weights produces what a reference that switches weights at token k produces, and nothing
else. A payload: {"first": int, "max_tokens": int, "gate_at": int, "gate": PATH, "reached":
PATH}: after `gate_at` tokens the request waits until the file `gate` exists, and writes the
file `reached` once it waits there (the test's signal that it is mid-generation)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from omni_core.runners.synthetic import SyntheticRunner

MAX_TOKENS = 256


def next_token(weights: torch.Tensor, previous: int) -> int:
    """The token after `previous` under `weights` (the runner's w0)."""
    return int(torch.argmax(weights[previous % weights.shape[0]]).item())


class TokenRunner(SyntheticRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[str, tuple[dict[str, Any], list[int]]] = {}  # key -> (payload, tokens)
        self.holds = self.aborted = 0

    def supports_continuous(self) -> bool:
        return True

    def supports_hold(self) -> bool:
        return True

    def start_request(self, key: str, payload: Any) -> None:
        if not (isinstance(payload, dict) and type(payload.get("first")) is int):
            raise ValueError(f"a token request is a dict with an int 'first'; got {payload!r}")
        if not (type(payload.get("max_tokens")) is int and 1 <= payload["max_tokens"] <= MAX_TOKENS):
            raise ValueError(f"max_tokens must be an int in 1..{MAX_TOKENS}; got {payload.get('max_tokens')!r}")
        self.running[key] = (payload, [])

    def running_requests(self) -> int:
        return len(self.running)

    def step_requests(self) -> list[tuple[str, Any]]:
        done = []
        gated = False
        for key, (payload, tokens) in list(self.running.items()):
            if self._waits(payload, tokens):
                gated = True
                continue
            previous = tokens[-1] if tokens else payload["first"]
            tokens.append(next_token(self.weights[0], previous))
            if len(tokens) == payload["max_tokens"]:
                del self.running[key]
                done.append((key, {"tokens": tokens}))
        if gated and not done:
            time.sleep(0.002)  # a step's compute: a waiting request must not spin the rank's core
        return done

    @staticmethod
    def _waits(payload: dict[str, Any], tokens: list[int]) -> bool:
        gate = payload.get("gate")
        if gate is None or len(tokens) != payload.get("gate_at") or os.path.exists(gate):
            return False
        reached = payload.get("reached")
        if reached is not None and not os.path.exists(reached):
            with open(reached, "w") as f:
                f.write(str(len(tokens)))
        return True

    def hold_requests(self, clear_cache: bool) -> Mapping[str, int]:
        self.holds += 1
        counts = {key: len(tokens) for key, (_, tokens) in self.running.items()}
        if clear_cache:  # the KV is gone: each restarts from its prompt
            for _, tokens in self.running.values():
                tokens.clear()
        return counts

    def abort_requests(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.aborted += self.running.pop(key, None) is not None

    def counters(self) -> Mapping[str, int]:
        return {**super().counters(), "holds": self.holds, "aborted": self.aborted}
