"""Admission: what a request does at a stage, declared once as tables.

`ADMISSION` answers "a request arrives in state S under policy P: run it, queue it, or refuse
it (and why)". `QUEUE_RULES` answers "the stage is now in state S under policy P: what happens
to the requests waiting in its queue". Both are total over (state, policy), which
`tests/test_admission.py` checks, and both are rendered into the TLA+ transition module next
to the lifecycle tables. `StageCore` consults them; no other code decides admission.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from omni_core.protocol import StageState as S


class AdmissionPolicy(str, enum.Enum):
    """What a request does when its stage is not RUNNING (P-7)."""

    QUEUE = "queue"  # wait in a bounded queue; served after the next wake
    REJECT = "reject"  # fail at once with RequestRejectedError
    WAKE = "wake"  # trigger a wake, then run


class Admit(str, enum.Enum):
    """The decision for one arriving request."""

    RUN = "run"  # dispatch now (or wait in the queue while max_in_flight requests run)
    QUEUE = "queue"  # wait in the bounded queue until the stage is RUNNING
    REFUSE_POLICY = "refuse_policy"  # the stage's policy is 'reject'
    REFUSE_NEEDS_RELOAD = "refuse_needs_reload"  # weights discarded at level 2: reload first
    REFUSE_FAILED = "refuse_failed"  # FAILED or STOPPED: restart first


class QueueAction(str, enum.Enum):
    """What the queue does in a state."""

    DISPATCH = "dispatch"  # send queued requests, up to max_in_flight
    HOLD = "hold"  # keep waiting (a task or the start is in progress)
    AUTO_WAKE = "auto_wake"  # start a wake of every tag, then dispatch
    REJECT_ALL = "reject_all"  # refuse every queued request (with the admission reason)


@dataclass(frozen=True)
class AdmissionRow:
    states: tuple[S, ...]
    policies: tuple[AdmissionPolicy, ...]
    decision: Admit
    why: str


@dataclass(frozen=True)
class QueueRow:
    states: tuple[S, ...]
    policies: tuple[AdmissionPolicy, ...]
    action: QueueAction
    why: str


_ALL = tuple(AdmissionPolicy)
_BUSY = (S.STARTING, S.DRAINING, S.TRANSITIONING, S.WAKING)  # a start or a task is in progress
_ASLEEP = (S.SLEEPING, S.PARTIAL)  # a wake makes them RUNNING
_ENDED = (S.FAILED, S.STOPPED)
Q, R, W = AdmissionPolicy.QUEUE, AdmissionPolicy.REJECT, AdmissionPolicy.WAKE

ADMISSION: tuple[AdmissionRow, ...] = (
    AdmissionRow((S.RUNNING,), _ALL, Admit.RUN, "admission is open only in RUNNING (P-7)"),
    AdmissionRow(_ENDED, _ALL, Admit.REFUSE_FAILED, "nothing runs until restart()"),
    AdmissionRow(
        _BUSY + _ASLEEP + (S.PAUSED, S.NEEDS_RELOAD),
        (R,),
        Admit.REFUSE_POLICY,
        "not RUNNING, and the policy refuses at once",
    ),
    AdmissionRow(
        (S.NEEDS_RELOAD,),
        (Q, W),
        Admit.REFUSE_NEEDS_RELOAD,
        "weights discarded by a level-2 sleep: only reload_weights() helps (P-8)",
    ),
    AdmissionRow(_BUSY + _ASLEEP, (Q,), Admit.QUEUE, "wait for the next RUNNING"),
    AdmissionRow(_BUSY + _ASLEEP, (W,), Admit.QUEUE, "wait; the queue rules wake a sleeping stage"),
    AdmissionRow((S.PAUSED,), (Q, W), Admit.QUEUE, "no request starts while PAUSED: held until resume()"),
)

QUEUE_RULES: tuple[QueueRow, ...] = (
    QueueRow((S.RUNNING,), _ALL, QueueAction.DISPATCH, "serve the queue, up to max_in_flight"),
    QueueRow(_BUSY, _ALL, QueueAction.HOLD, "a start or a lifecycle task decides what comes next"),
    QueueRow((S.PAUSED,), _ALL, QueueAction.HOLD, "held until resume(); a pause is the caller's, no policy wakes it"),
    QueueRow(_ASLEEP, (Q,), QueueAction.HOLD, "wait for a wake() from the caller"),
    QueueRow(_ASLEEP, (W,), QueueAction.AUTO_WAKE, "the policy wakes the stage for its queue"),
    QueueRow(_ASLEEP, (R,), QueueAction.HOLD, "queued before the policy changed: they keep their place"),
    QueueRow(
        (S.NEEDS_RELOAD,) + _ENDED,
        _ALL,
        QueueAction.REJECT_ALL,
        "nothing queued can run before reload_weights() or restart()",
    ),
)


def _index(rows: tuple[AdmissionRow, ...] | tuple[QueueRow, ...]) -> dict[tuple[S, AdmissionPolicy], object]:
    """(state, policy) -> its one row, built once at import: the cores consult these on every
    input. A table that is not total and disjoint fails here (tests/test_admission.py too)."""
    index: dict[tuple[S, AdmissionPolicy], object] = {}
    for state in S:
        for policy in AdmissionPolicy:
            found = [row for row in rows if state in row.states and policy in row.policies]
            if len(found) != 1:
                raise AssertionError(f"{len(found)} rows for ({state.value}, {policy.value})")
            index[state, policy] = found[0]
    return index


_ADMISSION_BY_KEY = _index(ADMISSION)
_QUEUE_RULE_BY_KEY = _index(QUEUE_RULES)


def admit(state: S, policy: AdmissionPolicy) -> AdmissionRow:
    return _ADMISSION_BY_KEY[state, policy]  # type: ignore[return-value]


def queue_rule(state: S, policy: AdmissionPolicy) -> QueueRow:
    return _QUEUE_RULE_BY_KEY[state, policy]  # type: ignore[return-value]
