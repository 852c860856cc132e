"""What the Engine hands the orchestrator: typed inputs, built whole (task id, deadline,
request id), never a callable; no rank process is started (the orchestrator is a stand-in
that records what is queued)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import pytest

from omni_core.engine import Engine, InvalidArgumentError, OmniCoreError, StageSpec, SwapFailedError
from omni_core.engine import api as engine_api
from omni_core.engine.calls import ShutdownCall, StatusQuery, SwapRequest
from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy

SPECS = (StageSpec("a", deadline_s=7.0, start_deadline_s=30.0, request_timeout_s=11.0), StageSpec("b"))


class RecordingOrchestrator:
    """Answers every queued call at once (None; a swap's halves refused) and records (stage, call)."""

    def __init__(self, specs: Any, **_: Any) -> None:
        self.queued: list[tuple[str | None, object]] = []
        self.closed = False
        self.address = "recorded"

    def submit(self, stage: str | None, call: object) -> Future:
        self.queued.append((stage, call))
        if isinstance(call, SwapRequest):  # each half's outcome: refused, so the swap fails at once
            for half in (call.out_future, call.in_future):
                half.set_exception(OmniCoreError("refused by the stand-in"))
        future: Future = Future()
        future.set_result(None)
        return future

    def new_task_id(self, kind: str, stage: str) -> str:
        return f"{kind}-{stage}-new"

    def new_request_id(self, stage: str) -> str:
        return f"req-{stage}-1"

    def join(self, timeout_s: float) -> None:
        self.closed = True


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Engine:
    monkeypatch.setattr(engine_api, "Orchestrator", RecordingOrchestrator)
    return Engine(SPECS)


def queued(engine: Engine) -> list[tuple[str | None, object]]:
    orch = engine._orch
    assert isinstance(orch, RecordingOrchestrator)
    return orch.queued


def test_the_start_queues_each_stage_its_start_with_its_deadline(engine: Engine) -> None:
    assert queued(engine) == [("a", I.Start(30.0)), ("b", I.Start(SPECS[1].start_deadline_s))]


def test_lifecycle_calls_are_the_cores_inputs_with_task_id_and_deadline(engine: Engine) -> None:
    del queued(engine)[:]
    engine.sleep("a", 2, "weights", task_id="t1", abort_in_flight=True)
    engine.wake("a", timeout_s=3)
    engine.reload_weights("a", "/ckpt")
    engine.profile("a", start=False, task_id="p1")
    engine.set_admission("a", "reject")
    engine.restart("a")
    engine.pause("a", "keep", timeout_s=2)
    engine.resume("a")
    engine.resume("a", task_id="u1", timeout_s=3)
    assert queued(engine) == [
        ("a", I.SleepCall("t1", 2, ("weights",), 7.0, True)),
        ("a", I.WakeCall("wake-a-new", None, 3.0)),
        ("a", I.ReloadCall("reload-a-new", "/ckpt", 7.0)),
        ("a", I.ProfileCall("p1", False, None, 7.0)),
        ("a", I.SetAdmission(AdmissionPolicy.REJECT)),
        ("a", I.Restart(30.0)),
        ("a", I.PauseCall("pause-a-new", "keep", 2.0)),
        ("a", I.ResumeCall("resume-a-new", 7.0)),  # the stage's deadline_s, as every call's
        ("a", I.ResumeCall("u1", 3.0)),
    ]


class SilentOrchestrator(RecordingOrchestrator):
    """Never answers a lifecycle call: the caller's own bound must end its wait."""

    def submit(self, stage: str | None, call: object) -> Future:
        if isinstance(call, (I.PauseCall, I.ResumeCall)):
            self.queued.append((stage, call))
            return Future()
        return super().submit(stage, call)


@pytest.mark.parametrize("verb", ["pause", "resume"])
def test_a_resume_waits_no_longer_than_its_deadline_as_a_pause(monkeypatch: pytest.MonkeyPatch, verb: str) -> None:
    monkeypatch.setattr(engine_api, "Orchestrator", SilentOrchestrator)
    monkeypatch.setattr(engine_api, "WAIT_GRACE_S", 0.0)
    engine = Engine([StageSpec("c", deadline_s=600.0, request_timeout_s=0.25)])
    call = getattr(engine, verb)
    # Budget: the call's deadline plus the stage's request_timeout_s (plus the grace, 0 here),
    # not the stage's deadline_s of 600 s.
    with pytest.raises(OmniCoreError, match=r"no answer from the orchestrator within 0\.3 s"):
        call("c", timeout_s=0.05)
    with pytest.raises(InvalidArgumentError, match="timeout_s must be a positive number"):
        call("c", timeout_s=-1)
    assert [type(c) for _, c in queued(engine)][-1] is (I.PauseCall if verb == "pause" else I.ResumeCall)


def test_a_request_is_a_submit_with_its_budget_and_a_bad_one_is_refused_in_its_future(engine: Engine) -> None:
    del queued(engine)[:]
    engine.submit("a", {"x": 1})
    engine.submit("a", None, timeout_s=2)
    assert queued(engine) == [("a", I.Submit("req-a-1", {"x": 1}, 11.0)), ("a", I.Submit("req-a-1", None, 2.0))]
    unknown = engine.submit("nope", None)
    with pytest.raises(InvalidArgumentError, match="unknown stage 'nope'"):
        unknown.result(0)
    assert len(queued(engine)) == 2


def test_status_swap_and_shutdown_are_the_engines_own_calls(engine: Engine) -> None:
    del queued(engine)[:]
    engine.status()
    with pytest.raises(SwapFailedError, match="refused by the stand-in"):
        engine.swap("a", "b", task_id="s1", timeout_s=4, memory_wait_s=1)
    engine.shutdown(timeout_s=2)
    (status, swap, shutdown) = queued(engine)
    assert status == (None, StatusQuery())
    assert shutdown == (None, ShutdownCall(2))
    stage, request = swap
    assert stage is None and isinstance(request, SwapRequest)
    assert (request.out_name, request.sleep, request.in_name, request.wake) == (
        "a",
        I.SleepCall("s1/out", 1, None, 4.0),
        "b",
        I.WakeCall("s1/in", None, 4.0, 1.0),
    )
    assert not any(callable(call) for _, call in queued(engine))
