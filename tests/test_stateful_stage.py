"""One StageCore with N ranks (real WorkerCores) on the one simulator (`omni_testing.network`),
whose network hypothesis drives to deliver in any order, duplicate, drop, and replay replies
from older epochs or for unknown tasks; plus time, dead ranks, restarts, requests and API
calls with fresh or reused task_ids, every engine input through `StageCore.step`. Compared
after every step with the independent `StageModel` and checked against the protocol's
properties. The same machine run against deliberately broken stages must fail."""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable

import pytest
import stage_inputs
from broken_variants import BROKEN, CommitsOnFirstAckStage, NoEpochFenceStage, NoEpochFenceWorker
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from lifecycle_helpers import OnSimulator
from reference_models import (
    SETTLED,
    STAGE_OF,
    Call,
    ModelMismatch,
    PropertyViolation,
    StageModel,
    require,
)

from omni_core.fsm import StageBusyError, StageCommandError, StageCore, StageStep, TaskOutcome, WorkerCore
from omni_core.fsm import inputs as I
from omni_core.fsm.worker import WorkerStep
from omni_core.protocol import (
    Ack,
    AckStatus,
    Hello,
    Nack,
    NackReason,
    Reply,
    StageState,
    WorkerState,
    decode,
    decode_command,
    encode,
)
from omni_testing.network import Envelope, Simulator

S = StageState
W = WorkerState
TAGS = ("weights", "kv_cache", "scratch")
START_DEADLINE_S = 10.0
TAG_CHOICES = [
    None,
    None,
    None,
    ("weights",),
    ("kv_cache",),
    ("scratch",),
    ("weights", "kv_cache"),
    ("kv_cache", "scratch"),
    ("kv_cache", "weights", "scratch"),
    ("lora",),
]
POOL = [f"a{i}" for i in range(5)]
RANK_OF_STAGE = {stage: rank for rank, stage in STAGE_OF.items()} | {S.PAUSED: W.ACTIVE}
MAX_IN_FLIGHT = 40  # messages in the simulated network: duplication stops here


def quiet(step: StageStep) -> bool:
    """Nothing to send, no task outcome, no request answered (a start's end may be reported)."""
    return not step.sends and step.outcome is None and not step.requests


