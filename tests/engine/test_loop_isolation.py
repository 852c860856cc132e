"""Per-frame isolation in the orchestrator's loop (omni_core.isolation): an exception raised
in any handler of one frame, one rank exit or one tick is counted by cause and the loop
serves on; only a violated invariant of a core ends it, loudly.

Each handler of the engine's loop is replaced by one that raises once, on the input named;
that input is then sent (a stranger's frame, a rank's reply, a rank's death, a tick), and the
engine must count it and go on serving: requests, sleep and wake, status."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import zmq

from omni_core.engine import Engine, EngineClosedError
from omni_core.engine import orchestrator as orchestrator_module
from omni_core.fsm import InvariantViolation
from omni_core.fsm import inputs as I
from omni_core.protocol import Hello, Result, encode
from tests.engine.conftest import PROBE, rank_pid, small_spec, wait_for

GARBAGE = b"\xc1 not msgpack"
TAGS = ("weights", "kv_cache")


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    engine = Engine([small_spec("talker", deadline_s=20.0), small_spec("victim")])
    yield engine
    engine.shutdown()


def counted(engine: Engine) -> int:
    return engine.status()["_engine"].get("frame_errors_RuntimeError", 0)


def stranger_sends(engine: Engine, frame: bytes, identity: bytes = b"stranger") -> None:
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 5000)  # delivered before close returns
    sock.connect(engine.address)
    sock.send(frame)
    sock.close()
    context.term()


def forged_hello(engine: Engine) -> bytes:
    status = engine.status()["talker"]
    return encode(
        Hello(
            task_id="hello",
            epoch=status["epoch"],
            rank=0,
            stage="talker",
            pid=status["ranks"][0]["pid"],
            proof="ab" * 32,
            device="cpu",
            backend="portable",
            tags=TAGS,
        )
    )


def request_result_received(*args: Any) -> bool:
    return isinstance(args[1], I.Received) and isinstance(args[1].message, Result)


# name -> (on what the fault fires, how the test sends that input)
Trigger = Callable[[Engine], Any]
HANDLERS: dict[str, tuple[Callable[..., bool], Trigger]] = {
    "decode": (lambda data, **_: data == GARBAGE, lambda e: stranger_sends(e, GARBAGE)),
    "_on_frames": (lambda identity, data: identity == b"stranger", lambda e: stranger_sends(e, GARBAGE)),
    "_on_hello": (lambda *_: True, lambda e: stranger_sends(e, forged_hello(e))),
    "verify_hello_proof": (lambda *_, **__: True, lambda e: stranger_sends(e, forged_hello(e))),
    # A rank's Result for a request: the request is lost to the fault and ends at its deadline.
    "_step": (request_result_received, lambda e: e.submit("talker", PROBE, timeout_s=3.0)),
    "_apply": (
        lambda stage, step: any(a.error is None for a in step.requests),
        lambda e: e.submit("talker", PROBE, timeout_s=3.0),
    ),
    "_answer": (lambda stage, answer: answer.error is None, lambda e: e.submit("talker", PROBE, timeout_s=3.0)),
    # The last Ack of a sleep: the stage commits, only the caller's answer is lost.
    "_resolve": (
        lambda stage, outcome: outcome is not None and outcome.command == "Sleep",
        lambda e: e._orch.submit("talker", I.SleepCall("iso-sleep", 1, None, 20.0)),
    ),
    "_on_sentinel": (lambda *_: True, lambda e: os.kill(rank_pid(e, "victim", 0), signal.SIGKILL)),
    "_tick": (lambda *_: True, lambda e: None),
}


def raise_once(
    original: Callable[..., Any], name: str, when: Callable[..., bool], error: BaseException | None = None
) -> Callable[..., Any]:
    fired: list[bool] = []

    def fault(*args: Any, **kwargs: Any) -> Any:
        if not fired and when(*args, **kwargs):
            fired.append(True)
            raise error if error is not None else RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)

    return fault


def serves(engine: Engine, reference: Any) -> None:
    for name in ("talker", "victim"):
        state = engine.status()[name]["state"]
        if state == "SLEEPING":
            engine.wake(name)
        elif state != "RUNNING":
            engine.restart(name)
    assert engine.execute("talker", PROBE) == reference
    assert engine.sleep("talker").state == "SLEEPING"
    assert engine.wake("talker").state == "RUNNING"
    assert engine.execute("victim", PROBE) is not None
    assert engine._orch.died_of is None


@pytest.mark.parametrize("name", list(HANDLERS))
def test_an_exception_in_any_loop_handler_is_counted_and_the_engine_serves_on(engine, monkeypatch, name):
    reference = engine.execute("talker", PROBE)
    serves(engine, reference)  # whatever the previous case left
    orch = engine._orch
    owner = orchestrator_module if name in ("decode", "verify_hello_proof") else orch
    when, trigger = HANDLERS[name]
    before = counted(engine)
    monkeypatch.setattr(owner, name, raise_once(getattr(owner, name), name, when))
    sent = trigger(engine)
    wait_for(lambda: counted(engine) == before + 1, what=f"the fault in {name} counted")
    monkeypatch.undo()
    if name == "_step" and isinstance(sent, Future):  # the core never saw the Result: its deadline ends it
        sent.exception(timeout=30)
    if name == "_on_sentinel":  # the death is still seen (the next poll), and named
        wait_for(lambda: engine.status()["victim"]["state"] == "FAILED", what="victim FAILED")
    serves(engine, reference)
    assert counted(engine) == before + 1


def test_a_violated_invariant_ends_the_engine_loudly(engine_factory, monkeypatch):
    engine = engine_factory(small_spec("talker"))
    orch = engine._orch
    violation = InvariantViolation("injected: a core in a state its invariants forbid")
    monkeypatch.setattr(orch, "_on_frames", raise_once(orch._on_frames, "_on_frames", lambda *_: True, violation))
    stranger_sends(engine, GARBAGE)
    wait_for(lambda: orch.died_of is not None, what="the engine to die of the violation")
    assert "InvariantViolation" in orch.died_of
    with pytest.raises(EngineClosedError, match=r"orchestrator failed.*InvariantViolation"):
        engine.execute("talker", PROBE)
