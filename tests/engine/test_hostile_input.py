"""Hostile input through the Python API: a second restart during a restart, payloads the wire
cannot carry, and what status() says of the ranks after a task failed part-way."""

from __future__ import annotations

import os
import signal

import pytest

from omni_core.engine import (
    InvalidArgumentError,
    InvalidPayloadError,
    PayloadTooLargeError,
    RestartInProgressError,
    StageFailedError,
)
from omni_core.fsm import inputs as I
from omni_core.protocol import MAX_PAYLOAD_DEPTH
from tests.engine.conftest import LONG_TIMEOUT_S, PROBE, in_thread, rank_pid, small_spec, wait_for


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def test_a_second_restart_is_refused_and_the_first_one_completes(engine_factory) -> None:
    engine = engine_factory(small_spec("talker", ranks=2, start_deadline_s=90.0))
    reference = engine.execute("talker", PROBE)
    before = engine.status()["talker"]
    orch = engine._orch
    # Back to back on the loop thread: the second is decided while the first one's fresh
    # ranks are still importing torch (seconds away from their Hello).
    first = orch.submit("talker", I.Restart(90.0))
    second = orch.submit("talker", I.Restart(90.0))
    with pytest.raises(RestartInProgressError, match=r"already starting.*in progress and goes on; wait for it"):
        second.result(timeout=LONG_TIMEOUT_S)
    first.result(timeout=150)  # a refused restart used to kill these ranks: "sent no Hello" at the deadline
    status = engine.status()["talker"]
    assert status["state"] == "RUNNING" and status["epoch"] == before["epoch"] + 1, status
    assert all(r["alive"] and r["state"] == "ACTIVE" for r in status["ranks"].values()), status["ranks"]
    assert {r["pid"] for r in status["ranks"].values()}.isdisjoint({r["pid"] for r in before["ranks"].values()})
    assert engine.execute("talker", PROBE) == reference


def test_payloads_the_wire_cannot_carry_are_refused_naming_why(engine_factory) -> None:
    engine = engine_factory(small_spec("talker", max_frame_bytes=1 << 20))
    reference = engine.execute("talker", PROBE)
    depth_refused = rf"at most MAX_PAYLOAD_DEPTH={MAX_PAYLOAD_DEPTH} .* nests 986 levels"
    with pytest.raises(InvalidPayloadError, match=depth_refused):
        engine.execute("talker", {"x": nested(985)})
    with pytest.raises(InvalidPayloadError, match=r"nests more than \d+ levels"):
        engine.execute("talker", nested(100_000))
    for number in (2**64, -(2**63) - 1, 10**5000):
        with pytest.raises(InvalidPayloadError, match=r"outside msgpack's range.*\[-2\*\*63, 2\*\*64 - 1\]"):
            engine.execute("talker", {"n": [number]})
    with pytest.raises(InvalidPayloadError, match="cannot be encoded"):
        engine.execute("talker", {"x": object()})
    with pytest.raises(PayloadTooLargeError, match="max_frame_bytes"):
        engine.execute("talker", b"x" * (2 << 20))
    # At the limit, and the largest integers msgpack holds, travel; the stage serves on.
    assert engine.execute("talker", dict(PROBE, pad=nested(MAX_PAYLOAD_DEPTH - 1))) is not None
    assert engine.execute("talker", dict(PROBE, big=[2**64 - 1, -(2**63)])) is not None
    for source in ("/ckpt/a\x00b", b"/ckpt", 7):
        with pytest.raises(InvalidArgumentError, match="reload source must be a path string without NUL"):
            engine.reload_weights("talker", source)  # type: ignore[arg-type]
    assert engine.status()["talker"]["state"] == "RUNNING"
    assert engine.execute("talker", PROBE) == reference


def test_status_shows_where_the_surviving_rank_is_after_a_rank_died_mid_sleep(engine_factory) -> None:
    engine = engine_factory(small_spec("talker", ranks=2))
    victim = rank_pid(engine, "talker", 1)
    os.kill(victim, signal.SIGSTOP)  # frozen: rank 0 sleeps, rank 1 never answers
    sleeping = in_thread(lambda: engine.sleep("talker", level=1, timeout_s=LONG_TIMEOUT_S))
    wait_for(
        lambda: engine.status()["talker"]["ranks"][0]["state"] == "SLEEPING",
        what="rank 0's Ack SLEEPING shown while the task waits for rank 1",
    )
    os.kill(victim, signal.SIGKILL)
    assert isinstance(sleeping.exception(timeout=LONG_TIMEOUT_S + 30), StageFailedError)
    wait_for(lambda: not engine.status()["talker"]["ranks"][1]["alive"], what="rank 1 seen dead")
    ranks = engine.status()["talker"]["ranks"]
    assert ranks[0] == dict(ranks[0], alive=True, state="SLEEPING", committed_state="ACTIVE"), ranks
    assert ranks[1]["state"] == "EXITED", ranks
