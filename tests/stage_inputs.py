"""A stage core's inputs for the lifecycle tests, built by name: each function builds the
typed input (omni_core.fsm.inputs) a test means and steps the core with it, the one door,
so the queue moves on, the trace records are written and the invariants are checked as for
the engine. Anything else (state, counters, failure, ...) is read from the core itself."""

from __future__ import annotations

from typing import Any

from lifecycle_helpers import fresh

from omni_core.fsm import StageCommandError, StageCore, StageStep
from omni_core.fsm import inputs as I
from omni_core.protocol import Hello, Reply, Result


def sleep(
    core: StageCore, task_id: str, level: int, tags: tuple[str, ...] | None, now: float, deadline_s: float
) -> StageStep:
    return core.step(I.SleepCall(task_id, level, tags, deadline_s), now)


def wake(
    core: StageCore,
    task_id: str,
    tags: tuple[str, ...] | None,
    now: float,
    deadline_s: float,
    *,
    memory_wait_s: float = 0.0,
) -> StageStep:
    return core.step(I.WakeCall(task_id, tags, deadline_s, memory_wait_s), now)


def reload(core: StageCore, task_id: str, source: str | None, now: float, deadline_s: float) -> StageStep:
    return core.step(I.ReloadCall(task_id, source, deadline_s), now)


def update_weights(
    core: StageCore, task_id: str, version: int, source: Any, now: float, deadline_s: float
) -> StageStep:
    return core.step(I.UpdateCall(task_id, version, source, deadline_s), now)


def share_weights(core: StageCore, task_id: str, bucket_bytes: int, now: float, deadline_s: float) -> StageStep:
    return core.step(I.ShareCall(task_id, bucket_bytes, deadline_s), now)


def init_weight_group(core: StageCore, call: I.WeightGroupCall, now: float) -> StageStep:
    return core.step(call, now)


def profile(core: StageCore, task_id: str, start: bool, prefix: str | None, now: float, deadline_s: float) -> StageStep:
    return core.step(I.ProfileCall(task_id, start, prefix, deadline_s), now)


def pause(core: StageCore, task_id: str, mode: str, now: float, deadline_s: float) -> StageStep:
    return core.step(I.PauseCall(task_id, mode, deadline_s), now)


def resume(core: StageCore, task_id: str, now: float) -> StageStep:
    return core.step(I.ResumeCall(task_id, 30.0), now)


def restart(core: StageCore, now: float, deadline_s: float) -> int:
    core.step(I.Restart(deadline_s), now)
    return core.epoch


def stop(core: StageCore, now: float) -> StageStep:
    return core.step(I.Stop(), now)


def on_hello(core: StageCore, hello: Hello, now: float) -> StageStep:
    return core.step(I.Received(hello), now)


def on_reply(core: StageCore, reply: Reply, now: float) -> StageStep:
    return core.step(I.Received(reply), now)


def on_tick(core: StageCore, now: float) -> StageStep:
    return core.step(I.Tick(), now)


def on_rank_died(core: StageCore, rank: int, detail: str, now: float, *, epoch: int | None = None) -> StageStep:
    return core.step(I.RankExited(rank, detail, core.epoch if epoch is None else epoch), now)


def request_started(core: StageCore, now: float) -> None:
    """A request without payload or deadline dispatched to every rank (the commands are
    not delivered: `request_finished` answers for the ranks); refused outside RUNNING."""
    if not core.admits():
        raise StageCommandError(f"stage {core.name!r} admits no request in {core.state.value}")
    request_id = fresh("request")
    core.step(I.Submit(request_id, None, float("inf")), now)
    assert request_id in core.in_flight, f"{request_id} was not dispatched"


def request_finished(core: StageCore, now: float) -> StageStep:
    """Every rank answers the oldest request in flight; the step of the last answer."""
    request_id = next(iter(core.in_flight))
    step = StageStep()
    for rank in core.ranks:
        version = core.weights_version
        result = Result(task_id=request_id, epoch=core.epoch, rank=rank, output=None, weights_version=version)
        step = core.step(I.Received(result), now)
    return step
