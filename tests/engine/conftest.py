"""Engine tests start real rank processes (spawn) over real sockets, on CPU."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import pytest

from omni_core.engine import Engine, StageSpec

MiB = 1 << 20
SMALL_RUNNER = {"weights_bytes": 2 * MiB, "tensor_count": 4, "kv_bytes": MiB // 4, "cpu_threads": 1}
PROBE = {"seed": 3, "batch": 2}
# A request's own deadline where a test proves something happened *before* any deadline:
# a refusal "at once" must come in well under it, and one by a deadline would take all of it.
LONG_TIMEOUT_S = 30.0
# "At once" on a loaded 2-core machine: a tenth of LONG_TIMEOUT_S; milliseconds in practice.
AT_ONCE_BOUND_S = LONG_TIMEOUT_S / 10


def small_spec(name: str, ranks: int = 1, **overrides) -> StageSpec:
    args = {
        "runner_args": dict(SMALL_RUNNER, seed=len(name)),
        "ranks": ranks,
        "backend": "portable",
        "deadline_s": 30.0,
        "start_deadline_s": 120.0,
        "request_timeout_s": 60.0,
    }
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


def in_thread(fn: Callable[[], Any]) -> Future:
    """Run a blocking call on a daemon thread: the test waits on its future with a bound, so
    a call that hangs fails the test instead of hanging it."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def request_held_by_a_stopped_rank(engine: Engine, stage: str, rank: int = 1) -> Any:
    """A request in flight that `rank` (stopped with SIGSTOP) cannot answer until the block ends."""
    pid = rank_pid(engine, stage, rank)
    os.kill(pid, signal.SIGSTOP)
    try:
        request = engine.submit(stage, PROBE, timeout_s=LONG_TIMEOUT_S)
        wait_for(lambda: engine.status()[stage]["in_flight"] == 1, what="request in flight")
        yield request
    finally:
        resume(pid)


@contextlib.contextmanager
def sleep_held_by_a_stopped_rank(engine: Engine, stage: str, rank: int = 0) -> Any:
    """A sleep of `stage` in flight (TRANSITIONING) that `rank` (stopped with SIGSTOP) cannot
    finish until the block ends; the sleep's outcome is awaited on the way out."""
    pid = rank_pid(engine, stage, rank)
    os.kill(pid, signal.SIGSTOP)
    try:
        sleeping = in_thread(lambda: engine.sleep(stage, timeout_s=LONG_TIMEOUT_S))
        wait_for(lambda: engine.status()[stage]["state"] == "TRANSITIONING", what=f"{stage} TRANSITIONING")
        yield sleeping
    finally:
        resume(pid)
    sleeping.result(LONG_TIMEOUT_S)


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
