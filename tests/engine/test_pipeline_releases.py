"""P-22's releases in `Engine.pipeline`, counted: every hop's producer is released exactly once
on every path; the consumer is released on every path but the one where its request ended on
its rank with a Result (the rank drops a landing when the request naming it ends), and the
releases of one request go out together (one per stage at a time), then are waited for."""

from __future__ import annotations

import os
import signal
from collections import Counter
from concurrent.futures import Future
from typing import Any

import pytest

from omni_core.engine import OmniCoreError, PipelineError, PipelineStage
from omni_core.fsm.inputs import CommandCall
from omni_core.protocol import TransferRelease
from tests.engine.conftest import SMALL_RUNNER, rank_pid, small_spec, wait_for

EXPORT = {"seed": 5, "batch": 2}
PEEK = "tests.engine.peek_runner:PeekRunner"


def stages(last: dict[str, Any] | None = None, **first: Any) -> list[PipelineStage]:
    return [PipelineStage("text", EXPORT, export=("hidden",), **first), PipelineStage("image", last or {})]


class Spy:
    """Each TransferRelease the engine queues, by stage, and the order of queueing and waiting."""

    def __init__(self, engine: Any) -> None:
        self.released: Counter[str] = Counter()
        self.events: list[str] = []
        self.refuse: str | None = None  # a stage whose release is answered with an error
        submit, wait = engine._orch.submit, engine._wait

        def spied_submit(stage: str | None, call: Any) -> Future[Any]:
            if isinstance(call, CommandCall) and isinstance(call.command, TransferRelease):
                self.released[str(stage)] += 1
                self.events.append(f"release {stage}")
                if stage == self.refuse:
                    refused: Future[Any] = Future()
                    refused.set_exception(OmniCoreError(f"stage {stage!r} refused the release (the test's)"))
                    return refused
            return submit(stage, call)

        def spied_wait(future: Future[Any], budget_s: float) -> Any:
            self.events.append("wait")
            return wait(future, budget_s)

        engine._orch.submit, engine._wait = spied_submit, spied_wait


def holds(engine: Any, stage: str) -> dict[str, int]:
    return engine._orch.stage(stage).core.transfers.held


def consumer(engine_factory: Any, **image: Any) -> Any:
    return engine_factory(small_spec("text"), small_spec("image", runner=PEEK, **image))


def test_a_result_releases_the_producer_once_and_the_rank_dropped_its_landing(engine_factory) -> None:
    engine = consumer(engine_factory)
    spy = Spy(engine)
    # The runner never takes the landing: the rank drops it when the request ends.
    assert engine.pipeline(stages({"peek": True}), request_id="ok").output == {"held": 1}
    assert spy.released == {"text": 1} and not holds(engine, "text")
    assert engine.execute("image", {"peek": True}) == {"held": 0}


def test_the_releases_of_a_request_go_out_together(engine_factory) -> None:
    engine = engine_factory(small_spec("text"), small_spec("mid", runner=PEEK), small_spec("image"))
    spy = Spy(engine)
    three = [stages()[0], PipelineStage("mid", {}, export=("hidden",)), PipelineStage("image", {})]
    engine.pipeline(three, request_id="three")
    assert spy.released == {"text": 1, "mid": 2}  # hop 0 at both ends, hop 1 at its producer
    tail = spy.events[spy.events.index("release text") :]
    # One task at a time per stage: the two ends of hop 0 together, then mid's own export.
    assert tail == ["release text", "release mid", "wait", "wait", "release mid", "wait"]
    assert not holds(engine, "text") and not holds(engine, "mid")


def test_a_failed_request_releases_both_ends_once(engine_factory) -> None:
    engine = consumer(engine_factory)
    spy = Spy(engine)
    with pytest.raises(PipelineError, match="before it takes its landing"):
        engine.pipeline(stages({"fail": True}), request_id="fails")
    assert spy.released == {"text": 1, "image": 1} and not holds(engine, "text")
    assert engine.execute("image", {"peek": True}) == {"held": 0}


def test_a_hop_that_never_landed_releases_its_producer_once(engine_factory) -> None:
    engine = consumer(engine_factory, runner_args=dict(SMALL_RUNNER, hidden=64))
    spy = Spy(engine)
    with pytest.raises(PipelineError, match="declared for producer weights version 3"):
        engine.pipeline(stages(expect_version=3), request_id="version")
    with pytest.raises(PipelineError, match="did not land on stage 'image'"):
        engine.pipeline(stages(), request_id="shape")
    assert spy.released == {"text": 2} and not holds(engine, "text")


def test_a_dead_consumer_releases_the_producer_once(engine_factory) -> None:
    engine = consumer(engine_factory)
    spy = Spy(engine)
    os.kill(rank_pid(engine, "image", 0), signal.SIGKILL)
    wait_for(lambda: engine.status()["image"]["state"] == "FAILED", what="the consumer FAILED")
    with pytest.raises(PipelineError, match="the consumer is FAILED"):
        engine.pipeline(stages(), request_id="dead")
    assert spy.released == {"text": 1} and not holds(engine, "text")


def test_a_refused_release_at_one_end_still_releases_the_other(engine_factory) -> None:
    engine = consumer(engine_factory)
    spy = Spy(engine)
    spy.refuse = "image"
    with pytest.raises(OmniCoreError, match="refused the release"):
        engine.pipeline(stages({"fail": True}), request_id="refused")
    assert spy.released == {"text": 1, "image": 1} and not holds(engine, "text")
    engine.sleep("text", 1)  # nothing holds the producer awake
