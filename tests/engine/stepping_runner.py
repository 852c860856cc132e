"""A synthetic runner with continuous batching, for the engine tests of requests joining and
leaving between steps. Named by import path (`tests.engine.stepping_runner:SteppingRunner`).

Each request runs `steps` steps (default 1) and then answers what the synthetic runner's
`execute` answers for its payload. A request with `"until": PATH` runs until that file exists
(the test releases it); one with `"fail_step": true` makes the step it is in raise."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

from omni_core.runners.synthetic import SyntheticRunner


class SteppingRunner(SyntheticRunner):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running: dict[str, list[Any]] = {}  # key -> [payload, steps left]
        self.steps = self.largest = self.joined_running = 0

    def supports_continuous(self) -> bool:
        return True

    def start_request(self, key: str, payload: Any) -> None:
        if not isinstance(payload, dict) or not isinstance(payload.get("steps", 1), int):
            raise ValueError(f"a stepping request is a dict with an int 'steps'; got {payload!r}")
        self.joined_running += bool(self.running)
        self.running[key] = [payload, payload.get("steps", 1)]
        self.largest = max(self.largest, len(self.running))

    def running_requests(self) -> int:
        return len(self.running)

    def step_requests(self) -> list[tuple[str, Any]]:
        self.steps += 1
        if any("until" in p for p, _ in self.running.values()):
            time.sleep(0.002)  # a step's compute: a held request must not spin the rank's core
        if any(p.get("fail_step") for p, _ in self.running.values()):
            self.running.clear()
            raise RuntimeError("a step failed (fail_step)")
        done = []
        for key, entry in list(self.running.items()):
            payload = entry[0]
            entry[1] -= 1
            until = payload.get("until")
            if entry[1] <= 0 and (until is None or os.path.exists(until)):
                del self.running[key]
                done.append((key, self.execute({k: v for k, v in payload.items() if k not in ("steps", "until")})))
        return done

    def counters(self) -> Mapping[str, int]:
        return {"steps": self.steps, "largest_running": self.largest, "joined_running": self.joined_running}