class StageMachine(RuleBasedStateMachine, OnSimulator):
    """Subclasses swap `make_stage` for a broken stage; the checks stay the same."""

    examples = 0

    @staticmethod
    def make_stage(ranks: int) -> StageCore:
        return StageCore("talker", ranks, tags=TAGS)

    @staticmethod
    def make_worker(rank: int, epoch: int) -> WorkerCore:
        return WorkerCore(rank, tags=TAGS, epoch=epoch)

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1
        self.outcomes: dict[str, TaskOutcome] = {}  # every task that ended, by task_id
        self.acked_by: dict[tuple[int, str], set[int]] = {}  # (epoch, task_id) -> ranks whose ACK arrived
        self.hellos: set[int] = set()  # ranks whose Hello of this epoch arrived while STARTING
        self.last_call: tuple | None = None
        self._fresh = itertools.count()

    @initialize(ranks=st.integers(1, 4), hellos_now=st.sampled_from([True, True, True, False]))
    def start(self, ranks: int, hellos_now: bool) -> None:
        # Asynchronous rank shells: a command may meet a busy worker core (the harsher test).
        self.sim = Simulator(self.make_stage(ranks), make_worker=self.make_worker, serial_shell=False, record=False)
        self.model = StageModel(ranks, TAGS, start_deadline_at=self.sim.now + START_DEADLINE_S)
        self.sim.start(START_DEADLINE_S)
        self._spawned(hellos_now)

    def _spawned(self, hellos_now: bool) -> None:
        """Fresh rank processes for the stage's current epoch sent their Hellos; with
        `hellos_now` they arrive at once, else they stay in the network with the rest."""
        self.hellos = set()
        if hellos_now:
            epoch = self.stage.epoch
            for envelope in [e for e in self.sim.network if e.kind == "Hello" and e.epoch == epoch]:
                self._deliver(envelope)

    # ------------------------------------------------------------------ network rules

    @precondition(lambda self: self.sim.network)
    @rule(op=st.sampled_from(["deliver"] * 4 + ["duplicate", "drop"]), pick=st.integers(0, MAX_IN_FLIGHT))
    def network(self, op: str, pick: int) -> None:
        """Deliver any message in flight (not the oldest: the network reorders), or copy one,
        or lose one."""
        envelope = self.sim.network[pick % len(self.sim.network)]
        if op == "deliver":
            self._deliver(envelope)
        elif op == "duplicate" and len(self.sim.network) < MAX_IN_FLIGHT:
            self.sim.duplicate(envelope)
        elif op == "drop":
            self.sim.drop(envelope)

    @precondition(lambda self: self.sim.busy_ranks())
    @rule(pick=st.integers(0, 3), fail=st.sampled_from([False] * 5 + [True]))
    def finish_effect(self, pick: int, fail: bool) -> None:
        """A rank's shell finishes its pending effect (or the backend raises)."""
        busy = self.sim.busy_ranks()
        self._finish(busy[pick % len(busy)], fail)

    @precondition(lambda self: self.sim.network or self.sim.busy_ranks())
    @rule(seed=st.integers(0, 2**16), fail_one=st.sampled_from([False] * 5 + [True]))
    def settle(self, seed: int, fail_one: bool = False) -> None:
        """A calm stretch: everything in flight arrives (in a random order), every effect
        completes (with `fail_one`, the first one raises in the backend instead)."""
        rnd = random.Random(seed)
        for _ in range(200):
            network, busy = self.sim.network, self.sim.busy_ranks()
            if not network and not busy:
                return
            pick = rnd.randrange(len(network) + len(busy))
            if pick < len(network):
                self._deliver(network[pick])
            else:
                self._finish(busy[pick - len(network)], fail_one)
                fail_one = False

    @precondition(lambda self: self.stage.state is not S.STARTING or self.stage.epoch > 0)
    @rule(
        stale=st.booleans(),
        rank=st.integers(0, 3),
        current_task=st.booleans(),
        nack=st.booleans(),
        back=st.integers(1, 3),
    )
    def inject_reply(self, stale: bool, rank: int, current_task: bool, nack: bool, back: int) -> None:
        """A reply from an older epoch (a rank process of before a restart), possibly naming
        the current task and reporting exactly the state the stage waits for; or a reply of
        this epoch for a task the stage never started."""
        rank %= len(self.stage.ranks)
        if stale and self.stage.epoch > 0:
            task = self.model.task
            task_id = task.task_id if current_task and task is not None else f"old-{next(self._fresh)}"
            forged = self._forged(rank, task_id, max(0, self.stage.epoch - back), nack)
        else:
            forged = self._forged(rank, f"ghost-{next(self._fresh)}", self.stage.epoch, nack)
        self._reply(decode(encode(forged)), lambda: self.sim.receive(forged))  # type: ignore[arg-type]

    def _forged(self, rank: int, task_id: str, epoch: int, nack: bool) -> Reply:
        task = self.model.task
        state = task.expect_state if task is not None else W.SLEEPING
        asleep = tuple(sorted(task.expect_asleep)) if task is not None else TAGS
        if nack:
            return Nack(
                task_id=task_id,
                epoch=epoch,
                rank=rank,
                command="Sleep",
                reason=NackReason.BUSY,
                detail="forged",
                state=state,
            )
        return Ack(task_id=task_id, epoch=epoch, rank=rank, command="Sleep", state=state, asleep_tags=asleep)

    # ------------------------------------------------------------------ time, deaths, restarts

    @rule(dt=st.sampled_from([0.5, 1.0, 3.0, 12.0]))
    def tick(self, dt: float) -> None:
        task = self.model.task
        silent = None
        if task is not None and task.sent:
            silent = set(self.stage.ranks) - self.acked_by.get((self.stage.epoch, task.task_id), set())
        starting_silent = set(self.stage.ranks) - self.hellos
        before = self.stage.state
        expect = self.model.tick(self.now + dt)
        step = self.sim.advance(dt)
        self._check_all_ranks_commit()
        if expect is None:
            if not quiet(step) or self.stage.state is not before:
                raise ModelMismatch(f"tick at {self.now} did {step} ({before.value} -> {self.stage.state.value})")
            return
        if expect.kind == "fail":
            named = starting_silent if before is S.STARTING else silent
            # P-9: FAILED, naming exactly the ranks that stayed silent.
            require(self.stage.state is S.FAILED, "P-9", f"deadline passed, stage still {self.stage.state.value}")
            require(
                set(self.stage.failed_ranks) == named,
                "P-9",
                f"deadline: stage names ranks {sorted(self.stage.failed_ranks)}, silent were {sorted(named)}",
            )
            for rank in named:  # type: ignore[union-attr]
                require(f"rank {rank}" in self.stage.failure, "P-9", f"rank {rank} not named: {self.stage.failure}")
            if before is not S.STARTING:
                outcome = self._outcome(step)
                require(not outcome.ok and set(outcome.failures) == named, "P-9", f"deadline outcome {outcome}")
        else:  # drain timeout: nothing was sent, back to RUNNING
            outcome = self._outcome(step)
            require(
                not outcome.ok and self.stage.state is S.RUNNING and not step.sends,
                "model",
                f"drain timeout gave {step} in {self.stage.state.value}",
            )

    @precondition(lambda self: len(self.dead) < len(self.stage.ranks))
    @rule(rank=st.integers(0, 3))
    def kill(self, rank: int) -> None:
        alive = [r for r in self.stage.ranks if r not in self.dead]
        rank = alive[rank % len(alive)]
        expect = self.model.rank_died(rank)
        step = self.sim.crash(rank, "SIGKILL")
        assert step is not None  # the process was not told to exit: the engine reports it
        if expect is None:
            if not quiet(step):
                raise ModelMismatch(f"rank death in {self.stage.state.value} gave {step}")
            return
        require(
            self.stage.state is S.FAILED and set(self.stage.failed_ranks) == {rank},
            "P-9",
            f"rank {rank} died: stage {self.stage.state.value}, names {sorted(self.stage.failed_ranks)}",
        )
        require(f"rank {rank}" in self.stage.failure and "SIGKILL" in self.stage.failure, "P-9", self.stage.failure)
        if step.outcome is not None:
            self._record(step.outcome)

    @rule(hellos_now=st.sampled_from([True, True, False]))
    def restart(self, hellos_now: bool) -> None:
        legal = self.model.restart(self.now, START_DEADLINE_S)
        try:
            self.sim.restart(START_DEADLINE_S)
        except StageCommandError as exc:
            if legal:
                raise ModelMismatch(f"restart refused in {self.stage.state.value}: {exc}") from None
            return
        if not legal:
            raise ModelMismatch(f"restart accepted in {self.stage.state.value}")
        epoch = self.stage.epoch
        require(epoch == self.model.epoch, "P-9", f"restart gave epoch {epoch}, expected {self.model.epoch}")
        self._spawned(hellos_now)

    # ------------------------------------------------------------------ requests and API calls

    @rule(finish=st.booleans())
    def request(self, finish: bool) -> None:
        """A request starts (admission) or one in flight finishes."""
        if finish and self.model.requests > 0:
            self.request_finish()
        else:
            self.request_start()

    def request_start(self) -> None:
        legal = self.model.request_started()
        try:
            stage_inputs.request_started(self.stage, self.now)
        except StageCommandError as exc:
            if legal:
                raise ModelMismatch(f"request refused in {self.stage.state.value}: {exc}") from None
            return
        if not legal:
            raise ModelMismatch(f"request admitted in {self.stage.state.value}")
        self._check_admission()

    def request_finish(self) -> None:
        sends = self.model.request_finished()
        step = stage_inputs.request_finished(
            self.stage, self.now
        )  # every rank answers it; the shell sends what it says
        if self.model.just_paused:  # the last request of a pause's drain: PAUSED, nothing sent
            self._done(step)
        else:
            self._check_sends(step, sends)
        self.sim.apply(step)

    @rule(
        kind=st.sampled_from(["sleep", "wake", "reload", "pause", "resume", "retry", "retry"]),
        task=st.integers(0, 9),
        level=st.sampled_from([1, 1, 2]),
        tags=st.sampled_from(TAG_CHOICES),
        deadline_s=st.sampled_from([2.0, 5.0, 30.0]),
    )
    def api(self, kind: str, task: int, level: int, tags: tuple[str, ...] | None, deadline_s: float) -> None:
        """An API call with a pooled (so reused) or fresh task_id; "retry" repeats the last
        call exactly, with its task_id (in flight: re-send to silent ranks; ended: the record)."""
        if kind == "retry" and self.last_call is not None:
            kind, task_id, level, tags, deadline_s = self.last_call
        else:
            task_id = self._task_id(task)
        if kind == "sleep":
            self.api_sleep(task_id, level, tags, deadline_s)
        elif kind == "wake":
            self.api_wake(task_id, tags, deadline_s)
        elif kind == "pause":
            self.api_pause(task_id, "abort" if level == 2 else "wait", deadline_s)
        elif kind == "resume":
            self.last_call = ("resume", task_id, 1, None, deadline_s)
            self._api(task_id, self.model.resume(task_id), lambda: self.sim.call(I.ResumeCall(task_id, 30.0)))
        else:
            self.api_reload(task_id, None if level == 1 else "ckpt", deadline_s)

    def api_sleep(self, task_id: str, level: int, tags: tuple[str, ...] | None, deadline_s: float) -> None:
        self.last_call = ("sleep", task_id, level, tags, deadline_s)
        self._api(
            task_id,
            self.model.sleep(task_id, level, tags, self.now, deadline_s),
            lambda: self.sim.call(I.SleepCall(task_id, level, tags, deadline_s)),
        )

    def api_wake(self, task_id: str, tags: tuple[str, ...] | None, deadline_s: float) -> None:
        self.last_call = ("wake", task_id, 1, tags, deadline_s)
        self._api(
            task_id,
            self.model.wake(task_id, tags, self.now, deadline_s),
            lambda: self.sim.call(I.WakeCall(task_id, tags, deadline_s)),
        )

    def api_pause(self, task_id: str, mode: str, deadline_s: float) -> None:
        self.last_call = ("pause", task_id, 2 if mode == "abort" else 1, None, deadline_s)
        self._api(
            task_id,
            self.model.pause(task_id, mode, self.now, deadline_s),
            lambda: self.sim.call(I.PauseCall(task_id, mode, deadline_s)),
        )

    def api_reload(self, task_id: str, source: str | None, deadline_s: float) -> None:
        self.last_call = ("reload", task_id, 1 if source is None else 2, None, deadline_s)
        self._api(
            task_id,
            self.model.reload(task_id, source, self.now, deadline_s),
            lambda: self.sim.call(I.ReloadCall(task_id, source, deadline_s)),
        )

    @rule(
        pick=st.integers(0, 3),
        level=st.sampled_from([1, 2]),
        tags=st.sampled_from(TAG_CHOICES[:-1]),
        task=st.integers(0, 9),
        settle_now=st.sampled_from([True, True, False]),
        seed=st.integers(0, 2**16),
    )
    def progress(
        self, pick: int, level: int, tags: tuple[str, ...] | None, task: int, settle_now: bool, seed: int
    ) -> None:
        """The call that usually moves the stage on from where it is, so runs get deep
        (level-2 sleep, partial wake, reload, retries) between the chaos rules."""
        state = self.model.state
        task_id = self._task_id(task)
        if state in (S.FAILED, S.STOPPED):
            self.restart(hellos_now=True)
        elif state is S.RUNNING and pick == 3:  # a request in flight: the sleep has to drain
            self.request_start()
            self.api_sleep(task_id, level, tags, 5.0)
        elif state is S.RUNNING or (state in (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD) and pick == 0):
            self.api_sleep(task_id, level, tags, 30.0)
        elif state is S.NEEDS_RELOAD and pick >= 2:
            self.api_reload(task_id, None if pick == 2 else "ckpt", 30.0)
        elif state in (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD):
            self.api_wake(task_id, tags, 30.0)
        elif state is S.DRAINING and self.model.requests:
            self.request_finish()
        if settle_now and (self.sim.network or self.sim.busy_ranks()):
            self.settle(seed)

    # Hypothesis picks among enabled rules evenly: a second name doubles the weight of progress.
    progress_again = progress

    def _task_id(self, task: int) -> str:
        return POOL[task] if task < len(POOL) else f"fresh-{next(self._fresh)}"

    def _api(self, task_id: str, expect: Call, call) -> None:  # type: ignore[no-untyped-def]
        before = self._snapshot()
        try:
            step = call()
        except StageCommandError as exc:
            if expect.kind != "raise":
                raise ModelMismatch(f"stage refused a legal call ({expect.kind}) in {before[0].value}: {exc}") from None
            if expect.busy and not isinstance(exc, StageBusyError):
                raise ModelMismatch(f"a call while a task is in flight must be StageBusyError: {exc!r}") from None
            require(self._snapshot() == before, "P-11", f"a refused call changed the stage: {exc}")
            return
        if expect.kind == "raise":
            raise ModelMismatch(f"stage accepted a call the model refuses, in {before[0].value}: {step}")
        if expect.kind == "recorded":
            recorded = self.outcomes.get(task_id)
            require(
                step.outcome is not None and step.outcome is recorded and not step.sends,
                "P-1",
                f"retry of ended task {task_id!r} gave {step}, not its one outcome {recorded}",
            )
            return
        if expect.kind == "done":
            self._done(step)
            return
        if expect.kind == "already":
            outcome = self._outcome(step)
            require(
                outcome.ok and outcome.status is AckStatus.ALREADY and not step.sends,
                "P-4",
                f"nothing to do must be ALREADY with nothing sent: {step}",
            )
            return
        self._check_sends(step, expect.sends)

    def _done(self, step: StageStep) -> None:
        """A pause or a resume ended where it began: OK, nothing sent to any rank."""
        outcome = self._outcome(step)
        require(
            outcome.ok and outcome.status is AckStatus.OK and not step.sends,
            "P-5",
            f"a pause or resume must end OK with nothing sent: {step}",
        )

    def _check_sends(self, step: StageStep, ranks: frozenset[int]) -> None:
        if step.outcome is not None or sorted(o.rank for o in step.sends) != sorted(ranks):
            raise ModelMismatch(f"expected commands to ranks {sorted(ranks)}, got {step}")
        for out in step.sends:
            if out.command.epoch != self.stage.epoch or out.command.task_id != self.stage.task_id:
                raise ModelMismatch(f"command {out.command!r} is not for the current task and epoch")

    # ------------------------------------------------------------------ delivery

    def _deliver(self, envelope: Envelope) -> None:
        """One message in flight arrives, through the simulator, checked on both sides."""
        if envelope.to is None:
            message = decode(envelope.data)
            if isinstance(message, Hello):
                self._hello(message, lambda: self.sim.deliver(envelope))  # type: ignore[arg-type,return-value]
            else:
                self._reply(message, lambda: self.sim.deliver(envelope))  # type: ignore[arg-type,return-value]
            return
        if envelope.to in self.dead:
            self.sim.deliver(envelope)  # lost: the process is gone
            return
        worker = self.workers[envelope.to]
        command = decode_command(envelope.data)
        stale = command.epoch < worker.epoch
        step = self.sim.deliver(envelope)
        if stale:
            require(
                isinstance(step, WorkerStep)
                and len(step.replies) == 1
                and step.replies[0].reason is NackReason.STALE_EPOCH,
                "P-6",
                f"rank {worker.rank} (epoch {worker.epoch}) answered {command!r} with {step}",
            )

    def _finish(self, rank: int, fail: bool) -> None:
        self.sim.perform(rank, error="CUDA error: an illegal memory access" if fail else None)

    def _hello(self, hello: Hello, deliver: Callable[[], StageStep]) -> None:
        before, stale_before = self.stage.state, self.stage.counters.stale_replies_ignored
        expect = self.model.hello_from(hello.rank, hello.epoch)
        if expect == "ok":
            self.hellos.add(hello.rank)
        step = deliver()
        require(quiet(step) and step.started in (None, self.stage.state), "model", f"Hello gave {step}")
        if expect == "stale":
            require(
                self.stage.state is before and self.stage.counters.stale_replies_ignored == stale_before + 1,
                "P-6",
                f"Hello {hello!r} must be counted and ignored in {before.value}",
            )
        self._check_all_ranks_commit()

    def _reply(self, reply: Reply, deliver: Callable[[], StageStep]) -> None:
        stage = self.stage
        before = self._snapshot()
        counters = dataclasses.asdict(stage.counters)
        current = stage.task_id
        if isinstance(reply, Ack) and reply.epoch == stage.epoch and reply.task_id == current:
            self.acked_by.setdefault((stage.epoch, reply.task_id), set()).add(reply.rank)
        expect = self.model.reply(
            epoch=reply.epoch,
            task_id=reply.task_id,
            rank=reply.rank,
            is_nack=isinstance(reply, Nack),
            state=getattr(reply, "state", None),
            asleep=frozenset(getattr(reply, "asleep_tags", ())),
        )
        step = deliver()

        # P-6 first: what must be ignored is ignored, and counted once under the right name.
        counter = {
            "stale": "stale_replies_ignored",
            "unknown": "unknown_replies_ignored",
            "duplicate": "duplicate_replies_ignored",
        }.get(expect.kind)
        if counter is not None:
            rose = {k: v - counters[k] for k, v in dataclasses.asdict(stage.counters).items() if v != counters[k]}
            require(
                quiet(step) and self._snapshot() == before and rose == {counter: 1},
                "P-6",
                f"{expect.kind} reply {reply!r} must change nothing and count once as {counter}; "
                f"got {step}, counters {rose}, state {before[0].value} -> {stage.state.value}",
            )
        # P-5: a commit needs an ACK of this task, in this epoch, from every rank.
        if step.outcome is not None and step.outcome.ok:
            acked = self.acked_by.get((stage.epoch, step.outcome.task_id), set())
            require(
                acked == set(stage.ranks),
                "P-5",
                f"committed {stage.state.value} with ACKs from ranks {sorted(acked)} of {list(stage.ranks)}",
            )
        self._check_all_ranks_commit()

        if counter is not None or expect.kind == "ack":
            if not quiet(step):
                raise ModelMismatch(f"{reply!r}: expected {expect.kind}, got {step}")
            return
        outcome = self._outcome(step)
        if expect.kind == "commit":
            if not outcome.ok or outcome.state is not self.model.state or set(outcome.acks) != set(stage.ranks):
                raise ModelMismatch(f"{reply!r}: expected a commit to {self.model.state.value}, got {outcome}")
        else:  # fail: a NACK (or an ACK in the wrong state) ends the task naming the rank
            require(
                stage.state is S.FAILED
                and not outcome.ok
                and set(outcome.failures) == set(expect.ranks)
                and f"rank {reply.rank}" in stage.failure,
                "P-9",
                f"{reply!r} must fail the stage naming rank {reply.rank}: {outcome}",
            )

    def _outcome(self, step: StageStep) -> TaskOutcome:
        if step.outcome is None:
            raise ModelMismatch(f"expected the task to end, got {step}")
        self._record(step.outcome)
        return step.outcome

    def _record(self, outcome: TaskOutcome) -> None:
        """A task ends once: a second outcome for the same task_id is a second terminal answer."""
        require(
            outcome.task_id not in self.outcomes,
            "P-1",
            f"task {outcome.task_id!r} ended twice: {self.outcomes.get(outcome.task_id)} and {outcome}",
        )
        require(
            outcome.state is self.stage.state,
            "model",
            f"outcome names {outcome.state.value}, stage is {self.stage.state.value}",
        )
        self.outcomes[outcome.task_id] = outcome

    # ------------------------------------------------------------------ checks

    def _snapshot(self) -> tuple:
        st_ = self.stage
        return (
            st_.state,
            st_.epoch,
            st_.task_id,
            st_.residency.asleep,
            st_.residency.weights_valid,
            st_.in_flight_requests,
            dict(st_.rank_state),
            st_.failure,
        )

    def _check_all_ranks_commit(self) -> None:
        """P-5: a settled stage state is what every rank of this epoch really is."""
        stage = self.stage
        if stage.state not in SETTLED:
            return
        want = RANK_OF_STAGE[stage.state]
        for rank in stage.ranks:
            worker = self.workers[rank]
            require(rank not in self.dead, "P-5", f"stage {stage.state.value} with rank {rank} dead")
            require(
                worker.epoch == stage.epoch
                and worker.state is want
                and not worker.busy
                and worker.residency.asleep == stage.residency.asleep,
                "P-5",
                f"stage {stage.state.value} (asleep {sorted(stage.residency.asleep)}) but rank {rank} is "
                f"{worker.state.value} (asleep {sorted(worker.residency.asleep)}, busy {worker.busy})",
            )

    def _check_admission(self) -> None:
        """P-7: a request is admitted only while every rank is ACTIVE."""
        if self.stage.admits():
            for rank in self.stage.ranks:
                require(
                    rank not in self.dead and self.workers[rank].state is W.ACTIVE,
                    "P-7",
                    f"stage admits requests but rank {rank} is {self.workers[rank].state.value}",
                )

    @invariant()
    def properties_hold(self) -> None:
        self._check_all_ranks_commit()
        self._check_admission()

    @invariant()
    def agrees_with_the_model(self) -> None:
        st_, m = self.stage, self.model
        got = (
            st_.state,
            st_.epoch,
            st_.residency.asleep,
            st_.residency.weights_valid,
            st_.in_flight_requests,
            st_.task_id,
        )
        want = (m.state, m.epoch, m.asleep, m.weights_valid, m.requests, m.task.task_id if m.task else None)
        if got != want:
            raise ModelMismatch(f"stage {got} != model {want}")


