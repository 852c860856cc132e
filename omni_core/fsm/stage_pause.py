"""The PAUSED lifecycle of a stage (vLLM's pause_generation / resume_generation).

A pause closes a RUNNING stage's admission and keeps its memory: nothing is sent to the
ranks, nothing is released, no request starts until resume(). Requests in flight are not
frozen halfway (an Execute runs to its end on a rank: no protocol command interrupts one),
so the stage drains them first in DRAINING, as a sleep does, and commits PAUSED when none is
left. The modes say what their callers hear:

  abort  at once ABORTED (the ranks still finish them before PAUSED), vLLM's default
  wait   their results, then the pause
  keep   the same as wait here: vLLM freezes running requests and resumes them after
         /resume; a request omni-core cannot freeze finishes instead, and nothing is lost

Requests that arrive, or wait in the queue, while PAUSED stay queued (or are refused, under
the policy 'reject') until resume(): ADMISSION and QUEUE_RULES say so for PAUSED.

The pause holds until resume() (`StageCore.paused`), as vLLM's wake does not resume generation
either: a paused stage may sleep, and a wake (asked for, or started by the admission policy
'wake' for a queued request), a reload or an update brings it back PAUSED (`woke_paused`,
`update_paused`), its queue still held. A resume() while it sleeps ends the pause there
(`resume_asleep`); the next wake serves. A restart starts a fresh stage, RUNNING.

The transitions are rows of STAGE_TRANSITIONS (pause_drain, pause_drained, pause_already,
resume, resume_already, resume_asleep); this mixin is the part of StageCore that fires them, for the inputs
PauseCall and ResumeCall. A pause's drain ends in StageCalls._send_drained.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError
from omni_core.fsm.stage_step import StageCommandError, StageStep, TaskOutcome, _Task
from omni_core.protocol import AckStatus

PAUSE_MODES = ("abort", "wait", "keep")


@dataclass(frozen=True)
class Pause:
    """The pause task's stand-in for a command: it never leaves the orchestrator."""

    task_id: str
    mode: str


@dataclass(frozen=True)
class Resume:
    """The resume's stand-in for a command (outcomes name it "Resume")."""

    task_id: str


class PauseMixin:
    """Mixed into StageCore, which supplies every attribute declared here: a pause and a resume."""

    name: str
    lifecycle: Any
    in_flight: dict[str, Any]
    completed: Any
    weights_version: int
    paused: bool
    residency: Any
    _task: Any
    _retry: Callable[[str, tuple[Any, ...]], StageStep | None]
    _require_idle: Callable[[str], None]
    _answer: Callable[..., None]
    _send_drained: Callable[[float], StageStep]
    _check_invariants: Callable[[], None]

    def _pause(self, call: I.PauseCall, now: float) -> StageStep:
        """Close admission keeping the memory. Commits PAUSED once no request is in flight,
        at once when none is; a drain that outlives its deadline abandons the pause (RUNNING)."""
        task_id, mode = call.task_id, call.mode
        if mode not in PAUSE_MODES:
            raise StageCommandError(
                f"pause mode must be one of {list(PAUSE_MODES)} (abort: in-flight requests fail now; "
                f"wait, keep: they finish first), got {str(mode)[:40]!r}"
            )
        signature = ("Pause", mode)
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
        self._task = _Task(
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
        if mode == "abort":
            # The callers hear now; the ranks still run these requests, and the stage is
            # PAUSED only once every rank has answered them.
            for request in self.in_flight.values():
                self._answer(
                    request,
                    RequestError.ABORTED,
                    f"request {request.request_id} aborted: stage {self.name!r} is pausing (mode=abort)",
                )
        step = self._send_drained(now) if not self.in_flight else StageStep()
        self._check_invariants()
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
        return self._instant(task_id, signature, Resume(task_id), "resume", AckStatus.OK, now)

    def _instant(
        self,
        task_id: str,
        signature: tuple[Any, ...],
        command: Pause | Resume,
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
        self._check_invariants()
        return StageStep(outcome=outcome)
