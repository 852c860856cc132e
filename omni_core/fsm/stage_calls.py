"""The stage core's lifecycle calls: sleep, wake, reload, update weights, and the three tasks
that never change the state (profile, join a weight group, share weights).

Every call goes out through one template, `StageCalls._issue`, driven by its row in `CALLS`:
check the arguments, answer a retry of the same task_id from what is known, refuse while
another task is in flight, plan the task (or answer ALREADY when nothing is left to do),
then fire the row's trigger and send the command to every rank, or first drain the
requests in flight where the row drains.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import msgspec

from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.reply_cache import BoundedCache
from omni_core.fsm.settle import Settled, refused_trigger, settle_row
from omni_core.fsm.stage_pause import Pause
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
from omni_core.fsm.stage_table import CALLS, STATELESS
from omni_core.fsm.stage_versions import VersionKeeper
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.tags import Residency, UnknownTagError, plan_sleep, resolve_tags
from omni_core.protocol import (
    MAX_MEMORY_WAIT_S,
    AckStatus,
    Capability,
    Command,
    InitWeightGroup,
    Profile,
    ReloadWeights,
    ShareWeights,
    Sleep,
    UpdateWeights,
    Wake,
    WorkerState,
    arguments,
)
from omni_core.protocol import StageState as S

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


# A plan: the task to start, or the command alone when nothing is left to do (ALREADY).
Plan = Callable[[], "_Task | Command"]


class StageCalls:
    """Mixed into StageCore: each lifecycle call, planned and issued through `_issue`."""

    name: str
    ranks: tuple[int, ...]
    tags: tuple[str, ...]
    epoch: int
    state: S
    lifecycle: Lifecycle[S]
    residency: Residency
    rank_capabilities: dict[int, frozenset[Capability]]
    weights_version: int
    versions: VersionKeeper
    failure: str
    counters: StageCounters
    completed: BoundedCache[str, tuple[tuple[Any, ...], TaskOutcome]]
    in_flight_requests: int
    in_flight: dict[str, _Request]
    _task: _Task | None
    _issued: tuple[Command, bool, float] | None

    # ------------------------------------------------------------------ the template

    def _issue(
        self, kind: type, task_id: str, signature: tuple[Any, ...], now: float, deadline_s: float, plan: Plan
    ) -> StageStep:
        row = CALLS[kind]
        retried = self._retry(task_id, signature)
        if retried is not None:
            return retried
        self._require_idle(row.verb)
        planned = plan()
        if not isinstance(planned, _Task):
            return self._already(task_id, signature, planned, row.already, now)
        self._task = planned
        if row.drain and self.lifecycle.allows(row.drain):
            self.lifecycle.fire(row.drain)
            step = self._send_drained(now) if self.in_flight_requests == 0 else StageStep()
        else:
            self.lifecycle.fire(row.trigger)
            step = self._send_all()
        self._issued = (planned.command, False, now + deadline_s)
        self._check_invariants()
        return step

    def _new_task(self, call: Any, signature: tuple[Any, ...], command: Command, now: float, **fields: Any) -> _Task:
        """The task of `call`: its id, signature and command, started now, due at its deadline."""
        return _Task(call.task_id, signature, command, now, now + call.deadline_s, **fields)

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

    def _resolve(self, tags: tuple[str, ...] | None) -> frozenset[str]:
        if tags is not None and not tags:
            raise StageCommandError("tags must be None (every tag) or a non-empty list")
        try:
            return resolve_tags(tags, self.tags)
        except UnknownTagError as exc:
            raise StageCommandError(f"stage {self.name!r}: {exc}") from None

    # ------------------------------------------------------------------ the four lifecycle calls

    def _sleep(self, call: I.SleepCall, now: float) -> StageStep:
        level = call.level
        # The one check of a sleep level from any caller (Engine, HTTP, swap). True == 1, but is no level.
        if type(level) is not int or level not in (1, 2):
            raise StageCommandError(f"sleep level must be 1 or 2, got {level!r}")
        wanted = self._resolve(call.tags)
        signature = ("Sleep", level, None if call.tags is None else tuple(sorted(wanted)))

        def plan() -> _Task | Command:
            command = Sleep(task_id=call.task_id, epoch=self.epoch, level=level, tags=signature[2])
            to_sleep = wanted - self.residency.asleep
            if not to_sleep and self.lifecycle.allows("sleep_already"):
                return command
            if not (self.lifecycle.allows("drain") or self.lifecycle.allows("sleep")):
                raise StageCommandError(f"stage {self.name!r} cannot sleep in {self.state.value}")
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
                self._answer(
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

        def plan() -> _Task | Command:
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

        def plan() -> _Task:
            if not self.lifecycle.allows("reload"):
                raise StageCommandError(
                    f"stage {self.name!r} cannot reload weights in {self.state.value}: reload "
                    "follows a level-2 sleep and a wake of 'weights' (state NEEDS_RELOAD)"
                )
            if self.versions.floor:  # a reload is version 0: below the floor, a silent revert
                raise StageCommandError(
                    f"{self.versions.floor_detail(self.name)}; a reload would serve version 0, below the floor"
                )
            command = ReloadWeights(task_id=call.task_id, epoch=self.epoch, source=call.source)
            # The runner's own weights: no update's version stands for them.
            return self._weights_task(call, signature, command, now, refused="reload_refused", version=0)

        return self._issue(ReloadWeights, call.task_id, signature, now, call.deadline_s, plan)

    def _update(self, call: I.UpdateCall, now: float) -> StageStep:
        """Replace every rank's weights with `source` as `version` (P-17). In RUNNING the stage
        drains first (requests queue or are refused per the admission policy); it commits only
        when every rank ACKs the new version, and no request runs until then."""
        version = call.version
        if type(version) is not int or version < 1:
            raise StageCommandError(f"weights version must be an int >= 1, got {version!r}")
        if type(call.flush_cache) is not bool:
            raise StageCommandError(f"flush_cache must be true or false, got {call.flush_cache!r}")
        signature = ("UpdateWeights", version, call.source, call.flush_cache)

        def plan() -> _Task:
            if version <= self.weights_version:
                raise StageCommandError(
                    f"stage {self.name!r}: weights version {version} is not above the stage's "
                    f"version {self.weights_version}; send a higher version"
                )
            below = self.versions.refusal_below_floor(self.name, version)
            if below:
                raise StageCommandError(below)
            unable = sorted(r for r in self.ranks if Capability.WEIGHT_UPDATE not in self.rank_capabilities.get(r, ()))
            if unable:
                raise StageCommandError(
                    f"stage {self.name!r}: ranks {unable} take no weight updates (their Hello lists "
                    "no 'weight_update' capability); use reload_weights()"
                )
            legal = self.lifecycle.allows("update_drain") or self.lifecycle.allows("update")
            if not legal or not self.residency.weights_resident:
                raise StageCommandError(
                    f"stage {self.name!r} cannot update weights in {self.state.value}: the weights "
                    "must be resident (RUNNING, PAUSED, PARTIAL with 'weights' awake, or NEEDS_RELOAD)"
                )
            flush = call.flush_cache
            command = UpdateWeights(
                task_id=call.task_id, epoch=self.epoch, version=version, source=call.source, flush_cache=flush
            )
            refused = refused_trigger(UpdateWeights, self.state)
            return self._weights_task(call, signature, command, now, refused=refused, version=version)

        return self._issue(UpdateWeights, call.task_id, signature, now, call.deadline_s, plan)

    def _held(self, commit: str, paused: str) -> str:
        """A task's commit trigger: `paused` where it would make a paused stage RUNNING."""
        return paused if self.paused and commit == "woke_running" else commit

    def _weights_task(
        self, call: Any, signature: tuple[Any, ...], command: Command, now: float, *, refused: str, version: int
    ) -> _Task:
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

    def _stateless_task(self, call: Any, signature: tuple[Any, ...], command: Command, now: float) -> _Task:
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

        def plan() -> _Task:
            if not self.lifecycle.allows(row.trigger) or (row.legal is not None and not row.legal(self)):
                raise StageCommandError(f"stage {self.name!r} cannot {row.verb} in {self.state.value}{row.why}")
            return self._stateless_task(call, signature, command, now)

        return self._issue(type(command), call.task_id, signature, now, call.deadline_s, plan)
