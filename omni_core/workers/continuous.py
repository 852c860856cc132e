"""The requests a rank's runner holds between its steps (continuous batching).

A runner that supports it (vLLM's engine loop) takes each request as it arrives and decodes
every running one per step; the worker process steps it while requests run, reading the socket
between steps, so a request that arrives while others decode joins at the next step instead of
waiting for the whole batch, and each answer leaves as soon as its request finishes. This class
owns the running set: which effect each runner key belongs to and when it started. It does no
IO; the worker process answers what it returns.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from omni_core.fsm.effects import ExecuteEffect
from omni_core.runners.base import ModelRunner


@dataclass(frozen=True)
class Finished:
    """One request's outcome: its output, or the exception that is its error."""

    effect: ExecuteEffect
    output: Any
    duration_s: float


class RunningRequests:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._effects: dict[str, tuple[ExecuteEffect, float]] = {}  # runner key -> (effect, start)
        self._keys = itertools.count()

    def __len__(self) -> int:
        return len(self._effects)

    def start(self, effect: ExecuteEffect) -> Finished | None:
        """Hand one request to the runner; a payload it refuses finishes at once, with its error."""
        key = f"{effect.task_id}#{next(self._keys)}"  # task ids repeat across epochs; keys never do
        started = time.perf_counter()
        try:
            self.runner.start_request(key, effect.payload)
        except Exception as exc:
            return Finished(effect, exc, time.perf_counter() - started)
        self._effects[key] = (effect, started)
        return None

    def step(self) -> list[Finished]:
        """One runner step: the requests it finished. A raise of the step is the error of
        every running request (the runner forgot them all)."""
        try:
            done = self.runner.step_requests()
        except Exception as exc:
            return self.fail_all(exc)
        now = time.perf_counter()
        finished = []
        for key, output in done:
            held = self._effects.pop(key, None)
            if held is not None:  # a key the runner made up is nobody's answer
                finished.append(Finished(held[0], output, now - held[1]))
        if self._effects and not done and self.runner.running_requests() == 0:
            return self.fail_all(RuntimeError(self._lost_message()))
        return finished

    def fail_all(self, exc: Exception) -> list[Finished]:
        now = time.perf_counter()
        failed = [Finished(effect, exc, now - started) for effect, started in self._effects.values()]
        self._effects.clear()
        return failed

    def _lost_message(self) -> str:
        return (
            f"{type(self.runner).__name__} holds none of the {len(self._effects)} requests it was given and "
            "finished none of them: a runner bug; the requests fail rather than wait forever"
        )
