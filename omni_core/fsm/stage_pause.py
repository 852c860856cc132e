"""The PAUSED lifecycle of a stage (vLLM's pause_generation / resume_generation).

A pause closes a RUNNING stage's admission and keeps its memory: nothing is released, no
request starts until resume(). The modes say what the requests in flight do:

  abort  their callers hear ABORTED at once; the ranks still finish them before PAUSED
         (vLLM's default); nothing is sent to the ranks
  wait   the stage drains them in DRAINING, as a sleep does: their results, then PAUSED
  keep   HoldRequests to every rank: each freezes them where they are (their KV kept, or
         dropped with clear_cache), and the stage is PAUSED once every rank holds them,
         still in flight (`StageCore.holding`); only an update runs beside them, and
         resume() releases them (HoldRequests hold=false) on the weights held then, each
         Result naming its version spans (docs/pause_modes.md). A runner that cannot freeze
         its requests finishes them first, as wait.

Requests that arrive, or wait in the queue, while PAUSED stay queued (or are refused, under
the policy 'reject') until resume(): ADMISSION and QUEUE_RULES say so for PAUSED.

The pause holds until resume() (`StageCore.paused`), as vLLM's wake does not resume generation
either: a paused stage may sleep, and a wake (asked for, or started by the admission policy
'wake' for a queued request), a reload or an update brings it back PAUSED (`woke_paused`,
`update_paused`), its queue still held. A resume() while it sleeps ends the pause there
(`resume_asleep`); the next wake serves. A restart starts a fresh stage, RUNNING.

The transitions are rows of STAGE_TRANSITIONS (pause_drain, pause_drained, pause_already,
resume, resume_already, resume_asleep); `StageCore._pause` and `StageCore._resume` (fsm/stage.py)
fire them for the inputs PauseCall and ResumeCall; a pause's drain ends in
`StageCore._send_drained`. This module holds the modes and the stand-ins the pause and the
resume put where a task's command goes.
"""

from __future__ import annotations

from dataclasses import dataclass

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
