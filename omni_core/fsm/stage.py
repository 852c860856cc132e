"""Stage lifecycle: the sans-IO core of one stage.

The stage core turns an API call (sleep, wake, reload) into one command per rank, then
aggregates the ranks' replies. It commits SLEEPING / RUNNING / PARTIAL / NEEDS_RELOAD only
on a complete set of ACKs for the current task whose reported states agree with what the
stage expects (P-5); a NACK, a dead rank or a passed deadline ends the task in FAILED with
the ranks named (P-8, P-9). Replies from an older epoch or for another task are counted and
ignored (P-6). Time comes in as an argument (`now`), never from a clock.

One door: `StageCore.step(input, now)` with an input of `omni_core.fsm.inputs`. Every input
goes through it, so the queue moves on, the trace records are written and the invariants
are checked after each. One class holds the stage's own state, each field declared once in
`__init__`; what keeps state of its own is a component with its own invariants: the requests
(`request_queue.RequestBook`), the version book (`stage_versions.VersionKeeper`), the step's
trace records (`stage_trace.StageRecorder`). The table is in `stage_table`, the rows of each
call in `stage_table.CALLS`, what the core hands out in `stage_step`.

The methods come in the order an input meets them: the door, the lifecycle calls (one
template, `_issue`), the pause, the requests, the replies and time, the invariants.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Literal

import msgspec

from omni_core.fsm import admission
from omni_core.fsm import inputs as I
from omni_core.fsm.adapter_splits import AdapterSplits
from omni_core.fsm.admission import AdmissionPolicy, Admit, QueueAction
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.reply_cache import BoundedCache
from omni_core.fsm.request_queue import RequestBook, RequestQueue
from omni_core.fsm.settle import REFIT_ASLEEP, REFUSAL_REASON, Settled, refused_trigger, settle_row
from omni_core.fsm.stage_pause import PAUSE_MODES, Pause, Resume
from omni_core.fsm.stage_step import (
    Outbound,
    StageBusyError,
    StageCommandError,
    StageCounters,
    StageRequest,
    StageSnapshot,
    StageStep,
    StageTask,
    TaskOutcome,
)
from omni_core.fsm.stage_table import CALLS, IN_TASK, SERVING, STAGE_STATE_OF_RANK, STAGE_TRANSITIONS, STATELESS
from omni_core.fsm.stage_trace import StageRecorder
from omni_core.fsm.stage_versions import StartWeights, VersionKeeper
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import DEFAULT_TAGS, Residency, UnknownTagError, plan_sleep, resolve_tags
from omni_core.fsm.transfers import TransferHolds
from omni_core.fsm.worker_step import InvariantViolation
from omni_core.protocol import (
    MAX_MEMORY_WAIT_S,
    Ack,
    AckStatus,
    Capability,
    Command,
    Execute,
    Hello,
    HoldRequests,
    InitWeightGroup,
    Nack,
    NackReason,
    Profile,
    ReloadWeights,
    Reply,
    Result,
    ShareWeights,
    Sleep,
    UpdateWeights,
    Wake,
    WorkerState,
    arguments,
    new_version_problem,
)
from omni_core.protocol import StageState as S

__all__ = ["Outbound", "StageBusyError", "StageCommandError", "StageCore", "StageCounters", "StageStep", "TaskOutcome"]


# A weight group's rendezvous may take this share of the command's deadline: the rest is for
# the ranks' refusal to arrive, so a trainer that never answers is a refused command (the
# stage stays where it was) rather than ranks silent past the deadline (the stage FAILED).
JOIN_DEADLINE_SHARE = 0.5


def memory_wait_problem(memory_wait_s: Any, deadline_s: float) -> str | None:
    """What is wrong with a wake's wait for memory, or None. The rule of P-16, declared once:
    the stage core refuses a WakeCall by it, and Engine.swap asks it before anything is sent
    (its sleep goes out first). The wait must end before the deadline so that a rank's NO_MEMORY
    refusal arrives in time; the Wake's bound on the wire (MAX_MEMORY_WAIT_S) caps it."""
    if (
        isinstance(memory_wait_s, (int, float))
        and math.isfinite(memory_wait_s)
        and 0 <= memory_wait_s < deadline_s
        and memory_wait_s <= MAX_MEMORY_WAIT_S
    ):
        return None
    return (
        f"memory_wait_s must be >= 0, below the deadline ({deadline_s} s) and at most {MAX_MEMORY_WAIT_S:.0f} s, "
        f"got {memory_wait_s!r}; leave the ranks time to map and copy: pass a smaller memory_wait_s or a "
        "longer timeout_s"
    )


def _is_release(command: object) -> bool:
    """A release of held requests: a task in RUNNING that changes no state (as a Profile)."""
    return isinstance(command, HoldRequests) and not command.hold


# A plan: the task to start, or the command alone when nothing is left to do (ALREADY).
Plan = Callable[[], "StageTask | Command"]


