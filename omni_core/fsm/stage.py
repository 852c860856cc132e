"""Stage lifecycle: the transition table of one stage and its sans-IO core.

The stage core turns an API call (sleep, wake, reload) into one command per rank, then
aggregates the ranks' replies. It commits SLEEPING / RUNNING / PARTIAL / NEEDS_RELOAD only
on a complete set of ACKs for the current task whose reported states agree with what the
stage expects (P-5); a NACK, a dead rank or a passed deadline ends the task in FAILED with
the ranks named (P-8, P-9). Replies from an older epoch or for another task are counted and
ignored (P-6). Time comes in as an argument (`now`), never from a clock.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import msgspec

from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy, Admit, QueueAction, admit, queue_rule
from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.fsm.reply_cache import BoundedCache
from omni_core.fsm.settle import Settled, settle_row
from omni_core.fsm.table import Lifecycle, Transition
from omni_core.fsm.tags import DEFAULT_TAGS, Residency, UnknownTagError, plan_sleep, resolve_tags
from omni_core.fsm.trace_records import (
    RankDied,
    RequestAnswered,
    RequestSubmitted,
    StageChanged,
    StageDeadline,
    StageDispatched,
    StageIssued,
    StageReceived,
    StageRecord,
    StageRestarted,
    StageSent,
    StageStarting,
    StageStopped,
    TaskEnded,
    clip,
)
from omni_core.fsm.worker import InvariantViolation
from omni_core.protocol import (
    MAX_WAIT_FOR_MEMORY_S,
    Ack,
    AckStatus,
    Capability,
    Command,
    Execute,
    Hello,
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
    WeightSource,
    WorkerState,
    profile_prefix_problem,
)
from omni_core.protocol import StageState as S

_SERVING = (S.RUNNING, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)  # settled, no task in flight
_IN_TASK = (S.DRAINING, S.TRANSITIONING, S.WAKING)

STAGE_TRANSITIONS: tuple[Transition[S], ...] = (
    Transition("started", (S.STARTING,), S.RUNNING, "every rank said Hello"),
    Transition("drain", (S.RUNNING,), S.DRAINING, "sleep(): admission closed"),
    Transition("drained", (S.DRAINING,), S.TRANSITIONING, "no request in flight: Sleep sent to every rank"),
    Transition(
        "drain_timeout",
        (S.DRAINING,),
        S.RUNNING,
        "requests did not drain by the deadline; nothing was sent, sleep abandoned",
    ),
    Transition(
        "sleep",
        (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
        S.TRANSITIONING,
        "sleep more tags; nothing executes here, so nothing to drain",
    ),
    Transition(
        "sleep_already",
        (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
        None,
        "every requested tag already asleep: ALREADY (P-4)",
    ),
    Transition("slept", (S.TRANSITIONING,), S.SLEEPING, "every rank ACKed the Sleep (P-5)"),
    Transition("wake", (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD), S.WAKING, "Wake sent to every rank"),
    Transition("wake_already", _SERVING, None, "every requested tag resident: ALREADY (P-4)"),
    Transition("reload", (S.NEEDS_RELOAD,), S.WAKING, "ReloadWeights sent to every rank"),
    Transition(
        "reload_refused",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank refused the source (INVALID_ARGUMENT): nothing was written",
    ),
    Transition(
        "wake_refused_sleeping",
        (S.WAKING,),
        S.SLEEPING,
        "every rank refused the Wake for lack of free device memory (NO_MEMORY): nothing stayed mapped",
    ),
    Transition(
        "wake_refused_partial",
        (S.WAKING,),
        S.PARTIAL,
        "every rank refused the Wake for lack of free device memory (NO_MEMORY): nothing stayed mapped",
    ),
    Transition(
        "wake_refused_needs_reload",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank refused the Wake for lack of free device memory (NO_MEMORY): nothing stayed mapped",
    ),
    Transition("woke_running", (S.WAKING,), S.RUNNING, "every rank ACKed, all resident (P-5)"),
    Transition("woke_partial", (S.WAKING,), S.PARTIAL, "every rank ACKed, tags still asleep"),
    Transition(
        "woke_needs_reload", (S.WAKING,), S.NEEDS_RELOAD, "every rank ACKed; weights mapped but discarded at level 2"
    ),
    Transition(
        "update_drain",
        (S.RUNNING,),
        S.DRAINING,
        "update_weights(): admission closed (queued or refused per policy), in-flight requests finish",
    ),
    Transition("update_drained", (S.DRAINING,), S.WAKING, "no request in flight: UpdateWeights sent to every rank"),
    Transition(
        "update",
        (S.PARTIAL, S.NEEDS_RELOAD),
        S.WAKING,
        "UpdateWeights sent to every rank (weights resident; nothing executes here, nothing to drain)",
    ),
    Transition(
        "update_refused_running",
        (S.WAKING,),
        S.RUNNING,
        "every rank refused the update before writing (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        "update_refused_partial",
        (S.WAKING,),
        S.PARTIAL,
        "every rank refused the update before writing (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        "update_refused_needs_reload",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank refused the update before writing (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        "update_failed",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank failed the update once writing began (UPDATE_FAILED): weights invalid, version as before",
    ),
    Transition(
        "weight_group",
        _SERVING,
        None,
        "InitWeightGroup sent to every rank; the state never changes, whatever they answer",
    ),
    Transition(
        "share",
        (S.RUNNING, S.PARTIAL),
        None,
        "ShareWeights sent to every rank (valid weights awake); the state never changes, requests go on",
    ),
    Transition("execute", (S.RUNNING,), None, "admission is open only in RUNNING (P-7)"),
    Transition(
        "profile", _SERVING, None, "Profile sent to every rank; the state never changes, whatever they answer (P-15)"
    ),
    Transition("fail", (S.STARTING,) + _SERVING + _IN_TASK, S.FAILED, "NACK, deadline, or a rank died (P-8, P-9)"),
    Transition("restart", _SERVING + (S.FAILED, S.STOPPED), S.STARTING, "fresh rank processes under a new epoch"),
    Transition("stop", (S.STARTING, S.FAILED) + _SERVING + _IN_TASK, S.STOPPED, "shutdown"),
)

_STAGE_STATE_OF_RANK = {
    WorkerState.ACTIVE: S.RUNNING,
    WorkerState.SLEEPING: S.SLEEPING,
    WorkerState.PARTIAL: S.PARTIAL,
    WorkerState.NEEDS_RELOAD: S.NEEDS_RELOAD,
}


def _level_tags(command: Command) -> tuple[int, tuple[str, ...] | None]:
    """What a trace record says of a command beyond its name: a Sleep's level (for a Wake, 1
    when it waits for free memory, P-16, as the spec marks it; for a Profile, 1 for a start),
    the tags."""
    if isinstance(command, Sleep):
        level = command.level
    elif isinstance(command, Wake) and command.wait_for_memory_s > 0:
        level = 1
    elif isinstance(command, Profile) and command.start:
        level = 1  # as the spec marks a Profile start on the wire
    else:
        level = 0
    return level, command.tags if isinstance(command, (Sleep, Wake)) else None


class StageCommandError(ValueError):
    """A stage call refused before anything was sent: bad argument or wrong state."""


class StageBusyError(StageCommandError):
    """Another lifecycle task of this stage is in flight."""


@dataclass(frozen=True)
class Outbound:
    rank: int
    command: Command


@dataclass(frozen=True)
class TaskOutcome:
    """How a stage task ended. `failures` maps rank -> why, for every rank that failed it."""

    task_id: str
    command: str
    ok: bool
    status: AckStatus
    state: S
    acks: MappingProxyType[int, Ack]
    failures: MappingProxyType[int, str]
    error: str
    started_at: float
    finished_at: float
    refused: bool = False  # every rank refused the arguments; nothing changed (INVALID_ARGUMENT)
    # Profile: rank -> its NACK; those ranks are where they were, as is the stage.
    refusals: MappingProxyType[int, str] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def duration_s(self) -> float:
        return self.finished_at - self.started_at


@dataclass(frozen=True)
class StageStep:
    """What one input produced: commands to send, the lifecycle task's outcome, the answers to
    requests, and (`started`) the end of a start or restart: RUNNING or FAILED."""

    sends: tuple[Outbound, ...] = ()
    outcome: TaskOutcome | None = None
    requests: tuple[RequestOutcome, ...] = ()
    started: S | None = None
    # What happened, in program order (omni_core.fsm.trace_records); set by step() only.
    records: tuple[StageRecord, ...] = field(default=(), compare=False, repr=False)

    def then(self, later: StageStep) -> StageStep:
        """This step followed by `later` (one input may cause both, e.g. a reply and a dispatch)."""
        if self.outcome is not None and later.outcome is not None:
            raise InvariantViolation(f"two task outcomes in one step: {self.outcome} and {later.outcome}")
        return StageStep(
            self.sends + later.sends,
            self.outcome or later.outcome,
            self.requests + later.requests,
            later.started or self.started,
        )


@dataclass
class _Request:
    """One request: in the queue, or sent to every rank and waiting for all their answers."""

    request_id: str
    payload: Any
    deadline_at: float
    replies: dict[int, Result | Nack | None] = field(default_factory=dict)  # None: never sent to it
    answered: bool = False  # the caller already heard (aborted, overloaded)


@dataclass
class StageCounters:
    stale_replies_ignored: int = 0
    unknown_replies_ignored: int = 0
    late_results: int = 0  # request replies for requests no longer in flight
    acks_without_memory_report: int = 0
    duplicate_replies_ignored: int = 0
    retries: int = 0


@dataclass
class _Task:
    task_id: str
    signature: tuple[Any, ...]
    command: Command
    started_at: float
    deadline_at: float
    expect_state: WorkerState = WorkerState.SLEEPING
    expect_asleep: frozenset[str] = frozenset()
    commit_trigger: str = "slept"
    apply: Any = None  # callable(Residency) run on commit
    sent: bool = False
    acks: dict[int, Ack] = field(default_factory=dict)
    refusals: dict[int, str] = field(default_factory=dict)  # rank -> INVALID_ARGUMENT / NO_MEMORY detail
    refused_trigger: str = ""  # where every rank refusing returns the stage (ReloadWeights, Wake)
    drained_trigger: str = "drained"  # fired once a drain for this task ends (sleep, update)
    expect_version: int = 0  # the weights version every ACK must report (P-17)
    update_failures: dict[int, str] = field(default_factory=dict)  # rank -> UPDATE_FAILED detail


# The NACK that is a refusal (the rank is where it was) rather than a failure, per command.
_REFUSAL = {
    ReloadWeights: NackReason.INVALID_ARGUMENT,
    Wake: NackReason.NO_MEMORY,
    UpdateWeights: NackReason.INVALID_ARGUMENT,
}
# Tasks in a settled state that never change it: every NACK is that rank's refusal.
_STATELESS = (Profile, InitWeightGroup, ShareWeights)


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
        self.policy = AdmissionPolicy(policy)
        self.queue_limit = queue_limit
        self.max_in_flight = max_in_flight
        self.wake_deadline_s = wake_deadline_s  # for the wakes the WAKE policy starts itself
        self.queue: deque[_Request] = deque()
        self.in_flight: dict[str, _Request] = {}
        self._answers: list[RequestOutcome] = []  # request outcomes of the input being stepped
        self._records: list[StageRecord] = []  # trace records of the input being stepped
        self._issued: tuple[Command, bool, float] | None = None  # a task this phase issued: command, already, deadline
        self._expired_at: float | None = None  # the deadline this phase's tick found passed
        self._expired_task = ""  # the task or request whose deadline that was ("": the start's)
        self._anonymous = itertools.count(1)
        self._auto_wakes = itertools.count(1)
        self._start_pending = False
        self.counters = StageCounters()
        # Built once: step() dispatches every input (each reply, each tick) through it.
        self._handlers: dict[type, Any] = {
            I.Start: self.on_start,
            I.Restart: self.on_restart,
            I.Stop: self.on_stop,
            I.Submit: self.on_submit,
            I.SleepCall: self.on_sleep_call,
            I.WakeCall: self.on_wake_call,
            I.ReloadCall: self.on_reload_call,
            I.ProfileCall: self.on_profile_call,
            I.UpdateCall: self.on_update_call,
            I.WeightGroupCall: self.on_weight_group_call,
            I.ShareCall: self.on_share_call,
            I.SetAdmission: self.on_set_admission,
            I.Tick: self.on_tick_input,
            I.Received: self.on_received,
            I.RankExited: self.on_rank_exited,
            I.SendFailed: self.on_send_failed,
        }
        self.failure = ""
        self.failed_ranks: dict[int, str] = {}
        self.completed: BoundedCache[str, tuple[tuple[Any, ...], TaskOutcome]] = BoundedCache(completed_task_entries)
        self._task: _Task | None = None
        self._hello_detail: dict[int, str] = {}
        self._start_deadline_at = float("inf")

    # ------------------------------------------------------------------ queries

    @property
    def state(self) -> S:
        return self.lifecycle.state

    @property
    def task_id(self) -> str | None:
        return self._task.task_id if self._task else None

    def admits(self) -> bool:
        """Whether a new request may run now (only RUNNING, P-7)."""
        return self.lifecycle.allows("execute")

    @property
    def in_flight_requests(self) -> int:
        return len(self.in_flight)

    # ------------------------------------------------------------------ the one entry point

    def step(self, event: I.EngineInput, now: float) -> StageStep:
        """Take one engine input; return what to send and what to report. Then move the
        queue on (QUEUE_RULES) and check the invariants. Lifecycle calls that are not legal
        raise StageCommandError before anything changes."""
        handler = self._handlers.get(type(event))
        if handler is None:
            raise TypeError(f"StageCore.step takes an engine input (omni_core.fsm.inputs), not {event!r}")
        self._answers, self._records, self._issued, self._expired_at = [], [], None, None
        self._expired_task = ""
        head = self._input_record(event, now)
        if head is not None:
            self._records.append(head)
        before = self.state
        step = handler(event, now)
        self._record_phase(event, before, step.sends, now)
        before = self.state
        pumped = self._pump(now)
        self._record_phase(None, before, pumped.sends, now)
        step = step.then(pumped)
        answers = tuple(self._answers)
        records = self._records
        records += [RequestAnswered(a.request_id, a.error.value if a.error else "", clip(a.detail)) for a in answers]
        if step.outcome is not None:
            o = step.outcome
            records.append(
                TaskEnded(
                    o.task_id,
                    o.command,
                    o.ok,
                    o.state.value,
                    clip(o.error),
                    {r: clip(why) for r, why in o.failures.items()},
                )
            )
        step = StageStep(step.sends, step.outcome, step.requests + answers, step.started, tuple(records))
        self._answers, self._records = [], []
        self._check_invariants()
        return step

    # ------------------------------------------------------------------ trace records

    def _input_record(self, event: I.EngineInput, now: float) -> StageRecord | None:
        """The record of an input from outside, with the state it found."""
        state = self.state.value
        if isinstance(event, I.Received):
            m = event.message
            info = m.status.value if isinstance(m, Ack) else m.reason.value if isinstance(m, Nack) else ""
            worker_state = m.state.value if isinstance(m, (Ack, Nack, Hello)) else ""
            return StageReceived(m.epoch, m.rank, m.task_id, type(m).__name__.lower(), state, worker_state, info)
        if isinstance(event, I.RankExited):
            fenced = event.epoch != self.epoch or event.rank not in self.ranks
            return RankDied(self.epoch, event.rank, event.epoch, state, clip(event.detail), fenced)
        if isinstance(event, I.Submit):
            decision = admit(self.state, self.policy).decision.value
            return RequestSubmitted(event.request_id, state, decision, now + event.timeout_s)
        return None

    def _record_phase(self, event: I.EngineInput | None, before: S, sends: tuple[Outbound, ...], now: float) -> None:
        """The record of what one phase of a step did (the input's handler, or moving the
        queue on: `event` None), then one per command it sends. A change of state is the
        action that made it (issue, restart, deadline, stop) or, when it came from an input
        already recorded (a reply, a death), a StageChanged that logs it."""
        after, epoch = self.state, self.epoch
        issued, self._issued = self._issued, None
        failed = {r: clip(why) for r, why in self.failed_ranks.items()} if after is S.FAILED else {}
        if issued is not None:
            command, already, deadline_at = issued
            # The caller's timeout as the input gave it, not as the core used it: the trace
            # check compares the two (a deadline in the wrong unit fails there).
            timeout_s = self.wake_deadline_s if event is None else getattr(event, "deadline_s", 0.0)
            self._records.append(
                StageIssued(
                    epoch,
                    command.task_id,
                    type(command).__name__,
                    before.value,
                    after.value,
                    deadline_at,
                    *_level_tags(command),
                    already,
                    event is None,
                    timeout_s,
                )
            )
        elif isinstance(event, I.Restart):
            self._records.append(StageRestarted(epoch, before.value, after.value, self.tags, self._start_deadline_at))
        elif isinstance(event, I.Start):
            self._records.append(StageStarting(epoch, self.tags, self._start_deadline_at))
        elif isinstance(event, I.Stop):
            if after is not before:
                self._records.append(StageStopped(epoch, before.value))
        elif after is not before and isinstance(event, I.Tick):
            expired_at = self._expired_at if self._expired_at is not None else now
            self._records.append(
                StageDeadline(epoch, self._expired_task, before.value, after.value, expired_at, now, failed)
            )
        elif after is not before:
            self._records.append(StageChanged(epoch, self.task_id or "", before.value, after.value, failed))
        dispatched: set[str] = set()
        for out in sends:
            command = out.command
            if isinstance(command, Execute) and command.task_id not in dispatched:
                dispatched.add(command.task_id)
                request = self.in_flight.get(command.task_id)
                deadline_at = request.deadline_at if request is not None else now
                self._records.append(StageDispatched(command.epoch, command.task_id, after.value, deadline_at))
            self._records.append(
                StageSent(
                    command.epoch, out.rank, command.task_id, type(command).__name__, after.value, *_level_tags(command)
                )
            )

    def on_start(self, event: I.Start, now: float) -> StageStep:
        self.start(now, event.deadline_s)
        self._start_pending = True
        return StageStep()

    def on_restart(self, event: I.Restart, now: float) -> StageStep:
        self.restart(now, event.deadline_s)
        self._start_pending = True
        return StageStep()

    def on_stop(self, event: I.Stop, now: float) -> StageStep:
        return self.stop(now)

    def on_sleep_call(self, event: I.SleepCall, now: float) -> StageStep:
        step = self.sleep(event.task_id, event.level, event.tags, now, event.deadline_s)
        if event.abort_in_flight and self.state is S.DRAINING:
            # The callers hear now; the ranks still run these requests, so the Sleep goes
            # out only once every rank has answered them, never over a running one.
            for request in self.in_flight.values():
                self._answer(
                    request,
                    RequestError.ABORTED,
                    f"request {request.request_id} aborted: stage "
                    f"{self.name!r} is going to sleep (abort_in_flight=True)",
                )
        return step

    def on_wake_call(self, event: I.WakeCall, now: float) -> StageStep:
        return self.wake(event.task_id, event.tags, now, event.deadline_s, wait_for_memory_s=event.wait_for_memory_s)

    def on_reload_call(self, event: I.ReloadCall, now: float) -> StageStep:
        return self.reload(event.task_id, event.source, now, event.deadline_s)

    def on_update_call(self, event: I.UpdateCall, now: float) -> StageStep:
        return self.update_weights(event.task_id, event.version, event.source, now, event.deadline_s)

    def on_weight_group_call(self, event: I.WeightGroupCall, now: float) -> StageStep:
        return self.init_weight_group(event, now)

    def on_share_call(self, event: I.ShareCall, now: float) -> StageStep:
        return self.share_weights(event.task_id, event.bucket_bytes, now, event.deadline_s)

    def on_profile_call(self, event: I.ProfileCall, now: float) -> StageStep:
        return self.profile(event.task_id, event.start, event.prefix, now, event.deadline_s)

    def on_set_admission(self, event: I.SetAdmission, now: float) -> StageStep:
        self.policy = AdmissionPolicy(event.policy)
        return StageStep()

    def on_tick_input(self, event: I.Tick, now: float) -> StageStep:
        step = self.on_tick(now)
        silent: dict[int, str] = {}
        for request in [r for r in self.in_flight.values() if now >= r.deadline_at]:
            if self._expired_at is None:
                self._expired_at, self._expired_task = request.deadline_at, request.request_id
            missing = [r for r in self.ranks if r not in request.replies]
            self._answer(
                request,
                RequestError.FAILED,
                f"request {request.request_id} to stage {self.name!r}: "
                f"ranks {missing} gave no result before its deadline; the stage fails, since a rank "
                "still running a request cannot be put to sleep safely",
            )
            for rank in missing:
                silent.setdefault(rank, f"no result for request {request.request_id} before its deadline")
        if silent:
            step = step.then(self.on_ranks_unresponsive(silent, now))
        # Every queued request at its own deadline: a short one must not wait behind a long one.
        expired = [r for r in self.queue if now >= r.deadline_at]
        for request in expired:
            self.queue.remove(request)
            self._answer(
                request,
                RequestError.REJECTED,
                f"request {request.request_id} waited in the queue of "
                f"stage {self.name!r} until its deadline; the stage stayed {self.state.value}",
            )
        return step

    def on_received(self, event: I.Received, now: float) -> StageStep:
        message = event.message
        if isinstance(message, Hello):
            return self.on_hello(message, now)
        request = self.in_flight.get(message.task_id)
        if request is not None and message.epoch == self.epoch and isinstance(message, (Result, Nack)):
            return self._on_request_reply(request, message, now)
        if isinstance(message, Result):
            self.counters.late_results += 1
            return StageStep()
        return self.on_reply(message, now)

    def on_rank_exited(self, event: I.RankExited, now: float) -> StageStep:
        return self.on_rank_died(event.rank, event.detail, now, epoch=event.epoch)

    def on_send_failed(self, event: I.SendFailed, now: float) -> StageStep:
        request = self.in_flight.get(event.task_id)
        if request is None:
            return StageStep()  # a lifecycle command: its deadline names the rank (P-9)
        # The engine, not a rank, is at fault: its queue to these ranks is full. The caller
        # hears now; ranks that got the request still answer, and it retires when they have.
        self._answer(
            request,
            RequestError.OVERLOADED,
            f"request {request.request_id} to stage {self.name!r} "
            f"could not be sent to ranks {list(event.ranks)}: the engine is overloaded (its socket "
            "queue is full); retry later or lower max_in_flight",
        )
        for rank in event.ranks:
            request.replies[rank] = None
        return self._maybe_retire(request, now)

    # ------------------------------------------------------------------ requests

    def on_submit(self, event: I.Submit, now: float) -> StageStep:
        request = _Request(event.request_id, event.payload, now + event.timeout_s)
        decision = admit(self.state, self.policy).decision
        if decision is Admit.RUN and len(self.in_flight) < self.max_in_flight and not self.queue:
            return self._dispatch(request)
        refusal = self._refusal(decision)
        if refusal:
            self._answer(request, RequestError.REJECTED, refusal)
        elif len(self.queue) >= self.queue_limit:
            self._answer(request, RequestError.REJECTED, self._queue_full())
        else:
            self.queue.append(request)
        return StageStep()

    def _refusal(self, decision: Admit) -> str:
        name, state = self.name, self.state.value
        if decision is Admit.REFUSE_FAILED:
            return f"stage {name!r} is {state}: {self.failure or 'stopped'}; restart() it first"
        if decision is Admit.REFUSE_POLICY and self.state is S.NEEDS_RELOAD:
            return (
                f"stage {name!r} is NEEDS_RELOAD (weights discarded by a level-2 sleep) and its admission "
                "policy is 'reject'; call reload_weights() first"
            )
        if decision is Admit.REFUSE_POLICY:
            return (
                f"stage {name!r} is {state}, not RUNNING, and its admission policy is 'reject'; wake it "
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
        if self._start_pending and self.state in (S.RUNNING, S.FAILED, S.STOPPED):
            self._start_pending = False
            step = StageStep(started=self.state)
        action = queue_rule(self.state, self.policy).action
        if action is QueueAction.DISPATCH:
            while self.queue and len(self.in_flight) < self.max_in_flight:
                step = step.then(self._dispatch(self.queue.popleft()))
        elif action is QueueAction.AUTO_WAKE and self.queue and self._task is None:
            task_id = f"auto-wake-{self.name}-{self.epoch}-{next(self._auto_wakes)}"
            step = step.then(self.wake(task_id, None, now, self.wake_deadline_s))
        elif action is QueueAction.REJECT_ALL:
            if self.state is S.NEEDS_RELOAD:  # the same words as a refusal at submit
                why = self._refusal(Admit.REFUSE_NEEDS_RELOAD)
            else:
                why = f"{self.failure or f'stage {self.name!r} is {self.state.value}'}; restart() the stage"
            self._fail_requests(RequestError.REJECTED, why)
        return step

    def _dispatch(self, request: _Request) -> StageStep:
        self.lifecycle.fire("execute")  # legal only in RUNNING: the table is the check
        self.in_flight[request.request_id] = request
        command = Execute(task_id=request.request_id, epoch=self.epoch, payload=request.payload)
        return StageStep(sends=tuple(Outbound(rank, command) for rank in self.ranks))

    def _on_request_reply(self, request: _Request, reply: Result | Nack, now: float) -> StageStep:
        if reply.rank not in self.ranks:
            self.counters.unknown_replies_ignored += 1
            return StageStep()
        request.replies[reply.rank] = reply
        return self._maybe_retire(request, now)

    def _maybe_retire(self, request: _Request, now: float) -> StageStep:
        """A request retires only when every rank has answered it: until then a rank may still
        be running it, and a sleep must not go out over it."""
        if len(request.replies) < len(self.ranks):
            return StageStep()
        refusals = {r: m for r, m in sorted(request.replies.items()) if isinstance(m, Nack)}
        results = [m for _, m in sorted(request.replies.items()) if isinstance(m, Result)]
        mixed = {
            r: m.weights_version
            for r, m in sorted(request.replies.items())
            if isinstance(m, Result) and m.weights_version != self.weights_version
        }
        if refusals:
            named = "; ".join(f"rank {r}: {m.reason.value} in {m.state.value}: {m.detail}" for r, m in refusals.items())
            self._answer(
                request, RequestError.FAILED, f"stage {self.name!r} refused request {request.request_id} ({named})"
            )
        elif mixed:  # P-17: never a result of weights other than the stage's committed version
            self._answer(
                request,
                RequestError.FAILED,
                f"stage {self.name!r}: ranks {sorted(mixed)} answered request "
                f"{request.request_id} with weights versions {mixed}, not the stage's version "
                f"{self.weights_version}; the result is discarded",
            )
            del self.in_flight[request.request_id]
            why = {
                r: f"answered request {request.request_id} with weights version {v}; the stage committed "
                f"version {self.weights_version}"
                for r, v in mixed.items()
            }
            return self._fail_task(why, now) if self._task else self._fail_idle(why, now)
        elif results:  # ranks of one stage compute the same result: rank 0's
            self._answer(request, None, "", output=results[0].output)
        return self._retire(request, now)

    def _retire(self, request: _Request, now: float) -> StageStep:
        del self.in_flight[request.request_id]
        if self.state is S.DRAINING and not self.in_flight and self._task is not None:
            return self._send_drained()
        return StageStep()

    def _answer(self, request: _Request, error: RequestError | None, detail: str, output: Any = None) -> None:
        if not request.answered:
            request.answered = True
            self._answers.append(RequestOutcome(request.request_id, output, error, detail))

    def _fail_requests(
        self, queued: RequestError, detail: str, *, running: RequestError | None = None, running_detail: str = ""
    ) -> None:
        """End every request: queued ones never ran (`queued`), those sent to the ranks may
        have (`running`, default the same) and say so."""
        for request in self.in_flight.values():
            self._answer(request, running or queued, running_detail or detail)
        for request in self.queue:
            self._answer(request, queued, detail)
        self.in_flight.clear()
        self.queue.clear()

    # ------------------------------------------------------------------ start / stop

    def start(self, now: float, deadline_s: float) -> None:
        """Begin waiting for every rank's Hello until `now + deadline_s`."""
        self._start_deadline_at = now + deadline_s

    def on_hello(self, hello: Hello, now: float) -> StageStep:
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
            self.weights_version = versions.pop()
            bad = {r: s for r, s in self.rank_state.items() if s is not WorkerState.ACTIVE}
            if bad:
                return self._fail_idle(
                    {r: f"started in {s.value}, not ACTIVE: {self._hello_detail.get(r, '')}" for r, s in bad.items()},
                    now,
                )
            self.lifecycle.fire("started")
        self._check_invariants()
        return StageStep()

    def restart(self, now: float, deadline_s: float) -> int:
        """New epoch, back to STARTING; the caller starts fresh rank processes. Returns the epoch."""
        if not self.lifecycle.allows("restart") or self._task is not None:  # a Profile in a settled state
            why = "it is already starting" if self.state is S.STARTING else "a task is in flight; wait for it to end"
            raise StageCommandError(f"stage {self.name!r} cannot restart in {self.state.value}: {why}")
        self.lifecycle.fire("restart")
        self.epoch += 1
        self.residency = Residency(self.tags)
        self.rank_state.clear()
        self.rank_versions.clear()
        self.failure, self.failed_ranks = "", {}
        self._fail_requests(
            RequestError.REJECTED,
            f"stage {self.name!r} restarted before this request ran",
            running=RequestError.FAILED,
            running_detail=f"stage {self.name!r} restarted while this request ran",
        )
        self.start(now, deadline_s)
        self._check_invariants()
        return self.epoch

    def stop(self, now: float) -> StageStep:
        if self.state is S.STOPPED:
            return StageStep()
        self.lifecycle.fire("stop")  # first, so the outcome names the state the task ended in
        outcome = self._end_task(False, "stage stopped before the task completed", {}, now) if self._task else None
        self._fail_requests(
            RequestError.CLOSED,
            "the engine shut down before this request ran",
            running_detail="the engine shut down while this request ran",
        )
        self._check_invariants()
        return StageStep(outcome=outcome)

    # ------------------------------------------------------------------ requests (admission)

    # For drivers that aggregate request replies themselves (the reference models, the
    # lifecycle tests): a request without payload is in flight / the oldest one retired.
    # The engine submits requests through step(Submit(...)) instead.

    def request_started(self) -> None:
        if not self.admits():
            raise StageCommandError(f"stage {self.name!r} admits no request in {self.state.value}")
        self._dispatch(_Request(f"anonymous-{next(self._anonymous)}", None, float("inf")))

    def request_finished(self, now: float) -> StageStep:
        if not self.in_flight:
            raise InvariantViolation(f"stage {self.name!r}: request finished with none in flight")
        return self._retire(next(iter(self.in_flight.values())), now)

    # ------------------------------------------------------------------ lifecycle calls

    def sleep(self, task_id: str, level: int, tags: tuple[str, ...] | None, now: float, deadline_s: float) -> StageStep:
        # The one check of a sleep level from any caller (Engine, HTTP, swap). True == 1, but is no level.
        if type(level) is not int or level not in (1, 2):
            raise StageCommandError(f"sleep level must be 1 or 2, got {level!r}")
        wanted = self._resolve(tags)
        signature = ("Sleep", level, None if tags is None else tuple(sorted(wanted)))
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("sleep")
        command = Sleep(task_id=task_id, epoch=self.epoch, level=level, tags=signature[2])
        to_sleep = wanted - self.residency.asleep
        if not to_sleep and self.lifecycle.allows("sleep_already"):
            return self._already(task_id, signature, command, "sleep_already", now)
        if not (self.lifecycle.allows("drain") or self.lifecycle.allows("sleep")):
            raise StageCommandError(f"stage {self.name!r} cannot sleep in {self.state.value}")
        plan = plan_sleep(level, to_sleep, weights_valid=self.residency.weights_valid)
        self._task = _Task(
            task_id,
            signature,
            command,
            now,
            now + deadline_s,
            expect_state=WorkerState.SLEEPING,
            expect_asleep=self.residency.asleep | to_sleep,
            commit_trigger="slept",
            expect_version=self.weights_version,
            apply=lambda res: res.apply_sleep(plan),
        )
        if self.lifecycle.allows("drain"):
            self.lifecycle.fire("drain")
            step = self._send_drained() if self.in_flight_requests == 0 else StageStep()
        else:
            self.lifecycle.fire("sleep")
            step = self._send_all()
        self._issued = (command, False, now + deadline_s)
        self._check_invariants()
        return step

    def wake(
        self,
        task_id: str,
        tags: tuple[str, ...] | None,
        now: float,
        deadline_s: float,
        *,
        wait_for_memory_s: float = 0.0,
    ) -> StageStep:
        """Wake `tags` (every tag: None). With `wait_for_memory_s` each rank may wait that long
        for free device memory another stage is releasing (a swap, P-16); it must end well
        before the deadline so that a rank's NO_MEMORY refusal arrives in time."""
        if not (0 <= wait_for_memory_s < deadline_s) or wait_for_memory_s > MAX_WAIT_FOR_MEMORY_S:
            raise StageCommandError(
                f"wait_for_memory_s must be >= 0, below the deadline ({deadline_s} s) and at most "
                f"{MAX_WAIT_FOR_MEMORY_S:.0f} s, got {wait_for_memory_s!r}; leave the ranks time to map and copy"
            )
        wanted = self._resolve(tags)
        signature = ("Wake", None if tags is None else tuple(sorted(wanted)), float(wait_for_memory_s))
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("wake")
        unable = sorted(r for r in self.ranks if Capability.SWAP not in self.rank_capabilities.get(r, ()))
        if wait_for_memory_s > 0 and unable:
            raise StageCommandError(
                f"stage {self.name!r}: ranks {unable} cannot wait for free device memory "
                "(their Hello lists no 'swap' capability); wake with wait_for_memory_s=0"
            )
        command = Wake(task_id=task_id, epoch=self.epoch, tags=signature[1], wait_for_memory_s=signature[2])
        to_wake = wanted & self.residency.asleep
        if not to_wake and self.lifecycle.allows("wake_already"):
            return self._already(task_id, signature, command, "wake_already", now)
        if not self.lifecycle.allows("wake"):
            raise StageCommandError(f"stage {self.name!r} cannot wake in {self.state.value}")
        after = Residency(self.tags)
        after.asleep, after.weights_valid = self.residency.asleep - to_wake, self.residency.weights_valid
        row = settle_row(after.settled())
        self._task = _Task(
            task_id,
            signature,
            command,
            now,
            now + deadline_s,
            expect_state=row.rank_state,
            expect_asleep=after.asleep,
            commit_trigger=row.stage_commit,
            expect_version=self.weights_version,
            apply=lambda res: res.apply_wake(to_wake),
            refused_trigger=f"wake_refused_{self.state.value.lower()}",
        )
        self.lifecycle.fire("wake")
        step = self._send_all()
        self._issued = (command, False, now + deadline_s)
        self._check_invariants()
        return step

    def reload(self, task_id: str, source: str | None, now: float, deadline_s: float) -> StageStep:
        signature = ("ReloadWeights", source)
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("reload weights")
        if not self.lifecycle.allows("reload"):
            raise StageCommandError(
                f"stage {self.name!r} cannot reload weights in {self.state.value}: reload "
                "follows a level-2 sleep and a wake of 'weights' (state NEEDS_RELOAD)"
            )
        row = settle_row(Settled.ACTIVE if not self.residency.asleep else Settled.PARTIAL)
        self._task = _Task(
            task_id,
            signature,
            ReloadWeights(task_id=task_id, epoch=self.epoch, source=source),
            now,
            now + deadline_s,
            expect_state=row.rank_state,
            expect_asleep=self.residency.asleep,
            commit_trigger=row.stage_commit,
            apply=lambda res: res.apply_reload(),
            refused_trigger="reload_refused",
            expect_version=0,
        )  # the runner's own weights: no update's version
        self.lifecycle.fire("reload")
        step = self._send_all()
        self._issued = (self._task.command, False, now + deadline_s)
        self._check_invariants()
        return step

    def update_weights(
        self, task_id: str, version: int, source: WeightSource, now: float, deadline_s: float
    ) -> StageStep:
        """Replace every rank's weights with `source` as `version` (P-17). In RUNNING the stage
        drains first (requests queue or are refused per the admission policy); it commits only
        when every rank ACKs the new version, and no request runs until then."""
        if type(version) is not int or version < 1:
            raise StageCommandError(f"weights version must be an int >= 1, got {version!r}")
        signature = ("UpdateWeights", version, source)
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("update weights")
        if version <= self.weights_version:
            raise StageCommandError(
                f"stage {self.name!r}: weights version {version} is not above the stage's "
                f"version {self.weights_version}; send a higher version"
            )
        unable = sorted(r for r in self.ranks if Capability.WEIGHT_UPDATE not in self.rank_capabilities.get(r, ()))
        if unable:
            raise StageCommandError(
                f"stage {self.name!r}: ranks {unable} take no weight updates (their Hello lists "
                "no 'weight_update' capability); use reload_weights()"
            )
        drain = self.lifecycle.allows("update_drain")
        if not (drain or self.lifecycle.allows("update")) or not self.residency.weights_resident:
            raise StageCommandError(
                f"stage {self.name!r} cannot update weights in {self.state.value}: the weights "
                "must be resident (RUNNING, PARTIAL with 'weights' awake, or NEEDS_RELOAD)"
            )
        row = settle_row(Settled.ACTIVE if not self.residency.asleep else Settled.PARTIAL)
        self._task = _Task(
            task_id,
            signature,
            UpdateWeights(task_id=task_id, epoch=self.epoch, version=version, source=source),
            now,
            now + deadline_s,
            expect_state=row.rank_state,
            expect_asleep=self.residency.asleep,
            commit_trigger=row.stage_commit,
            apply=lambda res: res.apply_reload(),
            refused_trigger=f"update_refused_{self.state.value.lower()}",
            drained_trigger="update_drained",
            expect_version=version,
        )
        if drain:
            self.lifecycle.fire("update_drain")
            step = self._send_drained() if self.in_flight_requests == 0 else StageStep()
        else:
            self.lifecycle.fire("update")
            step = self._send_all()
        self._issued = (self._task.command, False, now + deadline_s)
        self._check_invariants()
        return step

    def share_weights(self, task_id: str, bucket_bytes: int, now: float, deadline_s: float) -> StageStep:
        """Every rank shares its weights (a trainer stage, for `transfer_weights`); like a
        Profile, a task that never changes the state: requests keep running meanwhile."""
        try:
            command = msgspec.convert(
                {"type": "ShareWeights", "task_id": task_id, "epoch": self.epoch, "bucket_bytes": bucket_bytes},
                ShareWeights,
            )
        except msgspec.ValidationError as exc:
            raise StageCommandError(f"stage {self.name!r}: invalid share: {exc}") from None
        signature = ("ShareWeights", bucket_bytes)
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("share weights")
        if not self.lifecycle.allows("share") or not (self.residency.weights_resident and self.residency.weights_valid):
            raise StageCommandError(
                f"stage {self.name!r} cannot share weights in {self.state.value}: valid "
                "weights must be awake (RUNNING, or PARTIAL with 'weights' awake)"
            )
        self._task = _Task(
            task_id,
            signature,
            command,
            now,
            now + deadline_s,
            expect_asleep=self.residency.asleep,
            commit_trigger="share",
            expect_version=self.weights_version,
        )
        self.lifecycle.fire("share")
        step = self._send_all()
        self._issued = (command, False, now + deadline_s)
        self._check_invariants()
        return step

    def init_weight_group(self, call: I.WeightGroupCall, now: float) -> StageStep:
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
            )
            command = msgspec.convert(msgspec.to_builtins(command), InitWeightGroup)  # the wire's bounds
        except (TypeError, ValueError, msgspec.ValidationError) as exc:
            raise StageCommandError(f"stage {self.name!r}: invalid weight group: {exc}") from None
        if call.rank_offset + len(self.ranks) > call.world_size:
            raise StageCommandError(
                f"stage {self.name!r}: world_size {call.world_size} has no room for "
                f"{len(self.ranks)} ranks from rank_offset {call.rank_offset}"
            )
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
        retried = self._retry(call.task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("join a weight group")
        if not self.lifecycle.allows("weight_group"):
            raise StageCommandError(f"stage {self.name!r} cannot join a weight group in {self.state.value}")
        self._task = _Task(
            call.task_id,
            signature,
            command,
            now,
            now + call.deadline_s,
            expect_asleep=self.residency.asleep,
            commit_trigger="weight_group",
            expect_version=self.weights_version,
        )
        self.lifecycle.fire("weight_group")
        step = self._send_all()
        self._issued = (command, False, now + call.deadline_s)
        self._check_invariants()
        return step

    def profile(self, task_id: str, start: bool, prefix: str | None, now: float, deadline_s: float) -> StageStep:
        """Start or stop every rank's profiler. A task like the others (one in flight, its
        deadline, its outcome), but in a settled state and never changing it: requests keep
        running meanwhile, and the ranks' NACKs are the outcome's refusals, not a failure."""
        if type(start) is not bool:
            raise StageCommandError(f"profile start must be True or False, got {start!r}")
        problem = profile_prefix_problem(prefix) if start else None
        if problem is not None:
            raise StageCommandError(f"stage {self.name!r}: {problem}")
        signature = ("Profile", start, prefix)
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle("profile")
        if not self.lifecycle.allows("profile"):
            raise StageCommandError(f"stage {self.name!r} cannot profile in {self.state.value}")
        self._task = _Task(
            task_id,
            signature,
            Profile(task_id=task_id, epoch=self.epoch, start=start, prefix=prefix),
            now,
            now + deadline_s,
            expect_asleep=self.residency.asleep,
            commit_trigger="profile",
            expect_version=self.weights_version,
        )
        self.lifecycle.fire("profile")
        step = self._send_all()
        self._issued = (self._task.command, False, now + deadline_s)
        self._check_invariants()
        return step

    # ------------------------------------------------------------------ replies and time

    def on_reply(self, reply: Reply, now: float) -> StageStep:
        step = self._on_reply(reply, now)
        self._check_invariants()
        return step

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
        if (
            isinstance(reply, Nack)
            and reply.reason is _REFUSAL.get(type(task.command))
            and not (isinstance(task.command, Wake) and task.command.wait_for_memory_s <= 0)
        ):
            # NO_MEMORY refuses only a wake that may wait (P-16); to any other it is a failure.
            task.refusals[reply.rank] = reply.detail
            return self._maybe_commit(now)
        if isinstance(task.command, _STATELESS):
            return self._on_profile_reply(task, reply, now)
        if (
            isinstance(reply, Nack)
            and reply.reason is NackReason.UPDATE_FAILED
            and isinstance(task.command, UpdateWeights)
            and reply.state is WorkerState.NEEDS_RELOAD
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
        if reply.weights_version != task.expect_version:
            return self._fail_task(
                {
                    reply.rank: (
                        f"ACKed {command} at weights version {reply.weights_version}; the stage expected version "
                        f"{task.expect_version} on every rank"
                    )
                },
                now,
            )
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
        return self._maybe_commit(now)

    def _on_profile_reply(self, task: _Task, reply: Ack | Nack, now: float) -> StageStep:
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
        statuses = {ack.status for ack in task.acks.values()}
        outcome = self._end_task(not task.refusals, error, {}, now, refused=bool(task.refusals))
        if statuses == {AckStatus.ALREADY}:
            outcome = replace(outcome, status=AckStatus.ALREADY)
        outcome = replace(outcome, refusals=MappingProxyType(dict(task.refusals)))
        self.completed.put(task.task_id, (task.signature, outcome))
        return StageStep(outcome=outcome)

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
                self.rank_state[rank] = WorkerState.NEEDS_RELOAD
            self.lifecycle.fire("update_failed")
            details = "; ".join(f"rank {r}: {why}" for r, why in sorted(failed.items()))
            error = (
                f"stage {self.name!r}: every rank failed the update to weights version {task.expect_version} "
                f"({details}); the stage is NEEDS_RELOAD at version {self.weights_version}: update again "
                "or reload"
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
        self.lifecycle.fire(task.commit_trigger)
        return StageStep(outcome=self._end_task(True, "", {}, now))

    def on_tick(self, now: float) -> StageStep:
        """Enforce deadlines (P-9)."""
        step = StageStep()
        if self.state is S.STARTING and now >= self._start_deadline_at:
            self._expired_at = self._start_deadline_at
            silent = [r for r in self.ranks if r not in self.rank_state]
            step = self._fail_idle({r: "sent no Hello before the start-up deadline" for r in silent}, now)
        elif self._task is not None and now >= self._task.deadline_at:
            task = self._task
            self._expired_at, self._expired_task = task.deadline_at, task.task_id
            budget_s = task.deadline_at - task.started_at
            if self.state is S.DRAINING:
                self.lifecycle.fire("drain_timeout")
                what = "update" if isinstance(task.command, UpdateWeights) else "sleep"
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
        self._check_invariants()
        return step

    def on_ranks_unresponsive(self, failures: dict[int, str], now: float) -> StageStep:
        """Ranks that gave no result for a request within its deadline (P-9): the stage
        cannot trust them with a sleep or the next request, so it fails naming them."""
        failures = {r: why for r, why in failures.items() if r in self.ranks}
        if not failures or self.state in (S.FAILED, S.STOPPED):
            return StageStep()
        step = self._fail_task(failures, now) if self._task else self._fail_idle(failures, now)
        self._check_invariants()
        return step

    def on_rank_died(self, rank: int, detail: str, now: float, *, epoch: int | None = None) -> StageStep:
        """A rank process ended. `epoch` (the epoch it was started in) fences reports about
        processes of an earlier incarnation: those are counted and ignored (P-6)."""
        if (epoch is not None and epoch != self.epoch) or rank not in self.ranks:
            self.counters.stale_replies_ignored += 1
            return StageStep()
        if self.state in (S.FAILED, S.STOPPED):
            return StageStep()
        why = {rank: f"process died: {detail}"}
        step = self._fail_task(why, now) if self._task else self._fail_idle(why, now)
        self._check_invariants()
        return step

    # ------------------------------------------------------------------ internals

    def _resolve(self, tags: tuple[str, ...] | None) -> frozenset[str]:
        if tags is not None and not tags:
            raise StageCommandError("tags must be None (every tag) or a non-empty list")
        try:
            return resolve_tags(tags, self.tags)
        except UnknownTagError as exc:
            raise StageCommandError(f"stage {self.name!r}: {exc}") from None

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
        self.lifecycle.fire(trigger)
        outcome = TaskOutcome(
            task_id,
            type(command).__name__,
            True,
            AckStatus.ALREADY,
            self.state,
            MappingProxyType({}),
            MappingProxyType({}),
            "",
            now,
            now,
        )
        self.completed.put(task_id, (signature, outcome))
        self._issued = (command, True, now)
        return StageStep(outcome=outcome)

    def _send_drained(self) -> StageStep:
        assert self._task is not None
        self.lifecycle.fire(self._task.drained_trigger)
        return self._send_all()

    def _send_all(self) -> StageStep:
        assert self._task is not None
        self._task.sent = True
        return StageStep(sends=tuple(Outbound(rank, self._task.command) for rank in self.ranks))

    def _fail_task(self, failures: dict[int, str], now: float) -> StageStep:
        self.lifecycle.fire("fail")
        self._record_failure(failures)
        return StageStep(outcome=self._end_task(False, self.failure, failures, now))

    def _fail_idle(self, failures: dict[int, str], now: float) -> StageStep:
        self.lifecycle.fire("fail")
        self._record_failure(failures)
        self._check_invariants()
        return StageStep()

    def _record_failure(self, failures: dict[int, str]) -> None:
        self.failed_ranks = dict(failures)
        named = "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
        self.failure = f"stage {self.name!r} FAILED ({named})"
        # Their callers hear it (through step); the ranks are not trusted to answer any more.
        self._fail_requests(
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

        profiling = self._task is not None and isinstance(self._task.command, _STATELESS)
        require(
            (self._task is not None and not profiling) == (state in _IN_TASK),
            "a lifecycle task in flight iff in a task state",
        )
        require(not profiling or state in _SERVING, "a Profile task outside the settled states")
        require(len(self.queue) <= self.queue_limit, "queue over queue_limit")
        require(all(r.request_id not in self.in_flight for r in self.queue), "a request both queued and in flight")
        if self.in_flight_requests:
            require(state in (S.RUNNING, S.DRAINING), "requests in flight outside RUNNING/DRAINING")
        if state in _SERVING:
            # P-5: a settled state is committed only when every rank reported it.
            require(set(self.rank_state) == set(self.ranks), "settled without every rank known")
            mismatched = {r: s.value for r, s in self.rank_state.items() if _STAGE_STATE_OF_RANK.get(s) is not state}
            require(not mismatched, f"ranks disagree with the stage: {mismatched}")
        if state is S.RUNNING:
            require(
                not self.residency.asleep and self.residency.weights_valid,
                "RUNNING with tags asleep or weights invalid",
            )
            # P-17: requests run only while every rank holds the stage's one version.
            mixed = {r: v for r, v in self.rank_versions.items() if v != self.weights_version}
            require(not mixed, f"ranks hold weights versions {mixed}, not the stage's {self.weights_version}")
