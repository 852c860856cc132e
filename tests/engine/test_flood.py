"""A junk-frame flood on the engine's ROUTER: each loop turn reads a bounded batch, then serves
calls and deadlines, and every junk frame is still counted.

The logic test drives the orchestrator's loop with a fake socket that always has another
frame; the real one floods an engine over ipc from another process (any local user can, over
tcp without CURVE) and times `status()` throughout."""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

import zmq

from omni_core.engine import orchestrator as orch_module
from omni_core.engine.native_heap import NativeHeap
from omni_core.engine.orchestrator import MAX_FRAMES_PER_TURN, Orchestrator
from omni_core.isolation import FrameErrors
from omni_core.trace import open_trace
from tests.engine.conftest import small_spec

# The fake socket's supply: far more than a turn may read, so a loop that drains until empty
# reads all of it in its first turn, and the test still ends.
FAKE_SUPPLY = 50 * MAX_FRAMES_PER_TURN
TURNS = 3
FLOOD_S = 8.0
# Generous for a 2-core machine shared with other jobs; a drain-until-empty loop took 11.6 s.
STATUS_BOUND_S = 1.0


class EndlessRouter:
    """A ROUTER that always has another junk frame from a stranger (up to FAKE_SUPPLY)."""

    def __init__(self) -> None:
        self.read = 0

    def recv_multipart(self, flags: int = 0) -> list[bytes]:
        if self.read >= FAKE_SUPPLY:
            raise zmq.Again()
        self.read += 1
        return [b"stranger", b"\xc1 not msgpack"]


class FakeIO:
    def __init__(self) -> None:
        self.router = EndlessRouter()

    def poll(self, timeout_ms: int) -> dict[Any, int]:
        return {self.router: zmq.POLLIN}  # always readable, as a flooded socket is


class NoSwaps:
    def advance(self) -> None:
        pass


def test_a_loop_turn_reads_a_bounded_batch_then_serves_calls(monkeypatch) -> None:
    orch = Orchestrator.__new__(Orchestrator)  # the loop alone: no socket, no ranks
    io = FakeIO()
    orch._io, orch._stages, orch._sentinels, orch._swaps = io, {}, {}, NoSwaps()
    orch._trace, orch.max_frame_bytes, orch._by_identity = open_trace(None), 1 << 20, {}
    orch.counters = {"bad_replies": 0, "unknown_peers": 0}
    orch.frame_errors = FrameErrors("orchestrator", orch_module.log)
    orch._next_tick_at = 0.0
    orch.native_heap = NativeHeap()
    read_when_served: list[int] = []

    def run_calls() -> None:  # the calls a turn serves: record how much of the flood came first
        read_when_served.append(io.router.read)
        if len(read_when_served) == TURNS:
            orch._closing = object()

    orch._closing = None
    monkeypatch.setattr(orch, "_run_calls", run_calls)
    monkeypatch.setattr(orch, "_finish_close", lambda: True)
    orch._serve()
    # Turn t serves its calls after t batches: the flood never holds them for longer.
    assert read_when_served == [t * MAX_FRAMES_PER_TURN for t in range(TURNS)]
    assert orch.counters["bad_replies"] == io.router.read == TURNS * MAX_FRAMES_PER_TURN  # each one counted


FLOODER = """
import sys, time, zmq
ctx = zmq.Context()
sock = ctx.socket(zmq.DEALER)
sock.setsockopt(zmq.SNDHWM, 100000)
sock.setsockopt(zmq.LINGER, 0)
sock.connect(sys.argv[1])
until = time.monotonic() + float(sys.argv[2])
sent = 0
while time.monotonic() < until:
    for _ in range(1000):
        sock.send(b"\\xc1 junk that is not msgpack")
    sent += 1000
print(sent, flush=True)
sock.close(0)
ctx.term()
"""


def test_status_answers_promptly_throughout_a_junk_flood(engine_factory) -> None:
    engine = engine_factory(small_spec("solo"))
    before = engine.status()["_engine"]["bad_replies"]
    flooder = subprocess.Popen(
        [sys.executable, "-c", FLOODER, engine.address, str(FLOOD_S)], stdout=subprocess.PIPE, text=True
    )
    took: list[float] = []
    try:
        while flooder.poll() is None:
            started = time.perf_counter()
            state = engine.status()["solo"]["state"]
            took.append(time.perf_counter() - started)
            assert state == "RUNNING"
        sent = int(flooder.communicate(timeout=30)[0])
    finally:
        if flooder.poll() is None:
            flooder.kill()
    counted = engine.status()["_engine"]["bad_replies"] - before
    took.sort()
    print(
        f"flood: {sent} junk frames sent, {counted} counted; {len(took)} status calls, median "
        f"{took[len(took) // 2] * 1e3:.1f} ms, max {took[-1] * 1e3:.1f} ms"
    )
    assert len(took) >= 10, f"only {len(took)} status calls answered during an {FLOOD_S} s flood"
    assert took[-1] < STATUS_BOUND_S, f"status took {took[-1]:.2f} s during the flood"
    assert counted > 0
