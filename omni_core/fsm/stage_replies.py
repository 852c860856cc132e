"""The stage core's replies and time: each rank's Hello, its ACK or NACK to the task in
flight, the commit on a complete set (P-5), deadlines and dead ranks (P-9).

A settled state is committed only on a complete set of ACKs for the current task whose
reported states agree with what the stage expects; a NACK, a dead rank or a passed deadline
ends the task in FAILED with the ranks named. Replies from an older epoch or for another
task are counted and ignored (P-6).
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType
from typing import Any

from omni_core.fsm.settle import REFUSAL_REASON
from omni_core.fsm.stage_step import StageCounters, StageStep, _Request, _Task
from omni_core.fsm.stage_table import STATELESS
from omni_core.fsm.stage_versions import StartWeights, VersionKeeper
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import Residency
from omni_core.protocol import (
    Ack,
    AckStatus,
    Hello,
    Nack,
    NackReason,
    Reply,
    Result,
    UpdateWeights,
    Wake,
    WorkerState,
)
from omni_core.protocol import StageState as S


class StageReplies:
    """Mixed into StageCore: what the ranks say, and what the passing of time ends."""

    name: str
    ranks: tuple[int, ...]
    epoch: int
    state: S
    lifecycle: Lifecycle[S]
    residency: Residency
    rank_state: dict[int, WorkerState]
    rank_versions: dict[int, int]
    rank_pool_bytes: dict[int, dict[str, int]]
    rank_counters: dict[int, dict[str, int]]
    rank_capabilities: dict[int, Any]
    weights_version: int
    versions: VersionKeeper
    start_weights: StartWeights | None
    counters: StageCounters
    in_flight: dict[str, _Request]
    in_flight_requests: int
    _task: _Task | None
    _hello_detail: dict[int, str]
    _start_deadline_at: float
    _expired_at: float | None
    _expired_task: str

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
        self._check_invariants()
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
        self._check_invariants()
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
        self._check_invariants()
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
        self.versions.committed(task.command, task.expect_version)
        self.lifecycle.fire(task.commit_trigger)
        return StageStep(outcome=self._end_task(True, "", {}, now))

    def _tick(self, now: float) -> StageStep:
        """Enforce the deadlines of the start and of the task in flight (P-9)."""
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
        self._check_invariants()
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
        self._check_invariants()
        return step
