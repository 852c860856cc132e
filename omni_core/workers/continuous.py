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

    def hold(self, clear_cache: bool) -> dict[str, int]:
        """Pause mode keep: the runner freezes every running request; each one's output tokens
        so far, by task id (a key the runner names that is not running is nobody's)."""
        tokens = self.runner.hold_requests(clear_cache)
        return {self._effects[key][0].task_id: int(n) for key, n in tokens.items() if key in self._effects}

    def forget(self, held: set[str]) -> None:
        """Drop the running requests whose task the core no longer holds (it answered them
        itself: their weights were lost under them), and tell the runner."""
        gone = [key for key, (effect, _) in self._effects.items() if effect.task_id not in held]
        for key in gone:
            del self._effects[key]
        if gone:
            self.runner.abort_requests(gone)

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
