"""The stage's transition table: its states, triggers and rows as data.

`STAGE_TRANSITIONS` is the one source the stage core, the docs and the generated TLA+ read;
`STAGE_STATE_OF_RANK` is the stage state a settled rank's state stands for.
"""

from __future__ import annotations

from omni_core.fsm.settle import refused_rows
from omni_core.fsm.table import Transition
from omni_core.protocol import StageState as S
from omni_core.protocol import UpdateWeights, Wake, WorkerState

SERVING = (S.RUNNING, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)  # settled, no task in flight
IN_TASK = (S.DRAINING, S.TRANSITIONING, S.WAKING)

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
    Transition("wake_already", SERVING, None, "every requested tag resident: ALREADY (P-4)"),
    Transition("reload", (S.NEEDS_RELOAD,), S.WAKING, "ReloadWeights sent to every rank"),
    Transition(
        "reload_refused",
        (S.WAKING,),
        S.NEEDS_RELOAD,
        "every rank refused the source (INVALID_ARGUMENT): nothing was written",
    ),
    *refused_rows(
        Wake,
        S.WAKING,
        (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD),
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
    *refused_rows(
        UpdateWeights,
        S.WAKING,
        (S.RUNNING, S.PARTIAL, S.NEEDS_RELOAD),
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
        SERVING,
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
        "profile", SERVING, None, "Profile sent to every rank; the state never changes, whatever they answer (P-15)"
    ),
    Transition("fail", (S.STARTING,) + SERVING + IN_TASK, S.FAILED, "NACK, deadline, or a rank died (P-8, P-9)"),
    Transition("restart", SERVING + (S.FAILED, S.STOPPED), S.STARTING, "fresh rank processes under a new epoch"),
    Transition("stop", (S.STARTING, S.FAILED) + SERVING + IN_TASK, S.STOPPED, "shutdown"),
)

STAGE_STATE_OF_RANK = {
    WorkerState.ACTIVE: S.RUNNING,
    WorkerState.SLEEPING: S.SLEEPING,
    WorkerState.PARTIAL: S.PARTIAL,
    WorkerState.NEEDS_RELOAD: S.NEEDS_RELOAD,
}
