"""Where a wake or a reload ends, declared once as rows.

A rank's residency (which tags are asleep, whether the weights are valid) decides where a
wake or a reload settles; `SETTLE_ROWS` says, for each outcome, which worker trigger fires
after a wake or a reload, which state every rank must then report, and which stage trigger
commits. The worker core, the stage core and (generated into `tla/OmniTransitions.tla`)
the TLA+ spec all read these rows; none restates them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from omni_core.protocol import StageState, WorkerState


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


def settle_row(settled: Settled) -> SettleRow:
    return _BY_OUTCOME[settled]
