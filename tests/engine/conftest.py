"""Engine tests start real rank processes (spawn) over real sockets, on CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

import pytest

from omni_core.engine import Engine, StageSpec

MiB = 1 << 20
SMALL_RUNNER = {"weights_bytes": 2 * MiB, "tensor_count": 4, "kv_bytes": MiB // 4, "cpu_threads": 1}
PROBE = {"seed": 3, "batch": 2}


def small_spec(name: str, ranks: int = 1, **overrides) -> StageSpec:
    args = {"runner_args": dict(SMALL_RUNNER, seed=len(name)), "ranks": ranks, "backend": "portable",
            "deadline_s": 30.0, "start_deadline_s": 120.0, "request_timeout_s": 60.0}  # fmt: skip
    args.update(overrides)
    return StageSpec(name, **args)


def rank_pid(engine: Engine, stage: str, rank: int) -> int:
    return engine.status()[stage]["ranks"][rank]["pid"]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@pytest.fixture
def engine_factory():
    engines: list[Engine] = []

    def make(*specs: StageSpec, **kwargs) -> Engine:
        engine = Engine(list(specs), **kwargs)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()
