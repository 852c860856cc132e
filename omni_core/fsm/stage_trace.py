"""The stage core's trace records: what each input found, and what each phase of a step did
(the input's handler, then moving the queue on), in program order."""

from __future__ import annotations

from collections import deque
from typing import Any

from omni_core.fsm import admission
from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.stage_step import Outbound, _Request
from omni_core.fsm.trace_records import (
    AdmissionChanged,
    RankDied,
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
    clip,
)
from omni_core.protocol import Ack, Command, Execute, Hello, Nack, Profile, Sleep, UpdateWeights, Wake
from omni_core.protocol import StageState as S


def level_tags(command: Command) -> tuple[int, tuple[str, ...] | None]:
    """What a trace record says of a command beyond its name: a Sleep's level (for a Wake, 1
    when it waits for free memory, P-16, as the spec marks it; for a Profile, 1 for a start),
    the tags."""
    match command:
        case Sleep():
            return command.level, command.tags
        case Wake():
            return (1 if command.memory_wait_s > 0 else 0), command.tags
        case Profile(start=True):
            return 1, None  # as the spec marks a Profile start on the wire
        case _:
            return 0, None


def _version(command: Command) -> int:
    """The weights version a command sends: an UpdateWeights' (P-17), else 0."""
    return command.version if isinstance(command, UpdateWeights) else 0


def _memory_wait_s(command: Command) -> float | None:
    """How long a Wake may wait for free memory (P-16); None when it may not (left off the
    line, as off the wire)."""
    return command.memory_wait_s if isinstance(command, Wake) and command.memory_wait_s > 0 else None


class StageTrace:
    """Mixed into StageCore: the records of one step, kept in `_records` until step() returns."""

    state: S
    epoch: int
    ranks: tuple[int, ...]
    tags: tuple[str, ...]
    policy: AdmissionPolicy
    failed_ranks: dict[int, str]
    in_flight: dict[str, _Request]
    queue: deque[_Request]
    task_id: str | None
    wake_deadline_s: float
    weights_version: int
    _records: list[StageRecord]
    _issued: tuple[Command, bool, float] | None
    _expired_at: float | None
    _expired_task: str
    _start_deadline_at: float

    def _input_record(self, event: Any, now: float) -> StageRecord | None:
        """The record of an input from outside, with the state it found."""
        state = self.state.value
        match event:
            case I.Received(message=m):
                info = m.status.value if isinstance(m, Ack) else m.reason.value if isinstance(m, Nack) else ""
                worker_state = m.state.value if isinstance(m, (Ack, Nack, Hello)) else ""
                version = getattr(m, "weights_version", 0)
                return StageReceived(
                    m.epoch, m.rank, m.task_id, type(m).__name__.lower(), state, worker_state, info, version
                )
            case I.RankExited():
                fenced = event.epoch != self.epoch or event.rank not in self.ranks
                return RankDied(self.epoch, event.rank, event.epoch, state, clip(event.detail), fenced)
            case I.Submit():
                decision = admission.admit(self.state, self.policy).decision.value
                deadline_at = now + event.timeout_s
                return RequestSubmitted(event.request_id, state, decision, deadline_at, self.policy.value)
            case I.SetAdmission(policy=policy) if AdmissionPolicy(policy) is not self.policy:
                return AdmissionChanged(self.epoch, self.policy.value, AdmissionPolicy(policy).value)
            case _:
                return None

    def _record_phase(self, event: Any, before: S, sends: tuple[Outbound, ...], now: float) -> None:
        """The record of what one phase of a step did (the input's handler, or moving the
        queue on: `event` None), then one per command it sends. A change of state is the
        action that made it (issue, restart, deadline, stop) or, when it came from an input
        already recorded (a reply, a death), a StageChanged that logs it."""
        after, epoch = self.state, self.epoch
        issued, self._issued = self._issued, None
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
                    *level_tags(command),
                    already,
                    event is None,
                    timeout_s,
                    _version(command),
                    _memory_wait_s(command),
                    self.policy.value if event is None else "",
                )
            )
        else:
            changed = self._change_record(event, before, now)
            if changed is not None:
                self._records.append(changed)
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
                    command.epoch,
                    out.rank,
                    command.task_id,
                    type(command).__name__,
                    after.value,
                    *level_tags(command),
                    _version(command),
                    _memory_wait_s(command),
                )
            )

    def _change_record(self, event: Any, before: S, now: float) -> StageRecord | None:
        """The record of a phase that issued no task: a start, a restart, a stop, a deadline, or
        a change of state another input made."""
        after, epoch = self.state, self.epoch
        failed = {r: clip(why) for r, why in self.failed_ranks.items()} if after is S.FAILED else {}
        match event:
            case I.Restart():
                return StageRestarted(
                    epoch, before.value, after.value, self.tags, self._start_deadline_at, self.weights_version
                )
            case I.Start():
                return StageStarting(epoch, self.tags, self._start_deadline_at, self.policy.value)
            case I.Stop():
                return StageStopped(epoch, before.value) if after is not before else None
            case _ if after is before:
                return None
            case I.Tick():
                expired_at = self._expired_at if self._expired_at is not None else now
                return StageDeadline(epoch, self._expired_task, before.value, after.value, expired_at, now, failed)
            case _:
                return StageChanged(epoch, self.task_id or "", before.value, after.value, failed, self.weights_version)