def test_stage_against_the_reference_model() -> None:
    StageMachine.examples = 0
    run_state_machine_as_test(StageMachine, settings=settings())
    assert StageMachine.examples >= settings.default.max_examples, StageMachine.examples  # type: ignore[union-attr]


# ============================================================================ broken variants


def _machine_with(stage_cls: type[StageCore] = StageCore, worker_cls: type[WorkerCore] = WorkerCore):  # type: ignore[no-untyped-def]
    return type(
        f"StageMachineWith{stage_cls.__name__}{worker_cls.__name__}",
        (StageMachine,),
        {
            "make_stage": staticmethod(lambda ranks: stage_cls("talker", ranks, tags=TAGS)),
            "make_worker": staticmethod(lambda rank, epoch: worker_cls(rank, tags=TAGS, epoch=epoch)),
        },
    )


@pytest.mark.parametrize(
    ("stage_cls", "worker_cls", "prop"),
    [
        (NoEpochFenceStage, WorkerCore, "P-6"),
        (CommitsOnFirstAckStage, WorkerCore, "P-5"),
        (StageCore, NoEpochFenceWorker, "P-6"),
    ],
    ids=["stage-without-epoch-fence", "stage-commits-on-first-ack", "workers-without-epoch-fence"],
)
def test_broken_stage_is_caught_by_the_invariants(
    stage_cls: type[StageCore], worker_cls: type[WorkerCore], prop: str
) -> None:
    with pytest.raises(PropertyViolation) as info:
        run_state_machine_as_test(_machine_with(stage_cls, worker_cls), settings=BROKEN)
    assert info.value.prop == prop, info.value
