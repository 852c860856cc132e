"""Stage lifecycle: the sans-IO core of one stage.

The stage core turns an API call (sleep, wake, reload) into one command per rank, then
aggregates the ranks' replies. It commits SLEEPING / RUNNING / PARTIAL / NEEDS_RELOAD only
on a complete set of ACKs for the current task whose reported states agree with what the
stage expects (P-5); a NACK, a dead rank or a passed deadline ends the task in FAILED with
the ranks named (P-8, P-9). Replies from an older epoch or for another task are counted and
ignored (P-6). Time comes in as an argument (`now`), never from a clock.

One door: `StageCore.step(input, now)` with an input of `omni_core.fsm.inputs`. Every input
goes through it, so the queue moves on, the trace records are written and the invariants
are checked after each. The work is split by concern: the lifecycle calls
(`stage_calls`), requests (`stage_requests`), replies and time (`stage_replies`), the trace
(`stage_trace`); the table is in `stage_table`.
"""

from __future__ import annotations

import itertools
from types import MappingProxyType
from typing import Any

from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.fsm.reply_cache import BoundedCache
from omni_core.fsm.request_queue import RequestQueue
from omni_core.fsm.stage_calls import StageCalls
from omni_core.fsm.stage_pause import PauseMixin
from omni_core.fsm.stage_replies import StageReplies
from omni_core.fsm.stage_requests import StageRequests
from omni_core.fsm.stage_step import (
    Outbound,
    StageBusyError,
    StageCommandError,
    StageCounters,
    StageStep,
    TaskOutcome,
    _Request,
    _Task,
)
from omni_core.fsm.stage_table import IN_TASK, SERVING, STAGE_STATE_OF_RANK, STAGE_TRANSITIONS, STATELESS
from omni_core.fsm.stage_trace import StageTrace
from omni_core.fsm.stage_versions import StartWeights, VersionKeeper
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import DEFAULT_TAGS, Residency
from omni_core.fsm.trace_records import RequestAnswered, StageRecord, TaskEnded, clip
from omni_core.fsm.worker_step import InvariantViolation
from omni_core.protocol import AckStatus, Capability, Command, WorkerState
from omni_core.protocol import StageState as S

__all__ = ["Outbound", "StageBusyError", "StageCommandError", "StageCore", "StageCounters", "StageStep", "TaskOutcome"]


class StageCore(StageCalls, PauseMixin, StageRequests, StageReplies, StageTrace):
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
        # Where the committed version lives durably, and what a restart's ranks start from
        # (None until the first restart: a first start takes the version the Hellos name).
        self.versions = VersionKeeper()
        self.start_weights: StartWeights | None = None
        # A pause is the caller's and holds until resume(): a sleep, a wake (asked for or the
        # admission policy's), a reload and an update of a paused stage leave it paused.
        self.paused = False
        # What each rank says it holds, for status: its pools' bytes per tag (its Hello, then
        # each ACK taken) and its runner's counters (names its Hello declared, values from any
        # reply of this epoch). Never part of a decision.
        self.rank_pool_bytes: dict[int, dict[str, int]] = {}
        self.rank_counters: dict[int, dict[str, int]] = {}
        self.policy = AdmissionPolicy(policy)
        self.queue_limit = queue_limit
        self.max_in_flight = max_in_flight
        self.wake_deadline_s = wake_deadline_s  # for the wakes the WAKE policy starts itself
        self.queue = RequestQueue()
        self.in_flight: dict[str, _Request] = {}
        self._answers: list[RequestOutcome] = []  # request outcomes of the input being stepped
        self._records: list[StageRecord] = []  # trace records of the input being stepped
        self._issued: tuple[Command, bool, float] | None = None  # a task this phase issued: command, already, deadline
        self._expired_at: float | None = None  # the deadline this phase's tick found passed
        self._expired_task = ""  # the task or request whose deadline that was ("": the start's)
        self._auto_wakes = itertools.count(1)
        self._start_pending = False
        self.counters = StageCounters()
        self.failure = ""
        self.failed_ranks: dict[int, str] = {}
        self.completed: BoundedCache[str, tuple[tuple[Any, ...], TaskOutcome]] = BoundedCache(completed_task_entries)
        self._task: _Task | None = None
        self._hello_detail: dict[int, str] = {}
        self._start_deadline_at = float("inf")

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

    def step(self, event: I.EngineInput, now: float) -> StageStep:
        """Take one engine input; return what to send and what to report. Then move the
        queue on (QUEUE_RULES) and check the invariants. Lifecycle calls that are not legal
        raise StageCommandError before anything changes."""
        self._answers, self._records, self._issued, self._expired_at = [], [], None, None
        self._expired_task = ""
        head = self._input_record(event, now)
        if head is not None:
            self._records.append(head)
        before = self.state
        step = self._take(event, now)
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
                self._start_deadline_at = now + deadline_s
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
        self._fail_requests(
            RequestError.REJECTED,
            f"stage {self.name!r} restarted before this request ran",
            running=RequestError.FAILED,
            running_detail=f"stage {self.name!r} restarted while this request ran",
        )
        self._start_deadline_at = now + deadline_s
        self._check_invariants()

    def _stop(self, now: float) -> StageStep:
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

        profiling = self._task is not None and isinstance(self._task.command, STATELESS)
        require(
            (self._task is not None and not profiling) == (state in IN_TASK),
            "a lifecycle task in flight iff in a task state",
        )
        require(not profiling or state in SERVING, "a Profile task outside the settled states")
        require(len(self.queue) <= self.queue_limit, "queue over queue_limit")
        # Queued and in flight never overlap: _dispatch checks the one request it moves, so this
        # check costs nothing per queued request (16k queued submits stay linear).
        require(not self.queue.check_invariants(), self.queue.check_invariants())
        if self.in_flight_requests:
            require(state in (S.RUNNING, S.DRAINING), "requests in flight outside RUNNING/DRAINING")
        if state in SERVING:
            # P-5: a settled state is committed only when every rank reported it.
            require(set(self.rank_state) == set(self.ranks), "settled without every rank known")
            settled = S.RUNNING if state is S.PAUSED else state  # a pause leaves the ranks ACTIVE
            mismatched = {r: s.value for r, s in self.rank_state.items() if STAGE_STATE_OF_RANK.get(s) is not settled}
            require(not mismatched, f"ranks disagree with the stage: {mismatched}")
        require(state is not S.PAUSED or self.paused, "PAUSED without a pause held")
        require(state not in (S.RUNNING, S.DRAINING) or not self.paused, f"{state.value} while a pause holds")
        if state in (S.RUNNING, S.PAUSED):  # a pause releases nothing
            require(
                not self.residency.asleep and self.residency.weights_valid,
                f"{state.value} with tags asleep or weights invalid",
            )
            # P-17: requests run only while every rank holds the stage's one version.
            mixed = {r: v for r, v in self.rank_versions.items() if v != self.weights_version}
            require(not mixed, f"ranks hold weights versions {mixed}, not the stage's {self.weights_version}")
