"""What the Engine queues for the orchestrator's thread: the stage cores' typed inputs
(`omni_core.fsm.inputs`) for one stage, and the three calls that are the engine's own (a
status query, a swap of two stages, the shutdown). The orchestrator dispatches on the type,
after `check_request` refused a request no rank could read."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from omni_core.engine.errors import InvalidPayloadError, PayloadTooLargeError
from omni_core.engine.report import LifecycleReport
from omni_core.engine.spec import StageSpec
from omni_core.fsm import inputs as I
from omni_core.fsm.adapters import adapter_name_problem
from omni_core.protocol import Execute, encode, payload_problem
from omni_core.protocol.codec import wire_int_problem

# A lifecycle task of one stage whose caller is answered with a `LifecycleReport`.
ReportCall = (
    I.SleepCall
    | I.WakeCall
    | I.ReloadCall
    | I.UpdateCall
    | I.WeightGroupCall
    | I.ShareCall
    | I.CommandCall
    | I.PauseCall
    | I.ResumeCall
)
# A lifecycle task of one stage: the caller waits for its outcome under its task_id (a
# ProfileCall's is a `ProfileReport`).
LifecycleCall = ReportCall | I.ProfileCall
# The inputs an Engine call hands one stage's core.
StageCall = I.Start | I.Restart | I.Submit | I.SetAdmission | LifecycleCall


@dataclass(frozen=True)
class StatusQuery:
    """Every stage's state, its ranks and the engine's counters (Engine.status)."""


@dataclass(frozen=True)
class ShutdownCall:
    """Tell every rank to shut down; the loop ends once they exited or `timeout_s` passed."""

    timeout_s: float


@dataclass(frozen=True)
class SwapRequest:
    """Engine.swap: `sleep` to stage `out_name` and `wake` to stage `in_name` in one turn of the
    loop; each half's outcome settles its own future (`out_future`, `in_future`)."""

    out_name: str
    sleep: I.SleepCall
    out_future: Future[LifecycleReport]
    in_name: str
    wake: I.WakeCall
    in_future: Future[LifecycleReport]


EngineCall = StatusQuery | ShutdownCall | SwapRequest


def check_request(spec: StageSpec, submit: I.Submit, epoch: int) -> None:
    """Raise InvalidPayloadError or PayloadTooLargeError, naming why, for a request no rank
    could read: a payload that is not plain data or does not encode, or a frame over the
    stage's max_frame_bytes."""
    name = spec.name
    problem = payload_problem(submit.payload)
    if problem is None and submit.adapter is not None:
        problem = adapter_name_problem(submit.adapter)
    if problem is not None:
        raise InvalidPayloadError(f"the request to stage {name!r} was not sent: {problem}")
    try:
        execute = Execute(task_id=submit.request_id, epoch=epoch, payload=submit.payload, adapter=submit.adapter)
        size_bytes = len(encode(execute))
    except OverflowError as exc:
        raise InvalidPayloadError(f"the request to stage {name!r} was not sent: {wire_int_problem(exc)}") from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidPayloadError(
            f"the request to stage {name!r} was not sent: its payload cannot be encoded "
            f"({type(exc).__name__}: {str(exc)[:200]}); a payload must be made of dict, "
            "list, str, bytes, int, float, bool and None"
        ) from None
    if size_bytes > spec.max_frame_bytes:
        raise PayloadTooLargeError(
            f"the request to stage {name!r} encodes to {size_bytes} bytes, over its "
            f"max_frame_bytes of {spec.max_frame_bytes}; send less or raise "
            "StageSpec.max_frame_bytes"
        )
