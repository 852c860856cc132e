"""Where a wake or a reload ends, declared once as rows.

A rank's residency (which tags are asleep, whether the weights are valid) decides where a
wake or a reload settles; `SETTLE_ROWS` says, for each outcome, which worker trigger fires
after a wake or a reload, which state every rank must then report, and which stage trigger
commits. The worker core, the stage core and (generated into `tla/OmniTransitions.tla`)
the TLA+ spec all read these rows; none restates them.

A refusal ends where the command started: `REFUSAL_REASON` says which NACK of a rank is a
refusal rather than a failure, and `refused_rows` writes the transitions that return a
worker or a stage to the state a refused command found it in, for both tables.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from omni_core.fsm.table import Transition
from omni_core.protocol import COMMAND_TYPES, Command, NackReason, StageState, WorkerState

E = TypeVar("E", bound=enum.Enum)


class Settled(str, enum.Enum):
    ACTIVE = "active"  # every tag resident, weights valid
    PARTIAL = "partial"  # some tags still asleep
    NEEDS_RELOAD = "needs_reload"  # weights mapped but discarded at level 2


@dataclass(frozen=True)
class SettleRow:
    settled: Settled
    rank_state: WorkerState  # what every rank reports in its ACK
    stage_state: StageState  # where the stage commits
    after_wake: str  # worker trigger when a Wake ends here
    after_reload: str | None  # worker trigger when a ReloadWeights ends here (None: it cannot)
    stage_commit: str  # stage trigger on the complete ACK set


SETTLE_ROWS: tuple[SettleRow, ...] = (
    SettleRow(
        Settled.ACTIVE, WorkerState.ACTIVE, StageState.RUNNING, "restored_active", "reloaded_active", "woke_running"
    ),
    SettleRow(
        Settled.PARTIAL, WorkerState.PARTIAL, StageState.PARTIAL, "restored_partial", "reloaded_partial", "woke_partial"
    ),
    SettleRow(
        Settled.NEEDS_RELOAD,
        WorkerState.NEEDS_RELOAD,
        StageState.NEEDS_RELOAD,
        "restored_needs_reload",
        None,
        "woke_needs_reload",
    ),
)

_BY_OUTCOME = {row.settled: row for row in SETTLE_ROWS}


@dataclass(frozen=True)
class RefitAsleepRow:
    """Where an update into the host copy ends (Capability.HOST_REFIT: the weights asleep at
    level 1): every rank and the stage stay asleep, at the new version once every rank wrote
    it, with the weights invalid (a wake lands NEEDS_RELOAD) once every rank failed midway."""

    rank_state: WorkerState  # what every rank reports in its ACK, and after a failure
    stage_state: StageState  # where the stage commits, and where a failure leaves it
    after_update: str  # worker trigger once the host copy holds the new version
    after_failure: str  # worker trigger when writing the host copy failed once begun
    stage_commit: str  # stage trigger on the complete ACK set
    stage_failed: str  # stage trigger when every rank failed


REFIT_ASLEEP = RefitAsleepRow(
    WorkerState.SLEEPING,
    StageState.SLEEPING,
    after_update="refitted_asleep",
    after_failure="update_failed_asleep",
    stage_commit="update_slept",
    stage_failed="update_failed_asleep",
)


def settle_row(settled: Settled) -> SettleRow:
    return _BY_OUTCOME[settled]


# The NACK that is a refusal (the rank is where it was, nothing written or kept mapped) rather
# than a failure, per command; any other command has none.
REFUSAL_REASON: Mapping[type[Command], NackReason] = MappingProxyType(
    {kind: kind.refusal_reason for kind in COMMAND_TYPES if kind.refusal_reason is not None}
)


def refused_trigger(kind: type[Command], state_before: enum.Enum) -> str:
    """The trigger that returns a refused `kind` to `state_before` (worker or stage alike)."""
    return f"{kind.refusal_verb}_refused_{state_before.value.lower()}"


def refused_rows(kind: type, source: E, dests: tuple[E, ...], why: str) -> tuple[Transition[E], ...]:
    """The rows from `source` (the command's transient state) back to each state in `dests`."""
    return tuple(Transition(refused_trigger(kind, dest), (source,), dest, why) for dest in dests)