class StageCore:
    """One stage: its ranks' aggregate lifecycle. No IO, no clock."""

    def __init__(
        self,
        name: str,
        ranks: int,
        *,
        tags: tuple[str, ...] = DEFAULT_TAGS,
        epoch: int = 0,
        completed_task_entries: int = 256,
        policy: AdmissionPolicy = AdmissionPolicy.QUEUE,
        queue_limit: int = 256,
        max_in_flight: int = 1024,
        wake_deadline_s: float = 30.0,
        dummy_weights: bool = False,
    ) -> None:
        if ranks < 1:
            raise StageCommandError(f"stage {name!r} needs at least one rank, got {ranks}")
        self.name = name
        self.ranks = tuple(range(ranks))
        self.tags = tags
        self.epoch = epoch
        self.lifecycle: Lifecycle[S] = Lifecycle(S, STAGE_TRANSITIONS, S.STARTING)
        self.residency = Residency(tags)
        self.rank_state: dict[int, WorkerState] = {}
        self.rank_capabilities: dict[int, frozenset[Capability]] = {}  # from each rank's Hello
        # The weights version every rank holds (P-17): from the Hellos, then each committed ACK set.
        self.weights_version = 0
        self.rank_versions: dict[int, int] = {}
        # Where the committed version lives durably, and what a restart's ranks start from
        # (None until the first restart: a first start takes the version the Hellos name).
        # Dummy weights (load_format "dummy"): the first start is NEEDS_RELOAD at version 0 too.
        self.versions = VersionKeeper(dummy=dummy_weights)
        self.start_weights: StartWeights | None = self.versions.first_start()
        # A pause is the caller's and holds until resume(): a sleep, a wake (asked for or the
        # admission policy's), a reload and an update of a paused stage leave it paused.
        self.paused = False
        # Pause mode keep: the requests in flight are held on every rank (HoldRequests), frozen
        # where they are until resume() releases them; beside them only an update runs.
        self.holding = False
        # What each rank says it holds, for status: its pools' bytes per tag (its Hello, then
        # each ACK taken) and its runner's counters (names its Hello declared, values from any
        # reply of this epoch). Never part of a decision.
        self.rank_pool_bytes: dict[int, dict[str, int]] = {}
        self.rank_counters: dict[int, dict[str, int]] = {}
        self.policy = AdmissionPolicy(policy)
        self.wake_deadline_s = wake_deadline_s  # for the wakes the WAKE policy starts itself
        self.requests = RequestBook(queue_limit, max_in_flight)
        self.transfers = TransferHolds()  # P-22: what its ranks export for other stages, until released
        self.adapter_splits = AdapterSplits()  # P-20: adapters some ranks took and others refused
        self.recorder = StageRecorder()  # the trace records of the input being stepped
        self._auto_wakes = itertools.count(1)
        self._start_pending = False
        self.counters = StageCounters()
        self.failure = ""
        self.failed_ranks: dict[int, str] = {}
        self.completed: BoundedCache[str, tuple[tuple[Any, ...], TaskOutcome]] = BoundedCache(completed_task_entries)
        self._task: StageTask | None = None
        self._hello_detail: dict[int, str] = {}
        self._start_deadline_at_s = float("inf")

    @property
    def state(self) -> S:
        return self.lifecycle.state

    @property
    def start_deadline_at_s(self) -> float:
        """When the start (or restart) in progress fails if a rank has not said Hello."""
        return self._start_deadline_at_s

    @property
    def task(self) -> StageTask | None:
        """The lifecycle task in flight, read-only (its bookkeeping is the core's)."""
        return self._task

    @property
    def task_id(self) -> str | None:
        return self._task.task_id if self._task else None

    def admits(self) -> bool:
        """Whether a new request may run now (only RUNNING, P-7)."""
        return self.lifecycle.allows("execute")

    @property
    def in_flight_requests(self) -> int:
        return len(self.requests.in_flight)

    # The request book's parts, by the names the engine and the status read.
    @property
    def queue(self) -> RequestQueue:
        return self.requests.queue

    @property
    def in_flight(self) -> dict[str, StageRequest]:
        return self.requests.in_flight

    @property
    def queue_limit(self) -> int:
        return self.requests.queue_limit

    @property
    def max_in_flight(self) -> int:
        return self.requests.max_in_flight

    def restore(self, snapshot: StageSnapshot) -> None:
        """Put the core in `snapshot`'s state, as if it had got there (a case of the agreement
        rows, a test's starting point): what it does not name is a fresh stage's (no failure,
        the counters and completed tasks as they were). Raises InvariantViolation where the
        snapshot is no state a stage can hold, as step() would after the input that made it."""
        self.lifecycle.place(snapshot.state)
        self.residency = Residency(self.tags)
        self.residency.asleep, self.residency.weights_valid = frozenset(snapshot.asleep), snapshot.weights_valid
        self.rank_state = dict(snapshot.rank_state)
        self.rank_capabilities = {rank: frozenset(c) for rank, c in snapshot.rank_capabilities.items()}
        self.weights_version = snapshot.weights_version
        self.rank_versions = {rank: snapshot.weights_version for rank in snapshot.rank_state}
        self.paused, self.holding = snapshot.paused, snapshot.holding
        self.failure, self.failed_ranks = "", {}
        self.adapter_splits.clear()
        self._task = snapshot.task
        self.requests = RequestBook(self.queue_limit, self.max_in_flight)
        for request in snapshot.queued:
            self.requests.queue.append(request)
        for request in snapshot.in_flight:
            self.requests.start(request)
        self._check_invariants()

    def step(self, event: I.EngineInput, now: float) -> StageStep:
        """Take one engine input; return what to send and what to report. Then move the
        queue on (QUEUE_RULES) and check the invariants. Lifecycle calls that are not legal
        raise StageCommandError before anything changes."""
        self.recorder.begin()
        self.recorder.input(self, event, now)
        before = self.state
        step = self._take(event, now)
        self.recorder.phase(self, event, before, step.sends, now)
        before = self.state
        pumped = self._pump(now)
        self.recorder.phase(self, None, before, pumped.sends, now)
        step = step.then(pumped)
        answers = self.requests.take_answers()
        records = self.recorder.finish(answers, step.outcome)
        step = StageStep(step.sends, step.outcome, step.requests + answers, step.started, records)
        self._check_invariants()
        return step

    def _take(self, event: I.EngineInput, now: float) -> StageStep:
        """The input's own handling, before the queue moves on."""
        match event:
            case I.Received(message=message):
                return self._received(message, now)
            case I.Tick():
                return self._tick(now).then(self._expire_requests(now))
            case I.Submit():
                return self._submit(event, now)
            case I.SleepCall():
                return self._sleep(event, now)
            case I.WakeCall():
                return self._wake(event, now)
            case I.ReloadCall():
                return self._reload(event, now)
            case I.UpdateCall():
                return self._update(event, now)
            case I.ProfileCall():
                return self._profile(event, now)
            case I.WeightGroupCall():
                return self._weight_group(event, now)
            case I.ShareCall():
                return self._share(event, now)
            case I.CommandCall():
                return self._command(event, now)
            case I.PauseCall():
                return self._pause(event, now)
            case I.ResumeCall():
                return self._resume(event, now)
            case I.RankExited(rank=rank, detail=detail, epoch=epoch):
                return self._rank_died(rank, detail, now, epoch)
            case I.SendFailed():
                return self._send_failed(event, now)
            case I.SetAdmission(policy=policy):
                self.policy = AdmissionPolicy(policy)
                return StageStep()
            case I.Start(deadline_s=deadline_s):
                self._start_deadline_at_s = now + deadline_s
                self._start_pending = True
                return StageStep()
            case I.Restart(deadline_s=deadline_s, from_checkpoint=from_checkpoint):
                self._restart(now, deadline_s, from_checkpoint)
                self._start_pending = True
                return StageStep()
            case I.Stop():
                return self._stop(now)
            case _:
                raise TypeError(f"StageCore.step takes an engine input (omni_core.fsm.inputs), not {event!r}")

    def _restart(self, now: float, deadline_s: float, from_checkpoint: bool = False) -> None:
        """New epoch, back to STARTING; the caller starts fresh rank processes from
        `start_weights`: the committed version's durable source, else NEEDS_RELOAD under a
        version floor; the checkpoint at version 0 when the caller asked (`from_checkpoint`)."""
        if type(from_checkpoint) is not bool:
            raise StageCommandError(f"from_checkpoint must be True or False, got {from_checkpoint!r}")
        if not self.lifecycle.allows("restart") or self._task is not None:  # a Profile in a settled state
            why = "it is already starting" if self.state is S.STARTING else "a task is in flight; wait for it to end"
            raise StageCommandError(f"stage {self.name!r} cannot restart in {self.state.value}: {why}")
        self.lifecycle.fire("restart")
        self.paused = False  # fresh ranks, a fresh stage: it comes back RUNNING
        self.holding = False
        self.transfers.clear()  # fresh ranks hold no buckets
        self.adapter_splits.clear()  # nor adapters
        self.epoch += 1
        self.start_weights = self.versions.plan_restart(
            self.weights_version, self.epoch, from_checkpoint=from_checkpoint
        )
        self.weights_version = self.start_weights.version
        self.residency = Residency(self.tags)
        self.rank_state.clear()
        self.rank_versions.clear()
        self.rank_pool_bytes.clear()
        self.rank_counters.clear()
        self.failure, self.failed_ranks = "", {}
        self.requests.fail_all(
            RequestError.REJECTED,
            f"stage {self.name!r} restarted before this request ran",
            running=RequestError.FAILED,
            running_detail=f"stage {self.name!r} restarted while this request ran",
        )
        self._start_deadline_at_s = now + deadline_s

    def _stop(self, now: float) -> StageStep:
        if self.state is S.STOPPED:
            return StageStep()
        self.lifecycle.fire("stop")  # first, so the outcome names the state the task ended in
        outcome = self._end_task(False, "stage stopped before the task completed", {}, now) if self._task else None
        self.requests.fail_all(
            RequestError.CLOSED,
            "the engine shut down before this request ran",
            running_detail="the engine shut down while this request ran",
        )
        return StageStep(outcome=outcome)

    def _fail_task(self, failures: dict[int, str], now: float) -> StageStep:
        self.lifecycle.fire("fail")
        self._record_failure(failures)
        return StageStep(outcome=self._end_task(False, self.failure, failures, now))

    def _fail_idle(self, failures: dict[int, str], now: float) -> StageStep:
        self.lifecycle.fire("fail")
        self._record_failure(failures)
        return StageStep()

    def _record_failure(self, failures: dict[int, str]) -> None:
        self.failed_ranks = dict(failures)
        self.holding = False  # what the ranks held is failed below
        named = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        self.failure = f"stage {self.name!r} FAILED ({named})"
        # Their callers hear it (through step); the ranks are not trusted to answer any more.
        self.requests.fail_all(
            RequestError.REJECTED,
            f"{self.failure}; restart() the stage",
            running=RequestError.FAILED,
            running_detail=f"{self.failure} while this request ran; restart() the stage",
        )

    def _end_task(
        self, ok: bool, error: str, failures: dict[int, str], now: float, *, refused: bool = False
    ) -> TaskOutcome:
        task = self._task
        assert task is not None
        self._task = None
        outcome = TaskOutcome(
            task.task_id,
            type(task.command).__name__,
            ok,
            AckStatus.OK,
            self.state,
            MappingProxyType(dict(task.acks)),
            MappingProxyType(dict(failures)),
            error,
            task.started_at,
            now,
            refused,
        )
        self.completed.put(task.task_id, (task.signature, outcome))
        return outcome

    def _check_invariants(self) -> None:
        state = self.state

        def require(cond: bool, what: str) -> None:
            if not cond:
                raise InvariantViolation(f"stage {self.name!r} in {state.value}: {what}")

        profiling = self._task is not None and (
            isinstance(self._task.command, STATELESS) or _is_release(self._task.command)
        )
        require(
            (self._task is not None and not profiling) == (state in IN_TASK),
            "a lifecycle task in flight iff in a task state",
        )
        require(not profiling or state in SERVING, "a Profile task outside the settled states")
        problem = self.requests.check_invariants()
        require(not problem, problem)
        if self.in_flight_requests:
            held = self.holding and state in (S.PAUSED, S.WAKING)  # frozen on the ranks, an update beside
            require(state in (S.RUNNING, S.DRAINING) or held, "requests in flight outside RUNNING/DRAINING")
        require(not self.holding or self.paused or state is S.RUNNING, "requests held without a pause")
        if state in SERVING:
            # P-5: a settled state is committed only when every rank reported it.
            require(set(self.rank_state) == set(self.ranks), "settled without every rank known")
            settled = S.RUNNING if state is S.PAUSED else state  # a pause leaves the ranks ACTIVE
            mismatched = {r: s.value for r, s in self.rank_state.items() if STAGE_STATE_OF_RANK.get(s) is not settled}
            require(not mismatched, f"ranks disagree with the stage: {mismatched}")
        require(state is not S.PAUSED or self.paused, "PAUSED without a pause held")
        if self.transfers.held:  # P-22: a producer with a transfer in flight neither sleeps nor updates
            moving = self._task is not None and isinstance(self._task.command, (Sleep, UpdateWeights))
            require(not moving and state not in (S.SLEEPING, S.NEEDS_RELOAD), "a transfer held while moving weights")
        require(state not in (S.RUNNING, S.DRAINING) or not self.paused, f"{state.value} while a pause holds")
        if state in (S.RUNNING, S.PAUSED):  # a pause releases nothing
            require(
                not self.residency.asleep and self.residency.weights_valid,
                f"{state.value} with tags asleep or weights invalid",
            )
            # P-17: requests run only while every rank holds the stage's one version.
            mixed = {r: v for r, v in self.rank_versions.items() if v != self.weights_version}
            require(not mixed, f"ranks hold weights versions {mixed}, not the stage's {self.weights_version}")

    # ------------------------------------------------------------------ the lifecycle calls

    def _issue(
        self, kind: type, task_id: str, signature: tuple[Any, ...], now: float, deadline_s: float, plan: Plan
    ) -> StageStep:
        row = CALLS[kind]
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle(row.verb)
        if self.holding and kind is not UpdateWeights and not row.stateless:
            raise StageCommandError(
                f"stage {self.name!r} cannot {row.verb}: {self.in_flight_requests} requests are held on its ranks "
                "(pause mode keep) and only update_weights() runs beside them; resume() first"
            )
        planned = plan()
        if not isinstance(planned, StageTask):
            return self._already(task_id, signature, planned, row.already, now)
        self._task = planned
        if row.drain and self.lifecycle.allows(row.drain):
            self.lifecycle.fire(row.drain)
            step = self._send_drained(now) if self.in_flight_requests == 0 else StageStep()
        else:
            self.lifecycle.fire(planned.send_trigger or row.trigger)
            step = self._send_all()
        self.recorder.issued(planned.command, False, now + deadline_s)
        return step

    def _new_task(
        self, call: Any, signature: tuple[Any, ...], command: Command, now: float, **fields: Any
    ) -> StageTask:
        """The task of `call`: its id, signature and command, started now, due at its deadline."""
        return StageTask(call.task_id, signature, command, now, now + call.deadline_s, **fields)

    def _send_drained(self, now: float) -> StageStep:
        assert self._task is not None
        if isinstance(self._task.command, Pause):  # nothing goes to the ranks: the pause is done
            self.lifecycle.fire("pause_drained")
            self.paused = True
            return StageStep(outcome=self._end_task(True, "", {}, now))
        self.lifecycle.fire(CALLS[type(self._task.command)].drained)
        return self._send_all()

    def _send_all(self) -> StageStep:
        assert self._task is not None
        self._task.sent = True
        return StageStep(sends=tuple(Outbound(rank, self._task.command) for rank in self.ranks))

    def _retry(self, task_id: str, signature: tuple[Any, ...]) -> StageStep | None:
        """Same task_id again: re-send to silent ranks, or return the recorded outcome."""
        task = self._task
        if task is not None and task.task_id == task_id:
            self._require_same(task_id, task.signature, signature)
            self.counters.retries += 1
            if not task.sent:
                return StageStep()
            return StageStep(
                sends=tuple(
                    Outbound(r, task.command) for r in self.ranks if r not in task.acks and r not in task.refusals
                )
            )
        done = self.completed.get(task_id)
        if done is not None:
            self._require_same(task_id, done[0], signature)
            self.counters.retries += 1
            return StageStep(outcome=done[1])
        return None

    @staticmethod
    def _require_same(task_id: str, first: tuple[Any, ...], now: tuple[Any, ...]) -> None:
        if first != now:
            raise StageCommandError(
                f"task_id {task_id!r} was used for {first}, now for {now}; use a fresh task_id per command"
            )

    def _require_idle(self, what: str) -> None:
        if self._task is not None:
            raise StageBusyError(
                f"stage {self.name!r} cannot {what}: task {self._task.task_id!r} is in flight ({self.state.value})"
            )
        if self.state is S.FAILED:
            raise StageCommandError(f"stage {self.name!r} is FAILED ({self.failure}); call restart() first")
        if self.state in (S.STARTING, S.STOPPED):
            raise StageCommandError(f"stage {self.name!r} cannot {what} in {self.state.value}")

    def _already(
        self, task_id: str, signature: tuple[Any, ...], command: Command, trigger: str, now: float
    ) -> StageStep:
        self.recorder.issued(command, True, now)
        return self._instant(task_id, signature, command, trigger, AckStatus.ALREADY, now)

    def _resolve(self, tags: tuple[str, ...] | None) -> frozenset[str]:
        if tags is not None and not tags:
            raise StageCommandError("tags must be None (every tag) or a non-empty list")
        try:
            return resolve_tags(tags, self.tags)
        except UnknownTagError as exc:
            raise StageCommandError(f"stage {self.name!r}: {exc}") from None

    # ------------------------------------------------------------------ the four lifecycle calls

    def _sleep(self, call: I.SleepCall, now: float) -> StageStep:
        # The one check of a sleep level from any caller (Engine, HTTP, swap). True == 1, but is no level.
        if type(call.level) is not int or call.level not in (1, 2):
            raise StageCommandError(f"sleep level must be 1 or 2, got {call.level!r}")
        level: Literal[1, 2] = 1 if call.level == 1 else 2
        wanted = self._resolve(call.tags)
        signature = ("Sleep", level, None if call.tags is None else tuple(sorted(wanted)))

        def plan() -> StageTask | Command:
            command = Sleep(task_id=call.task_id, epoch=self.epoch, level=level, tags=signature[2])
            to_sleep = wanted - self.residency.asleep
            if not to_sleep and self.lifecycle.allows("sleep_already"):
                return command
            if not (self.lifecycle.allows("drain") or self.lifecycle.allows("sleep")):
                raise StageCommandError(f"stage {self.name!r} cannot sleep in {self.state.value}")
            self.transfers.require_none(self.name, "sleep")
            sleep_plan = plan_sleep(level, to_sleep, weights_valid=self.residency.weights_valid)
            return self._new_task(
                call,
                signature,
                command,
                now,
                expect_state=WorkerState.SLEEPING,
                expect_asleep=self.residency.asleep | to_sleep,
                commit_trigger="slept",
                expect_version=self.weights_version,
                apply=lambda res: res.apply_sleep(sleep_plan),
            )

        step = self._issue(Sleep, call.task_id, signature, now, call.deadline_s, plan)
        if call.abort_in_flight and self.state is S.DRAINING:
            # The callers hear now; the ranks still run these requests, so the Sleep goes
            # out only once every rank has answered them, never over a running one.
            for request in self.in_flight.values():
                self.requests.answer(
                    request,
                    RequestError.ABORTED,
                    f"request {request.request_id} aborted: stage "
                    f"{self.name!r} is going to sleep (abort_in_flight=True)",
                )
        return step

    def _wake(self, call: I.WakeCall, now: float) -> StageStep:
        """Wake `tags` (every tag: None). With `memory_wait_s` each rank may wait that long
        for free device memory another stage is releasing (a swap, P-16); it must end well
        before the deadline so that a rank's NO_MEMORY refusal arrives in time."""
        memory_wait_s, deadline_s = call.memory_wait_s, call.deadline_s
        problem = memory_wait_problem(memory_wait_s, deadline_s)
        if problem is not None:
            raise StageCommandError(problem)
        wanted = self._resolve(call.tags)
        signature = ("Wake", None if call.tags is None else tuple(sorted(wanted)), float(memory_wait_s))

        def plan() -> StageTask | Command:
            unable = sorted(r for r in self.ranks if Capability.SWAP not in self.rank_capabilities.get(r, ()))
            if memory_wait_s > 0 and unable:
                raise StageCommandError(
                    f"stage {self.name!r}: ranks {unable} cannot wait for free device memory "
                    "(their Hello lists no 'swap' capability); wake with memory_wait_s=0"
                )
            command = Wake(task_id=call.task_id, epoch=self.epoch, tags=signature[1], memory_wait_s=signature[2])
            to_wake = wanted & self.residency.asleep
            if not to_wake and self.lifecycle.allows("wake_already"):
                return command
            if not self.lifecycle.allows("wake"):
                raise StageCommandError(f"stage {self.name!r} cannot wake in {self.state.value}")
            after = Residency(self.tags)
            after.asleep, after.weights_valid = self.residency.asleep - to_wake, self.residency.weights_valid
            row = settle_row(after.settled())
            return self._new_task(
                call,
                signature,
                command,
                now,
                expect_state=row.rank_state,
                expect_asleep=after.asleep,
                commit_trigger=self._held(row.stage_commit, "woke_paused"),
                expect_version=self.weights_version,
                apply=lambda res: res.apply_wake(to_wake),
                refused_trigger=refused_trigger(Wake, self.state),
            )

        return self._issue(Wake, call.task_id, signature, now, deadline_s, plan)

    def _reload(self, call: I.ReloadCall, now: float) -> StageStep:
        signature = ("ReloadWeights", call.source)

        def plan() -> StageTask:
            if not self.lifecycle.allows("reload"):
                raise StageCommandError(
                    f"stage {self.name!r} cannot reload weights in {self.state.value}: reload "
                    "follows a level-2 sleep and a wake of 'weights' (state NEEDS_RELOAD)"
                )
            if self.versions.floor and call.source is None:  # the runner's own weights: version 0, a revert
                raise StageCommandError(
                    f"{self.versions.floor_detail(self.name)}; a reload would serve version 0, below the floor: "
                    "reload a save at or above the floor (source), or update"
                )
            if self.versions.dummy and call.source is None:
                raise StageCommandError(self.versions.dummy_reload_refusal(self.name))
            command = ReloadWeights(task_id=call.task_id, epoch=self.epoch, source=call.source)
            # The runner's own weights are version 0; a directory's is the one its ranks ACK (a save's).
            task = self._weights_task(call, signature, command, now, refused="reload_refused", version=0)
            task.version_from_source = call.source is not None
            return task

        return self._issue(ReloadWeights, call.task_id, signature, now, call.deadline_s, plan)

    def _update(self, call: I.UpdateCall, now: float) -> StageStep:
        """Replace every rank's weights with `source` as `version` (P-17). In RUNNING the stage
        drains first (requests queue or are refused per the admission policy); it commits only
        when every rank ACKs the new version, and no request runs until then."""
        version = call.version
        problem = new_version_problem(version)
        if problem is not None:
            raise StageCommandError(problem)
        if type(call.flush_cache) is not bool:
            raise StageCommandError(f"flush_cache must be true or false, got {call.flush_cache!r}")
        signature = ("UpdateWeights", version, call.source, call.flush_cache)

        def plan() -> StageTask:
            if version <= self.weights_version:
                raise StageCommandError(
                    f"stage {self.name!r}: weights version {version} is not above the stage's "
                    f"version {self.weights_version}; send a higher version"
                )
            below = self.versions.refusal_below_floor(self.name, version)
            if below:
                raise StageCommandError(below)
            self.transfers.require_none(self.name, "update weights")
            unable = sorted(r for r in self.ranks if Capability.WEIGHT_UPDATE not in self.rank_capabilities.get(r, ()))
            if unable:
                raise StageCommandError(
                    f"stage {self.name!r}: ranks {unable} take no weight updates (their Hello lists "
                    "no 'weight_update' capability); use reload_weights()"
                )
            flush = call.flush_cache
            command = UpdateWeights(
                task_id=call.task_id, epoch=self.epoch, version=version, source=call.source, flush_cache=flush
            )
            if self.lifecycle.allows(CALLS[UpdateWeights].asleep) and not self.residency.weights_resident:
                return self._host_refit_task(call, signature, command, now, version)
            legal = self.lifecycle.allows("update_drain") or self.lifecycle.allows("update")
            if not legal or not self.residency.weights_resident:
                raise StageCommandError(
                    f"stage {self.name!r} cannot update weights in {self.state.value}: the weights "
                    "must be resident (RUNNING, PAUSED, PARTIAL with 'weights' awake, or NEEDS_RELOAD), "
                    "or asleep at level 1 on ranks that declare 'host_refit' (SLEEPING)"
                )
            refused = refused_trigger(UpdateWeights, self.state)
            return self._weights_task(call, signature, command, now, refused=refused, version=version)

        return self._issue(UpdateWeights, call.task_id, signature, now, call.deadline_s, plan)

    def _host_refit_task(
        self, call: I.UpdateCall, signature: tuple[Any, ...], command: UpdateWeights, now: float, version: int
    ) -> StageTask:
        """An update while the weights sleep at level 1: every rank writes it into its host copy
        and the stage stays SLEEPING at the new version, so the old and new weights never meet
        on the device; the next wake brings the new version."""
        if not self.residency.weights_valid:
            raise StageCommandError(
                f"stage {self.name!r} cannot update weights asleep: a level-2 sleep discarded them, so no "
                "host copy holds weights to write; wake it (NEEDS_RELOAD), then update"
            )
        unable = sorted(r for r in self.ranks if Capability.HOST_REFIT not in self.rank_capabilities.get(r, ()))
        if unable:
            raise StageCommandError(
                f"stage {self.name!r}: ranks {unable} cannot write an update into their host copy (their "
                "Hello lists no 'host_refit' capability); wake 'weights' first, then update"
            )
        return self._new_task(
            call,
            signature,
            command,
            now,
            expect_state=REFIT_ASLEEP.rank_state,
            expect_asleep=self.residency.asleep,
            commit_trigger=REFIT_ASLEEP.stage_commit,
            apply=lambda res: None,  # the ranks' residency is as it was: only the version moves
            refused_trigger=refused_trigger(UpdateWeights, self.state),
            expect_version=version,
            send_trigger=CALLS[UpdateWeights].asleep,
            failed_state=REFIT_ASLEEP.rank_state,
            failed_trigger=REFIT_ASLEEP.stage_failed,
        )

    def _held(self, commit: str, paused: str) -> str:
        """A task's commit trigger: `paused` where it would make a paused stage RUNNING."""
        return paused if self.paused and commit == "woke_running" else commit

    def _weights_task(
        self, call: Any, signature: tuple[Any, ...], command: Command, now: float, *, refused: str, version: int
    ) -> StageTask:
        """A task that writes every rank's weights (a reload, an update): it settles as a reload
        does, ACTIVE or PARTIAL by the tags asleep, and a refusal returns by `refused`."""
        row = settle_row(Settled.ACTIVE if not self.residency.asleep else Settled.PARTIAL)
        return self._new_task(
            call,
            signature,
            command,
            now,
            expect_state=row.rank_state,
            expect_asleep=self.residency.asleep,
            # vLLM's RL loop pauses, updates, resumes: an update leaves a pause in place.
            commit_trigger=self._held(
                row.stage_commit, "update_paused" if isinstance(command, UpdateWeights) else "woke_paused"
            ),
            apply=lambda res: res.apply_reload(),
            refused_trigger=refused,
            expect_version=version,
        )

    # ------------------------------------------------------------------ tasks that keep the state

    def _stateless_task(self, call: Any, signature: tuple[Any, ...], command: Command, now: float) -> StageTask:
        """A task in a settled state that never changes it: the ranks' NACKs are its refusals."""
        return self._new_task(
            call,
            signature,
            command,
            now,
            expect_asleep=self.residency.asleep,
            commit_trigger=CALLS[type(command)].trigger,
            expect_version=self.weights_version,
        )

    def _share(self, call: I.ShareCall, now: float) -> StageStep:
        """Every rank shares its weights (a trainer stage, for `transfer_weights`); like a
        Profile, a task that never changes the state: requests keep running meanwhile."""
        try:
            command = msgspec.convert(
                {
                    "type": "ShareWeights",
                    "task_id": call.task_id,
                    "epoch": self.epoch,
                    "bucket_bytes": call.bucket_bytes,
                },
                ShareWeights,
            )
        except msgspec.ValidationError as exc:
            raise StageCommandError(f"stage {self.name!r}: invalid share: {exc}") from None
        return self._stateless(call, ("ShareWeights", call.bucket_bytes), command, now)

    def _weight_group(self, call: I.WeightGroupCall, now: float) -> StageStep:
        """Every rank joins the trainer's weight group; like a Profile, a task that never
        changes the state, and the ranks' NACKs are the outcome's refusals."""
        try:
            command = InitWeightGroup(
                task_id=call.task_id,
                epoch=self.epoch,
                group=call.group,
                address=call.address,
                port=call.port,
                world_size=call.world_size,
                rank_offset=call.rank_offset,
                backend=call.backend,  # type: ignore[arg-type]
                timeout_s=call.group_timeout_s,
                join_timeout_s=min(call.group_timeout_s, call.deadline_s * JOIN_DEADLINE_SHARE),
            )
            command = msgspec.convert(msgspec.to_builtins(command), InitWeightGroup)  # the wire's bounds
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise StageCommandError(f"stage {self.name!r}: invalid weight group: {exc}") from None
        signature = (
            "InitWeightGroup",
            call.group,
            call.address,
            call.port,
            call.world_size,
            call.rank_offset,
            call.backend,
            call.group_timeout_s,
        )
        return self._stateless(call, signature, command, now)

    def _profile(self, call: I.ProfileCall, now: float) -> StageStep:
        """Start or stop every rank's profiler. A task like the others (one in flight, its
        deadline, its outcome), but in a settled state and never changing it: requests keep
        running meanwhile, and the ranks' NACKs are the outcome's refusals, not a failure."""
        command = Profile(task_id=call.task_id, epoch=self.epoch, start=call.start, prefix=call.prefix)
        return self._stateless(call, ("Profile", call.start, call.prefix), command, now)

    def _command(self, call: I.CommandCall, now: float) -> StageStep:
        """A stateless command given whole: held to the wire's bounds, stamped with the
        stage's epoch and sent to every rank where its row allows; its own fields are the
        signature a retry must match."""
        kind = type(call.command)
        row = CALLS.get(kind)
        if row is None or not row.stateless:
            known = ", ".join(k.__name__ for k in STATELESS)
            raise StageCommandError(
                f"stage {self.name!r}: a CommandCall carries one of {known}, not {kind.__name__}; "
                "use that command's own call"
            )
        try:
            stamped = msgspec.structs.replace(call.command, epoch=self.epoch)
            command = msgspec.convert(msgspec.to_builtins(stamped), kind)  # the wire's bounds
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise StageCommandError(f"stage {self.name!r}: invalid {kind.__name__}: {exc}") from None
        return self._stateless(call, (kind.__name__, *arguments(command).values()), command, now)

    def _stateless(self, call: Any, signature: tuple[Any, ...], command: Command, now: float) -> StageStep:
        """Issue a stateless command: its row's argument check first, then, once the stage is
        idle, its legality (the row's trigger, and `legal` where the row has one)."""
        row = CALLS[type(command)]
        if row.check is not None:
            row.check(self, command)

        def plan() -> StageTask:
            if not self.lifecycle.allows(row.trigger) or (row.legal is not None and not row.legal(self)):
                raise StageCommandError(f"stage {self.name!r} cannot {row.verb} in {self.state.value}{row.why}")
            return self._stateless_task(call, signature, command, now)

        return self._issue(type(command), call.task_id, signature, now, call.deadline_s, plan)

    # ------------------------------------------------------------------ the pause

    def _pause(self, call: I.PauseCall, now: float) -> StageStep:
        """Close admission keeping the memory. Commits PAUSED once no request is in flight,
        at once when none is; a drain that outlives its deadline abandons the pause (RUNNING)."""
        task_id, mode = call.task_id, call.mode
        if mode not in PAUSE_MODES:
            raise StageCommandError(
                f"pause mode must be one of {list(PAUSE_MODES)} (abort: in-flight requests fail now; "
                f"wait, keep: they finish first), got {str(mode)[:40]!r}"
            )
        if type(call.clear_cache) is not bool:
            raise StageCommandError(f"clear_cache must be true or false, got {call.clear_cache!r}")
        signature: tuple[Any, ...] = ("Pause", mode, True) if call.clear_cache else ("Pause", mode)
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("pause")
        if self.lifecycle.allows("pause_already"):
            return self._instant(task_id, signature, Pause(task_id, mode), "pause_already", AckStatus.ALREADY, now)
        if not self.lifecycle.allows("pause_drain"):
            raise StageCommandError(
                f"stage {self.name!r} cannot pause in {self.lifecycle.state.value}: only a RUNNING stage "
                "pauses (a sleeping one admits no request already; wake it first)"
            )
        self._task = StageTask(
            task_id,
            signature,
            Pause(task_id, mode),  # type: ignore[arg-type]  # a stand-in, never sent
            now,
            now + call.deadline_s,
            expect_asleep=self.residency.asleep,
            commit_trigger="pause_drained",
            expect_version=self.weights_version,
        )
        self.lifecycle.fire("pause_drain")
        if mode == "keep" and self.in_flight:
            return self._hold(call, signature, now)
        if mode == "abort":
            # The callers hear now; the ranks still run these requests, and the stage is
            # PAUSED only once every rank has answered them.
            for request in self.in_flight.values():
                self.requests.answer(
                    request,
                    RequestError.ABORTED,
                    f"request {request.request_id} aborted: stage {self.name!r} is pausing (mode=abort)",
                )
        step = self._send_drained(now) if not self.in_flight else StageStep()
        return step

    def _resume(self, call: I.ResumeCall, now: float) -> StageStep:
        """Open a PAUSED stage's admission again; on a RUNNING stage an ALREADY no-op."""
        task_id = call.task_id
        signature = ("Resume",)
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("resume")
        if self.paused and self.lifecycle.allows("resume_asleep"):
            self.paused = False  # asleep: the next wake serves
            return self._instant(task_id, signature, Resume(task_id), "resume_asleep", AckStatus.OK, now)
        if self.lifecycle.allows("resume_already"):
            return self._instant(task_id, signature, Resume(task_id), "resume_already", AckStatus.ALREADY, now)
        if not self.lifecycle.allows("resume"):
            raise StageCommandError(
                f"stage {self.name!r} is {self.lifecycle.state.value}, not PAUSED: nothing to resume; "
                "a sleeping stage serves again after wake()"
            )
        self.paused = False
        if self.holding:
            return self._release(call, signature, now)
        return self._instant(task_id, signature, Resume(task_id), "resume", AckStatus.OK, now)

    # ------------------------------------------------------------------ pause mode keep

    def _hold(self, call: I.PauseCall, signature: tuple[Any, ...], now: float) -> StageStep:
        """Pause mode keep: HoldRequests to every rank, which freezes the requests in flight
        where they are; PAUSED once every rank ACKed, with those requests still in flight."""
        command = HoldRequests(task_id=call.task_id, epoch=self.epoch, hold=True, clear_cache=call.clear_cache)
        self._task = self._hold_task(call.task_id, signature, command, now, call.deadline_s)
        return self._send_all()

    def _release(self, call: I.ResumeCall, signature: tuple[Any, ...], now: float) -> StageStep:
        """resume() of held requests: RUNNING at once (admission opens; each rank takes the
        release before any request dispatched after it), then HoldRequests(hold=False) to
        every rank; the resume is answered once every rank ACKed it."""
        self.lifecycle.fire("resume")
        command = HoldRequests(task_id=call.task_id, epoch=self.epoch, hold=False)
        self._task = self._hold_task(call.task_id, signature, command, now, call.deadline_s)
        return self._send_all()

    def _hold_task(
        self, task_id: str, signature: tuple[Any, ...], command: HoldRequests, now: float, deadline_s: float
    ) -> StageTask:
        return StageTask(
            task_id,
            signature,
            command,
            now,
            now + deadline_s,
            expect_state=WorkerState.ACTIVE,
            expect_asleep=self.residency.asleep,
            commit_trigger="pause_drained" if command.hold else "",
            expect_version=self.weights_version,
        )

    def _on_hold_reply(self, task: StageTask, reply: Ack | Nack, now: float) -> StageStep:
        """A rank's answer to a hold or a release: any refusal, or an ACK elsewhere than ACTIVE
        at the stage's version, fails the stage (which requests it holds is not known then)."""
        assert isinstance(task.command, HoldRequests)
        wrong = ""
        if isinstance(reply, Nack):
            wrong = f"NACK {reply.reason.value} in {reply.state.value}: {reply.detail}"
        elif reply.command != "HoldRequests" or reply.state is not WorkerState.ACTIVE:
            wrong = f"ACKed a {reply.command!r} in {reply.state.value}; the stage expected HoldRequests in ACTIVE"
        elif reply.weights_version != task.expect_version:
            wrong = f"ACKed HoldRequests at weights version {reply.weights_version}, not {task.expect_version}"
        if wrong or not isinstance(reply, Ack):
            return self._fail_task({reply.rank: wrong}, now)
        task.acks[reply.rank] = reply
        if len(task.acks) < len(self.ranks):
            return StageStep()
        if task.command.hold:
            self.lifecycle.fire("pause_drained")
            self.paused, self.holding = True, bool(self.in_flight)
        else:
            self.holding = False
        outcome = replace(self._end_task(True, "", {}, now), command="Pause" if task.command.hold else "Resume")
        self.completed.put(task.task_id, (task.signature, outcome))
        return StageStep(outcome=outcome)

    def _instant(
        self,
        task_id: str,
        signature: tuple[Any, ...],
        command: Command | Pause | Resume,
        trigger: str,
        status: AckStatus,
        now: float,
    ) -> StageStep:
        """A task that ends in the call that starts it: nothing goes to the ranks."""
        self.lifecycle.fire(trigger)
        outcome = TaskOutcome(
            task_id,
            type(command).__name__,
            True,
            status,
            self.lifecycle.state,
            MappingProxyType({}),
            MappingProxyType({}),
            "",
            now,
            now,
        )
        self.completed.put(task_id, (signature, outcome))
        return StageStep(outcome=outcome)

    # ------------------------------------------------------------------ the requests

    def _submit(self, event: I.Submit, now: float) -> StageStep:
        request = StageRequest(event.request_id, event.payload, now + event.timeout_s, event.adapter)
        if request.request_id in self.requests:
            why = f"request id {request.request_id!r} is already queued or in flight on stage {self.name!r}; "
            self.requests.answer(request, RequestError.REJECTED, why + "submit each request under a new id")
            return StageStep()
        decision = admission.admit(self.state, self.policy).decision
        if decision is Admit.RUN and self.requests.has_room() and not self.queue:
            return self._dispatch(request)
        refusal = self._refusal(decision)
        if refusal:
            self.requests.answer(request, RequestError.REJECTED, refusal)
        elif len(self.queue) >= self.queue_limit:
            self.requests.answer(request, RequestError.REJECTED, self._queue_full())
        else:
            self.queue.append(request)
        return StageStep()

    def _refusal(self, decision: Admit) -> str:
        name, state = self.name, self.state.value
        if decision is Admit.REFUSE_FAILED:
            return f"stage {name!r} is {state}: {self.failure or 'stopped'}; restart() it first"
        if self.state is S.NEEDS_RELOAD and self.versions.floor and decision is not Admit.RUN:
            return self.versions.floor_detail(name)
        if self.state is S.NEEDS_RELOAD and self.versions.kind == "dummy" and decision is not Admit.RUN:
            return self.versions.dummy_detail(name)
        if decision is Admit.REFUSE_POLICY and self.state is S.NEEDS_RELOAD:
            return (
                f"stage {name!r} is NEEDS_RELOAD (weights discarded by a level-2 sleep) and its admission "
                "policy is 'reject'; call reload_weights() first"
            )
        if decision is Admit.REFUSE_POLICY:
            fix = "resume() it" if self.state is S.PAUSED else "wake it"
            return (
                f"stage {name!r} is {state}, not RUNNING, and its admission policy is 'reject'; {fix} "
                "first or use admission='queue' or 'wake'"
            )
        if decision is Admit.REFUSE_NEEDS_RELOAD:
            return (
                f"stage {name!r} is NEEDS_RELOAD (weights discarded by a level-2 sleep); call "
                "reload_weights() before sending requests"
            )
        return ""

    def _queue_full(self) -> str:
        if self.state is S.RUNNING:
            return (
                f"stage {self.name!r} has {len(self.in_flight)} requests in flight (max_in_flight) and "
                f"{len(self.queue)} queued (queue_limit); retry later or raise the limits"
            )
        return (
            f"stage {self.name!r} is {self.state.value} and its queue is full ({self.queue_limit} "
            "requests); retry later or raise queue_limit"
        )

    def _pump(self, now: float) -> StageStep:
        """Move the queue on after anything changed (QUEUE_RULES), and end a start."""
        step = StageStep()
        if self._start_pending and self.state in (S.RUNNING, S.NEEDS_RELOAD, S.FAILED, S.STOPPED):
            self._start_pending = False
            step = StageStep(started=self.state)
        action = admission.queue_rule(self.state, self.policy).action
        if action is QueueAction.DISPATCH:
            # Collected, then joined once: chaining `then` per request copies the sends each
            # time (quadratic in the requests a resume releases).
            sends: list[Outbound] = []
            while self.queue and self.requests.has_room():
                sends += self._dispatch(self.queue.popleft()).sends
            step = step.then(StageStep(sends=tuple(sends)))
        elif action is QueueAction.AUTO_WAKE and self.queue and self._task is None:
            task_id = f"auto-wake-{self.name}-{self.epoch}-{next(self._auto_wakes)}"
            step = step.then(self._wake(I.WakeCall(task_id, None, self.wake_deadline_s), now))
        elif action is QueueAction.REJECT_ALL:
            if self.state is S.NEEDS_RELOAD:  # the same words as a refusal at submit
                why = self._refusal(Admit.REFUSE_NEEDS_RELOAD)
            else:
                why = f"{self.failure or f'stage {self.name!r} is {self.state.value}'}; restart() the stage"
            self.requests.fail_all(RequestError.REJECTED, why)
        return step

    def _dispatch(self, request: StageRequest) -> StageStep:
        split = self.adapter_splits.request_problem(self.name, request.adapter)
        if split is not None:  # P-20: all or none; never a request on ranks that disagree
            self.requests.answer(request, RequestError.REJECTED, split)
            return StageStep()
        self.lifecycle.fire("execute")  # legal only in RUNNING: the table is the check
        self.requests.start(request)
        command = Execute(
            task_id=request.request_id, epoch=self.epoch, payload=request.payload, adapter=request.adapter
        )
        return StageStep(sends=tuple(Outbound(rank, command) for rank in self.ranks))

    def _on_request_reply(self, request: StageRequest, reply: Result | Nack, now: float) -> StageStep:
        if reply.rank not in self.ranks:
            self.counters.unknown_replies_ignored += 1
            return StageStep()
        request.replies[reply.rank] = reply
        if isinstance(reply, Result) and reply.weights_version != self.weights_version:
            request.off_version[reply.rank] = reply.weights_version
        return self._maybe_retire(request, now)

    def _maybe_retire(self, request: StageRequest, now: float) -> StageStep:
        """A request retires only when every rank has answered it: until then a rank may still
        be running it, and a sleep must not go out over it."""
        if len(request.replies) < len(self.ranks):
            return StageStep()
        refusals = {r: m for r, m in sorted(request.replies.items()) if isinstance(m, Nack)}
        results = [m for _, m in sorted(request.replies.items()) if isinstance(m, Result)]
        mixed = dict(sorted(request.off_version.items()))
        if refusals:
            named = "; ".join(f"rank {r}: {m.reason.value} in {m.state.value}: {m.detail}" for r, m in refusals.items())
            self.requests.answer(
                request, RequestError.FAILED, f"stage {self.name!r} refused request {request.request_id} ({named})"
            )
        elif mixed:  # P-17: never a result of weights other than the stage's committed version
            self.requests.answer(
                request,
                RequestError.FAILED,
                f"stage {self.name!r}: ranks {sorted(mixed)} answered request "
                f"{request.request_id} with weights versions {mixed}, not the stage's version "
                f"{self.weights_version}; the result is discarded",
            )
            self.requests.retire(request)
            why = {
                r: f"answered request {request.request_id} with weights version {v}; the stage committed "
                f"version {self.weights_version}"
                for r, v in mixed.items()
            }
            return self._fail_task(why, now) if self._task else self._fail_idle(why, now)
        elif len({m.adapter_version for m in results}) > 1:
            self._answer_adapter_straddle(request)
        elif results:  # ranks of one stage compute the same result: rank 0's
            first = results[0]
            ran = (first.weights_version, first.adapter, first.adapter_version)
            self.requests.answer(request, None, "", first.output, *ran, first.version_spans, first.discarded_tokens)
        return self._retire(request, now)

    def _answer_adapter_straddle(self, request: StageRequest) -> None:
        """P-20: an adapter refit that reached some ranks only: never a result of two versions."""
        versions = {r: m.adapter_version for r, m in sorted(request.replies.items()) if isinstance(m, Result)}
        self.requests.answer(
            request,
            RequestError.FAILED,
            f"stage {self.name!r}: ranks answered request {request.request_id} with adapter "
            f"{request.adapter!r} at versions {versions}: a refit reached only some ranks; the result "
            "is discarded: add the adapter again (one version on every rank)",
        )

    def _retire(self, request: StageRequest, now: float) -> StageStep:
        self.requests.retire(request)
        if self.state is S.DRAINING and not self.in_flight and self._task is not None and not self._task.sent:
            return self._send_drained(now)
        return StageStep()

    def _send_failed(self, event: I.SendFailed, now: float) -> StageStep:
        request = self.in_flight.get(event.task_id)
        if request is None:
            return StageStep()  # a lifecycle command: its deadline names the rank (P-9)
        # The engine, not a rank, is at fault: its queue to these ranks is full. The caller
        # hears now; ranks that got the request still answer, and it retires when they have.
        self.requests.answer(
            request,
            RequestError.OVERLOADED,
            f"request {request.request_id} to stage {self.name!r} "
            f"could not be sent to ranks {list(event.ranks)}: the engine is overloaded (its socket "
            "queue is full); retry later or lower max_in_flight",
        )
        for rank in event.ranks:
            request.replies[rank] = None
        return self._maybe_retire(request, now)

    def _expire_requests(self, now: float) -> StageStep:
        """Every request at its own deadline: one sent to the ranks and still unanswered fails
        the ranks that gave no result (P-9); a queued one is rejected, and a short one never
        waits behind a long one."""
        step = StageStep()
        silent: dict[int, str] = {}
        for request in [r for r in self.in_flight.values() if now >= r.deadline_at_s]:
            self.recorder.expired(request.deadline_at_s, request.request_id)
            missing = [r for r in self.ranks if r not in request.replies]
            self.requests.answer(
                request,
                RequestError.FAILED,
                f"request {request.request_id} to stage {self.name!r}: "
                f"ranks {missing} gave no result before its deadline; the stage fails, since a rank "
                "still running a request cannot be put to sleep safely",
            )
            for rank in missing:
                silent.setdefault(rank, f"no result for request {request.request_id} before its deadline")
        if silent:
            step = step.then(self._ranks_unresponsive(silent, now))
        # Every queued request at its own deadline: a short one must not wait behind a long one.
        for request in self.queue.pop_expired(now):
            self.requests.answer(
                request,
                RequestError.REJECTED,
                f"request {request.request_id} waited in the queue of "
                f"stage {self.name!r} until its deadline; the stage stayed {self.state.value}",
            )
        return step

    def _ranks_unresponsive(self, failures: dict[int, str], now: float) -> StageStep:
        """Ranks that gave no result for a request within its deadline (P-9): the stage
        cannot trust them with a sleep or the next request, so it fails naming them."""
        failures = {r: why for r, why in failures.items() if r in self.ranks}
        if not failures or self.state in (S.FAILED, S.STOPPED):
            return StageStep()
        step = self._fail_task(failures, now) if self._task else self._fail_idle(failures, now)
        return step

    # ------------------------------------------------------------------ the replies and time

    def _received(self, message: Reply | Hello, now: float) -> StageStep:
        """A reply on a bound rank's socket: a Hello, a request's answer, or a lifecycle task's."""
        if isinstance(message, Hello):
            return self._hello(message, now)
        if isinstance(message, (Ack, Result)) and message.epoch == self.epoch:
            self._note_counters(message.rank, message.runner_counters)
        request = self.in_flight.get(message.task_id)
        if request is not None and message.epoch == self.epoch and isinstance(message, (Result, Nack)):
            return self._on_request_reply(request, message, now)
        if isinstance(message, Result):
            self.counters.late_results += 1
            return StageStep()
        step = self._on_reply(message, now)
        return step

    def _hello(self, hello: Hello, now: float) -> StageStep:
        if hello.epoch != self.epoch or self.state is not S.STARTING:
            self.counters.stale_replies_ignored += 1
            return StageStep()
        if hello.rank not in self.ranks:
            return self._fail_idle({hello.rank: f"rank {hello.rank} is not one of {list(self.ranks)}"}, now)
        if tuple(hello.tags) != self.tags:
            return self._fail_idle({hello.rank: f"has tags {list(hello.tags)}, stage expects {list(self.tags)}"}, now)
        self.rank_state[hello.rank] = hello.state
        self._hello_detail[hello.rank] = hello.detail
        self.rank_capabilities[hello.rank] = frozenset(hello.capabilities)
        self.rank_versions[hello.rank] = hello.weights_version
        self.rank_pool_bytes[hello.rank] = dict(hello.pool_bytes)
        self.rank_counters[hello.rank] = dict(hello.runner_counters)
        if set(self.rank_state) == set(self.ranks):
            versions = set(self.rank_versions.values())
            if len(versions) > 1:
                return self._fail_idle(
                    {
                        r: f"started with weights version {v}; the ranks hold different weights "
                        f"({dict(sorted(self.rank_versions.items()))})"
                        for r, v in self.rank_versions.items()
                    },
                    now,
                )
            return self._all_said_hello(versions.pop(), now)
        return StageStep()

    def _all_said_hello(self, version: int, now: float) -> StageStep:
        """Every rank said Hello at `version`: RUNNING when each started as its restart's
        `start_weights` says (ACTIVE at that version), NEEDS_RELOAD when each started with
        its weights untrusted; anything else FAILED, naming the ranks."""
        plan = self.start_weights
        want = WorkerState.NEEDS_RELOAD if plan is not None and plan.needs_reload else WorkerState.ACTIVE
        bad = {r: s for r, s in self.rank_state.items() if s is not want}
        if bad:
            return self._fail_idle(
                {r: f"started in {s.value}, not {want.value}: {self._hello_detail.get(r, '')}" for r, s in bad.items()},
                now,
            )
        if plan is not None and version != plan.version:
            return self._fail_idle(
                {
                    r: f"started at weights version {version}, not {plan.version} (loaded from "
                    f"{plan.source or 'its checkpoint'}): the rank ignored its start source"
                    for r in self.ranks
                },
                now,
            )
        self.weights_version = version
        if want is WorkerState.NEEDS_RELOAD:
            self.residency.weights_valid = False
            self.lifecycle.fire("started_needs_reload")
        else:
            self.lifecycle.fire("started")
        return StageStep()

    def _on_reply(self, reply: Reply, now: float) -> StageStep:
        if reply.epoch != self.epoch:
            self.counters.stale_replies_ignored += 1
            return StageStep()
        task = self._task
        if (
            task is None
            or not task.sent
            or reply.task_id != task.task_id
            or reply.rank not in self.ranks
            or not isinstance(reply, (Ack, Nack))
        ):
            self.counters.unknown_replies_ignored += 1
            return StageStep()
        if reply.rank in task.acks or reply.rank in task.refusals:
            self.counters.duplicate_replies_ignored += 1
            return StageStep()
        if isinstance(task.command, HoldRequests):
            return self._on_hold_reply(task, reply, now)
        if isinstance(reply, Nack) and reply.reason is REFUSAL_REASON.get(type(task.command)):
            # A rank sends NO_MEMORY only once it rolled its wake back (P-16), whether the wake
            # could wait or not: a refusal that changed nothing; one that could not roll back
            # raised, and its NACK is a failure below.
            task.refusals[reply.rank] = reply.detail
            return self._maybe_commit(now)
        if isinstance(task.command, STATELESS):
            return self._on_profile_reply(task, reply, now)
        if (
            isinstance(reply, Nack)
            and reply.reason is NackReason.UPDATE_FAILED
            and isinstance(task.command, UpdateWeights)
            and reply.state is task.failed_state
        ):
            task.update_failures[reply.rank] = f"at weights version {reply.weights_version}: {reply.detail}"
            return self._maybe_commit(now)
        if isinstance(reply, Nack):
            return self._fail_task(
                {reply.rank: f"NACK {reply.reason.value} in {reply.state.value}: {reply.detail}"}, now
            )
        command = type(task.command).__name__
        if reply.command != command:
            return self._fail_task(
                {reply.rank: f"ACKed a {reply.command!r} for task {task.task_id!r}, which is a {command}"}, now
            )
        if reply.status is AckStatus.OK and reply.memory is None:
            # An effect that moved memory must say how much (per process, P-12); an ACK
            # without it is not a conforming worker's and is not trusted to commit.
            self.counters.acks_without_memory_report += 1
            return self._fail_task({reply.rank: f"ACKed {command} without a memory report"}, now)
        version_problem = self._version_problem(task, reply)
        if version_problem:
            return self._fail_task({reply.rank: version_problem}, now)
        asleep = frozenset(reply.asleep_tags)
        if reply.state is not task.expect_state or asleep != task.expect_asleep:
            return self._fail_task(
                {
                    reply.rank: (
                        f"ACKed in {reply.state.value} with asleep tags {sorted(asleep)}; the stage "
                        f"expected {task.expect_state.value} with {sorted(task.expect_asleep)}"
                    )
                },
                now,
            )
        task.acks[reply.rank] = reply
        if reply.memory is not None:
            self.rank_pool_bytes[reply.rank] = dict(reply.memory.pool_bytes_after)
        return self._maybe_commit(now)

    def _note_counters(self, rank: int, values: dict[str, int]) -> None:
        """A rank's runner counters, for status: only the names its Hello declared (a closed
        set, so each can be a metric label); other names are counted and dropped."""
        declared = self.rank_counters.get(rank)
        if declared is None or not values:
            return
        if not values.keys() <= declared.keys():
            self.counters.undeclared_counters_ignored += 1
            return
        declared.update(values)

    def _on_profile_reply(self, task: StageTask, reply: Ack | Nack, now: float) -> StageStep:
        """A rank answering Profile (or InitWeightGroup) must still be where the stage committed it: a profile
        changes no state. A refusal that left it there (BUSY, PROFILE_ERROR, a worker that
        does not know Profile) is that rank's answer; any other state is a divergence and
        fails the stage as any task would (P-9)."""
        known = self.rank_state.get(reply.rank)
        asleep = frozenset(reply.asleep_tags) if isinstance(reply, Ack) else self.residency.asleep
        if reply.state is not known or asleep != self.residency.asleep:
            return self._fail_task(
                {
                    reply.rank: (
                        f"answered Profile in {reply.state.value} with asleep tags {sorted(asleep)}; the stage "
                        f"committed it {known.value if known else '-'} with {sorted(self.residency.asleep)}"
                    )
                },
                now,
            )
        if isinstance(reply, Nack):
            task.refusals[reply.rank] = f"NACK {reply.reason.value}: {reply.detail}"
        elif reply.command != type(task.command).__name__:
            return self._fail_task(
                {
                    reply.rank: f"ACKed a {reply.command!r} for task {task.task_id!r}, "
                    f"which is a {type(task.command).__name__}"
                },
                now,
            )
        else:
            task.acks[reply.rank] = reply
        if len(task.acks) + len(task.refusals) < len(self.ranks):
            return StageStep()
        self.lifecycle.fire(task.commit_trigger)  # internal: the table says the state stays
        error = ""
        if task.refusals:
            named = "; ".join(f"rank {r}: {why}" for r, why in sorted(task.refusals.items()))
            done = f"; ranks {sorted(task.acks)} did it" if task.acks else ""
            kind = type(task.command).__name__
            error = f"stage {self.name!r}: {kind} refused by ranks {sorted(task.refusals)} ({named}){done}"
        split = self.adapter_splits.settled(task.command, task.acks, task.refusals)
        error += f"; {split}" if split else ""
        statuses = {ack.status for ack in task.acks.values()}
        row = CALLS.get(type(task.command))
        if not task.refusals and row is not None and row.done is not None:
            row.done(self, task.command)
        outcome = self._end_task(not task.refusals, error, {}, now, refused=bool(task.refusals))
        self.transfers.settled(task.command, bool(task.acks), not task.refusals, self.weights_version)
        if statuses == {AckStatus.ALREADY}:
            outcome = replace(outcome, status=AckStatus.ALREADY)
        outcome = replace(outcome, refusals=MappingProxyType(dict(task.refusals)))
        self.completed.put(task.task_id, (task.signature, outcome))
        return StageStep(outcome=outcome)

    def _version_problem(self, task: StageTask, reply: Ack) -> str:
        """What is wrong with the weights version an ACK reports; "" when nothing. A reload
        from a directory takes the version its first ACK names (a save's index, P-21), which
        must not be below a version floor and which every other rank must report too."""
        if task.version_from_source and not task.acks:
            if reply.weights_version < self.versions.floor:
                return (
                    f"reloaded weights version {reply.weights_version} (its source's save index), below the "
                    f"stage's floor {self.versions.floor}; the stage fails rather than serve it: restart it, "
                    "then update to the floor or above, or reload a save at or above it"
                )
            task.expect_version = reply.weights_version
        if reply.weights_version != task.expect_version:
            return (
                f"ACKed {reply.command} at weights version {reply.weights_version}; the stage expected version "
                f"{task.expect_version} on every rank"
            )
        return ""

    def _maybe_commit(self, now: float) -> StageStep:
        """Once every rank answered: commit on a complete ACK set (P-5), return to the
        previous state when every rank refused the arguments, fail when they disagree."""
        task = self._task
        assert task is not None
        failed = task.update_failures
        if len(task.acks) + len(task.refusals) + len(failed) < len(self.ranks):
            return StageStep()
        if failed and len(failed) == len(self.ranks):
            # Every rank is NEEDS_RELOAD at the version it held: the stage follows, never serving.
            self.residency.weights_valid = False
            for rank in self.ranks:
                self.rank_state[rank] = task.failed_state
            self.lifecycle.fire(task.failed_trigger)
            details = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            then = (
                "update again or reload"
                if self.state is S.NEEDS_RELOAD
                else "its host copies stand for no version: wake it (NEEDS_RELOAD), then update again or reload"
            )
            error = (
                f"stage {self.name!r}: every rank failed the update to weights version {task.expect_version} "
                f"({details}); the stage is {self.state.value} at version {self.weights_version}: {then}"
            )
            return StageStep(outcome=self._end_task(False, error, dict(failed), now))
        if failed:
            done = (
                f"ranks {sorted(task.acks)} now hold version {task.expect_version}"
                if task.acks
                else f"ranks {sorted(task.refusals)} refused it and hold version {self.weights_version}"
            )
            return self._fail_task(
                {
                    r: f"failed the update while {done} (ranks now hold different weights): {why}"
                    for r, why in failed.items()
                },
                now,
            )
        if task.refusals and task.acks:
            what = (
                "found too little free device memory while ranks {} woke (ranks now hold different tags)"
                if isinstance(task.command, Wake)
                else "refused the source while ranks {} %s it (ranks now hold "
                "different weights)" % ("wrote" if isinstance(task.command, UpdateWeights) else "reloaded")
            )
            return self._fail_task(
                {r: f"{what.format(sorted(task.acks))}: {why}" for r, why in task.refusals.items()}, now
            )
        if task.refusals:
            self.lifecycle.fire(task.refused_trigger)
            details = "; ".join(f"rank {r}: {why}" for r, why in sorted(task.refusals.items()))
            what = (
                "the wake for lack of free device memory, nothing stayed mapped"
                if isinstance(task.command, Wake)
                else f"the {'update' if isinstance(task.command, UpdateWeights) else 'reload'}, nothing was written"
            )
            outcome = self._end_task(False, f"every rank refused {what} ({details})", {}, now, refused=True)
            outcome = replace(outcome, refusals=MappingProxyType(dict(task.refusals)))
            self.completed.put(task.task_id, (task.signature, outcome))  # a retry hears the refusals too
            return StageStep(outcome=outcome)
        task.apply(self.residency)
        for rank, ack in task.acks.items():
            self.rank_state[rank] = ack.state
            self.rank_versions[rank] = ack.weights_version
        self.weights_version = task.expect_version
        self.versions.committed(task.command, task.expect_version)
        self.lifecycle.fire(task.commit_trigger)
        return StageStep(outcome=self._end_task(True, "", {}, now))

    def _tick(self, now: float) -> StageStep:
        """Enforce the deadlines of the start and of the task in flight (P-9)."""
        step = StageStep()
        if self.state is S.STARTING and now >= self._start_deadline_at_s:
            self.recorder.expired(self._start_deadline_at_s)
            silent = [r for r in self.ranks if r not in self.rank_state]
            step = self._fail_idle({r: "sent no Hello before the start-up deadline" for r in silent}, now)
        elif self._task is not None and now >= self._task.deadline_at_s:
            task = self._task
            self.recorder.expired(task.deadline_at_s, task.task_id)
            budget_s = task.deadline_at_s - task.started_at
            if self.state is S.DRAINING and not task.sent:  # a keep's hold went out: its ranks are silent
                self.lifecycle.fire("drain_timeout")
                what = type(task.command).__name__.removesuffix("Weights").lower()  # update, sleep, pause
                step = StageStep(
                    outcome=self._end_task(
                        False,
                        f"{self.in_flight_requests} in-flight request(s) did not finish "
                        f"within {budget_s:.3g} s; {what} abandoned, nothing was sent to the ranks, "
                        f"stage {self.name!r} stays RUNNING",
                        {},
                        now,
                    )
                )
            else:
                silent = [r for r in self.ranks if r not in task.acks and r not in task.refusals]
                step = self._fail_task(
                    {r: f"no reply to {type(task.command).__name__} within {budget_s:.3g} s" for r in silent}, now
                )
        return step

    def _rank_died(self, rank: int, detail: str, now: float, epoch: int) -> StageStep:
        """A rank process ended. `epoch` (the epoch it was started in) fences reports about
        processes of an earlier incarnation: those are counted and ignored (P-6)."""
        if epoch != self.epoch or rank not in self.ranks:
            self.counters.stale_replies_ignored += 1
            return StageStep()
        if self.state in (S.FAILED, S.STOPPED):
            return StageStep()
        why = {rank: f"process died: {detail}"}
        step = self._fail_task(why, now) if self._task else self._fail_idle(why, now)
        return step
