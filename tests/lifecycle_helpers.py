"""Helpers shared by the lifecycle unit tests: drivers that push every message through the
codec (as on the wire), state builders, and a recorder of the transitions that fired. The
stage harness runs on the one simulator (`omni_testing.network`)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

from omni_core.fsm import (
    STAGE_TRANSITIONS,
    WORKER_TRANSITIONS,
    Lifecycle,
    StageCore,
    StageStep,
    WorkerCore,
)
from omni_core.fsm import inputs as I
from omni_core.fsm.worker import CommandReceived, EffectCompleted, EffectRaised, Loaded, WorkerStep
from omni_core.protocol import (
    Command,
    Hello,
    ReloadWeights,
    Reply,
    Shutdown,
    Sleep,
    Wake,
    WorkerState,
    decode,
    decode_command,
    encode,
)
from omni_testing.network import NO_MEMORY as NO_MEMORY  # the lifecycle tests import it from here
from omni_testing.network import Simulator

W = WorkerState
_ids = itertools.count()


def fresh(prefix: str = "t") -> str:
    return f"{prefix}-{next(_ids)}"


def wire(reply: Reply) -> Reply:
    back = decode(encode(reply))
    assert back == reply
    return back  # type: ignore[return-value]


class WorkerDriver:
    """One WorkerCore behind the codec."""

    def __init__(self, worker: WorkerCore | None = None, **kwargs: object) -> None:
        self.w = worker if worker is not None else WorkerCore(0, **kwargs)  # type: ignore[arg-type]

    def send(self, command: Command) -> WorkerStep:
        return self.w.step(CommandReceived(decode_command(encode(command))))

    def run(self, command: Command, **done: object) -> Reply:
        """Send, perform the effect if there is one, and return the one terminal reply."""
        step = self.send(command)
        if step.effect is not None:
            assert not step.replies
            step = self.w.step(EffectCompleted(command.task_id, **done))  # type: ignore[arg-type]
        (reply,) = step.replies
        return wire(reply)

    @property
    def epoch(self) -> int:
        return self.w.epoch


def reach_worker(state: WorkerState, **kwargs: object) -> WorkerDriver:
    """A worker in `state`, reached through legal commands only."""
    d = WorkerDriver(**kwargs)
    if state is W.LOADING:
        return d
    if state is W.FAILED:
        d.w.step(Loaded())
        sleep = Sleep(task_id=fresh("sleep"), epoch=0)
        d.send(sleep)
        d.w.step(EffectRaised(sleep.task_id, "cuMemUnmap returned CUDA_ERROR_INVALID_VALUE"))
        return _check(d, state)
    d.w.step(Loaded())
    if state is W.ACTIVE:
        return d
    if state is W.OFFLOADING:
        d.send(Sleep(task_id=fresh("sleep"), epoch=0))
        return _check(d, state)
    if state is W.STOPPED:
        d.run(Shutdown(task_id=fresh("shutdown"), epoch=0))
        return _check(d, state)
    level = 2 if state in (W.NEEDS_RELOAD, W.RELOADING) else 1
    d.run(Sleep(task_id=fresh("sleep"), epoch=0, level=level))
    if state is W.SLEEPING:
        return _check(d, state)
    if state is W.RESTORING:
        d.send(Wake(task_id=fresh("wake"), epoch=0))
        return _check(d, state)
    if state is W.PARTIAL:
        d.run(Wake(task_id=fresh("wake"), epoch=0, tags=("kv_cache",)))
        return _check(d, state)
    d.run(Wake(task_id=fresh("wake"), epoch=0))
    if state is W.NEEDS_RELOAD:
        return _check(d, state)
    d.send(ReloadWeights(task_id=fresh("reload"), epoch=0))
    return _check(d, W.RELOADING)


def _check(d: WorkerDriver, state: WorkerState) -> WorkerDriver:
    assert d.w.state is state, (d.w.state, state)
    return d


class OnSimulator:
    """A test driver on the one simulator: its stage core, ranks and clock by
    the usual names."""

    sim: Simulator

    @property
    def stage(self) -> StageCore:
        return self.sim.stage

    @property
    def workers(self) -> list[WorkerCore]:
        return self.sim.workers

    @property
    def dead(self) -> set[int]:
        return self.sim.dead

    @property
    def now(self) -> float:
        return self.sim.now

    @now.setter
    def now(self, value: float) -> None:
        self.sim.now = value


class StageHarness(OnSimulator):
    """One StageCore and its WorkerCores on the simulator (`omni_testing.network`), for
    scripted cases that drive the stage core one input at a time (`stage`: the core itself):
    `to_workers` runs a step's commands on the ranks at once (no faults), `feed` hands the
    replies to the stage."""

    def __init__(
        self, ranks: int = 3, *, deadline_s: float = 10.0, hello: bool = True, **worker_kwargs: object
    ) -> None:
        self.worker_kwargs = worker_kwargs
        stage = StageCore("talker", ranks)
        self.sim = Simulator(
            stage, record=False, make_worker=lambda rank, epoch: WorkerCore(rank, epoch=epoch, **worker_kwargs)
        )  # type: ignore[arg-type]
        # hello=False: the ranks stay silent; a test feeds their Hellos itself (h.hello()).
        self.sim.start(deadline_s, hello=hello)
        self.sim.deliver_all()

    def hello(self, rank: int, **fields: object) -> Hello:
        return wire(self.sim.hello(rank, **fields))  # type: ignore[return-value]

    def restart(self) -> int:
        self.sim.restart(10.0)
        self.sim.deliver_all()
        return self.stage.epoch

    def to_workers(self, step: StageStep, *, ranks: set[int] | None = None) -> list[Reply]:
        """Deliver the step's commands (to `ranks` only, if given), perform every effect,
        and return the replies, all through the codec."""
        replies: list[Reply] = []
        for out in step.sends:
            if ranks is None or out.rank in ranks:
                replies += self.sim.run_on_rank(out.rank, out.command)
        return [wire(r) for r in replies]

    def feed(self, replies: list[Reply]) -> StageStep:
        last = StageStep()
        for reply in replies:
            got = self.stage.step(I.Received(reply), self.now)
            if got.outcome is not None or got.sends:
                last = got
        return last

    def complete(self, step: StageStep) -> StageStep:
        """Deliver everything and feed every reply back: the happy path of one task."""
        if step.outcome is not None and not step.sends:
            return step
        return self.feed(self.to_workers(step))


@contextmanager
def record_transitions() -> Iterator[set[tuple[str, str, str]]]:
    """Record every (lifecycle, trigger, source state) that fires while the block runs."""
    fired: set[tuple[str, str, str]] = set()
    original = Lifecycle.fire

    def fire(self: Lifecycle, trigger: str):  # type: ignore[no-untyped-def]
        name = "worker" if self.table is WORKER_TRANSITIONS else "stage" if self.table is STAGE_TRANSITIONS else "?"
        fired.add((name, trigger, self.state.value))
        return original(self, trigger)

    Lifecycle.fire = fire  # type: ignore[method-assign]
    try:
        yield fired
    finally:
        Lifecycle.fire = original  # type: ignore[method-assign]


def table_pairs(name: str) -> set[tuple[str, str, str]]:
    table = WORKER_TRANSITIONS if name == "worker" else STAGE_TRANSITIONS
    return {(name, t.trigger, s.value) for t in table for s in t.sources}
