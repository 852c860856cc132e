"""Generate `tla/VersionTable.tla` from the cores' tables (omni_core/fsm): the P-17 rows.

`tla/OmniVersions.tla` takes every worker and stage step it models (an update, its ACK,
refusal or failure; a request; a level-1 sleep and wake) from this module: the rows of
WORKER_TRANSITIONS and STAGE_TRANSITIONS for those triggers, the settle row an update and
a wake commit by, and the trigger each refusal fires. The spec ASSUMEs what it relies on of
them (requests run only in RUNNING on ACTIVE ranks, a failed update lands NEEDS_RELOAD, a
refusal returns where it came from), so TLC refuses to start when the tables drift.
`omni-core check` and tests/formal/test_generated_fresh.py fail while the committed file is
stale.

    python -m omni_core.formal.gen_versions          # rewrite the file
    python -m omni_core.formal.gen_versions --check  # exit 1 when stale
"""

from __future__ import annotations

import itertools
from typing import TypedDict

from omni_core.formal.generated import Generated
from omni_core.fsm import STAGE_TRANSITIONS, WORKER_TRANSITIONS, StageCore
from omni_core.fsm import inputs as I
from omni_core.fsm.settle import REFIT_ASLEEP, Settled, settle_row
from omni_core.fsm.worker_table import REFUSED
from omni_core.protocol import (
    Ack,
    Capability,
    DiskSource,
    Hello,
    MemoryReport,
    Nack,
    NackReason,
    Reply,
    StageState,
    UpdateWeights,
    WorkerState,
)

MODULE = "VersionTable"
REGEN_COMMAND = "python -m omni_core.formal.gen_versions"
# The triggers OmniVersions fires; every row of the tables for these is rendered.
WORKER_TRIGGERS = (
    "loaded",
    "loaded_needs_reload",
    "update",
    "update_refused_active",
    "update_refused_partial",
    "update_refused_needs_reload",
    "update_failed",
    "reloaded_active",
    "reloaded_partial",
    "execute",
    "sleep",
    "offloaded",
    "wake",
    "restored_active",
    "restored_partial",
    "restored_needs_reload",
    "update_asleep",  # a refit into the host copy (host_refit): from SLEEPING, back to SLEEPING
    "update_refused_sleeping",
    "refitted_asleep",
    "update_failed_asleep",
    "save_weights",  # SaveWeights (P-21): ACTIVE, or PARTIAL with the weights awake; the state never changes
    "shutdown",
)
STAGE_TRIGGERS = (
    "started",
    "started_needs_reload",
    "restart",
    "update_drain",
    "update_drained",
    "update",
    "update_refused_running",
    "update_refused_partial",
    "update_refused_needs_reload",
    "update_refused_paused",  # a PAUSED stage's update (OmniPause leaves updates to this model's rows)
    "update_paused",
    "update_failed",
    "woke_running",
    "woke_partial",
    "execute",
    "drain",
    "drained",
    "slept",
    "wake",
    "pause_drain",
    "pause_drained",
    "resume",
    "fail",
    "sleep",  # a PAUSED stage's sleep: nothing to drain
    "woke_paused",
    "woke_needs_reload",  # the wake after every rank failed a refit into its host copy
    "update_asleep",
    "update_refused_sleeping",
    "update_slept",
    "update_failed_asleep",
    "save_weights",  # SaveWeights (P-21): RUNNING, PAUSED, PARTIAL; the state never changes
    "stop",
)


ANSWERS = ("ack", "refused", "failed")  # what a rank answers an update: written, refused before writing, failed
# The settled states OmniVersions updates from: <<state, a pause held, the kv_cache tag asleep>>.
SETTLE_FROM = (
    ("RUNNING", False, False),
    ("PAUSED", True, False),
    ("PARTIAL", False, True),
    ("NEEDS_RELOAD", False, False),
    ("NEEDS_RELOAD", True, False),
    ("NEEDS_RELOAD", False, True),
    ("SLEEPING", False, False),  # a refit into the ranks' host copies (host_refit)
)
_MEMORY = MemoryReport(pool_bytes_before={}, pool_bytes_after={}, process_bytes_source="none: a model row")


def _ack_all(stage: StageCore, task_id: str, command: str, state: WorkerState, asleep: tuple[str, ...]) -> None:
    for rank in stage.ranks:
        ack = Ack(
            task_id=task_id,
            epoch=stage.epoch,
            rank=rank,
            command=command,
            state=state,
            asleep_tags=asleep,
            weights_version=stage.weights_version,
            memory=_MEMORY,
        )
        stage.step(I.Received(ack), 0.0)


def _stage_at(start: str, paused: bool, partial: bool) -> StageCore:
    """A StageCore of 2 ranks in `start`, reached by legal calls: the Hellos; a pause, or a
    level-1 sleep and a wake of the weights alone (PARTIAL); for NEEDS_RELOAD, then an update
    every rank failed."""
    stage = StageCore("versions", 2)
    stage.step(I.Start(10.0), 0.0)
    for rank in (0, 1):
        hello = Hello(
            task_id="hello",
            epoch=stage.epoch,
            rank=rank,
            pid=100 + rank,
            device="cpu",
            backend="portable",
            tags=stage.tags,
            capabilities=(Capability.WEIGHT_UPDATE, Capability.HOST_REFIT),
        )
        stage.step(I.Received(hello), 0.0)
    if paused:
        stage.step(I.PauseCall("pause", "wait", 10.0), 0.0)
    if partial:
        stage.step(I.SleepCall("sleep", 1, None, 10.0), 0.0)
        _ack_all(stage, "sleep", "Sleep", WorkerState.SLEEPING, tuple(sorted(stage.tags)))
        stage.step(I.WakeCall("wake", ("weights",), 10.0), 0.0)
        _ack_all(stage, "wake", "Wake", WorkerState.PARTIAL, ("kv_cache",))
    if start == "NEEDS_RELOAD":
        _update(stage, ("failed", "failed"))
    if start == "SLEEPING":
        stage.step(I.SleepCall("sleep", 1, None, 10.0), 0.0)
        _ack_all(stage, "sleep", "Sleep", WorkerState.SLEEPING, tuple(sorted(stage.tags)))
    if stage.state.value != start or stage.paused is not paused:
        raise AssertionError(f"the stage core did not reach {start} (it is {stage.state.value}, paused {stage.paused})")
    return stage


class _ReplyFields(TypedDict):
    task_id: str
    epoch: int
    rank: int
    command: str


def _reply(stage: StageCore, task_id: str, rank: int, answer: str, version: int, before: WorkerState) -> Reply:
    common: _ReplyFields = {"task_id": task_id, "epoch": stage.epoch, "rank": rank, "command": "UpdateWeights"}
    asleep = tuple(sorted(stage.residency.asleep))
    refit = before is REFIT_ASLEEP.rank_state  # written into the host copy: the rank stays asleep
    if answer == "ack":
        state = REFIT_ASLEEP.rank_state if refit else WorkerState.PARTIAL if asleep else WorkerState.ACTIVE
        return Ack(**common, state=state, asleep_tags=asleep, weights_version=version, memory=_MEMORY)
    if answer == "refused":
        return Nack(**common, reason=NackReason.INVALID_ARGUMENT, state=before, weights_version=stage.weights_version)
    failed = REFIT_ASLEEP.rank_state if refit else WorkerState.NEEDS_RELOAD
    return Nack(**common, reason=NackReason.UPDATE_FAILED, state=failed, weights_version=stage.weights_version)


def _update(stage: StageCore, answers: tuple[str, ...]) -> list[tuple[str, bool]]:
    """Update `stage` to the next version and feed rank i's answer `answers[i]`; after each
    reply, the stage's state and whether it committed the version."""
    version = stage.weights_version + 1
    before = {StageState.RUNNING: WorkerState.ACTIVE, StageState.PAUSED: WorkerState.ACTIVE}.get(stage.state)
    before = before or WorkerState(stage.state.value)
    task_id = f"update-{stage.state.value}-{version}"
    stage.step(I.UpdateCall(task_id, version, DiskSource(path="/model"), 10.0), 0.0)
    after = []
    for rank, answer in enumerate(answers):
        stage.step(I.Received(_reply(stage, task_id, rank, answer, version, before)), 0.0)
        after.append((stage.state.value, stage.weights_version == version))
    return after


SettleRow = tuple[str, bool, bool, tuple[str, str], str, bool]


def settle_rows() -> list[SettleRow]:
    """(state the update started in, a pause held, kv_cache asleep, each rank's answer or
    "none" while it has not answered, the stage core's state then, whether it committed the
    version), for every combination."""
    rows: dict[SettleRow, None] = {}  # ordered, each row once
    for (start, paused, partial), (first_answer, last_answer) in itertools.product(
        SETTLE_FROM, itertools.product(ANSWERS, repeat=2)
    ):
        answers = (first_answer, last_answer)
        (first, first_committed), (last, committed) = _update(_stage_at(start, paused, partial), answers)
        rows[(start, paused, partial, (answers[0], "none"), first, first_committed)] = None
        rows[(start, paused, partial, answers, last, committed)] = None
    return list(rows)


def _tla_bool(value: bool) -> str:
    return str(value).upper()


def _settle_row(start: str, paused: bool, partial: bool, answers: tuple[str, str], after: str, committed: bool) -> str:
    head = f'"{start}", {_tla_bool(paused)}, {_tla_bool(partial)}'
    return f'    <<{head}, <<"{answers[0]}", "{answers[1]}">>, "{after}", {_tla_bool(committed)}>>'


def _rows(table, triggers: tuple[str, ...]) -> list[str]:
    return [
        f'    <<"{src.value}", "{t.trigger}", "{(t.dest or src).value}">>'
        for t in table
        if t.trigger in triggers
        for src in t.sources
    ]


def _record(mapping: dict[str, str]) -> str:
    return "[" + ", ".join(f'{k} |-> "{v}"' for k, v in mapping.items()) + "]"


def render() -> str:
    active, partial = settle_row(Settled.ACTIVE), settle_row(Settled.PARTIAL)
    lost = settle_row(Settled.NEEDS_RELOAD)
    worker_refused = {state.value: trigger for (kind, state), trigger in REFUSED.items() if kind is UpdateWeights}
    stage_refused = {
        t.dest.value: t.trigger
        for t in STAGE_TRANSITIONS
        if t.trigger.startswith("update_refused_") and t.dest is not None
    }
    lines = [
        f"{'-' * 30} MODULE {MODULE} {'-' * 30}",
        "\\* GENERATED by omni_core.formal.gen_versions from omni_core/fsm (WORKER_TRANSITIONS, STAGE_TRANSITIONS,",
        "\\* SETTLE_ROWS, the worker's refusals): do not edit.",
        f"\\* Regenerate with: {REGEN_COMMAND}",
        "",
        "\\* <<state, trigger, next state>> of WORKER_TRANSITIONS for the triggers OmniVersions fires",
        "WorkerRows == {",
        ",\n".join(_rows(WORKER_TRANSITIONS, WORKER_TRIGGERS)),
        "}",
        "",
        "\\* <<state, trigger, next state>> of STAGE_TRANSITIONS for the triggers OmniVersions fires",
        "StageRows == {",
        ",\n".join(_rows(STAGE_TRANSITIONS, STAGE_TRIGGERS)),
        "}",
        "",
        "\\* An update (a reload's settle row) and a wake that end with every tag resident: the rank's",
        "\\* and the stage's trigger on the complete ACK set",
        f"UpdateSettle == {_record({'rank': active.after_reload or '', 'stage': active.stage_commit})}",
        f"WakeSettle == {_record({'rank': active.after_wake, 'stage': active.stage_commit})}",
        "\\* The same with tags still asleep (a wake of the weights alone; an update in PARTIAL)",
        f"PartialSettle == {_record({'rank': partial.after_reload or '', 'stage': partial.stage_commit})}",
        f"PartialWakeSettle == {_record({'rank': partial.after_wake, 'stage': partial.stage_commit})}",
        "\\* An update into the host copies of a stage asleep at level 1 (host_refit): the rank's and the",
        "\\* stage's trigger once written, and once every rank failed midway",
        "RefitSettle == "
        + _record(
            {
                "rank": REFIT_ASLEEP.after_update,
                "stage": REFIT_ASLEEP.stage_commit,
                "rankFailed": REFIT_ASLEEP.after_failure,
                "stageFailed": REFIT_ASLEEP.stage_failed,
            }
        ),
        "\\* The wake of weights that no host copy stands for (every rank failed a refit into it)",
        f"LostWakeSettle == {_record({'rank': lost.after_wake, 'stage': lost.stage_commit})}",
        "",
        "\\* The trigger a refused update fires, by the state it was refused in (the rank's; the stage's)",
        f"WorkerRefused == {_record(worker_refused)}",
        f"StageRefused == {_record(stage_refused)}",
        "",
        "\\* The stage core's answer to an update of 2 ranks: <<state it started in, a pause held, kv_cache",
        "\\* asleep, each rank's answer (\"none\": not yet), the StageCore's state then, whether it committed",
        "\\* the new version>>",
        "SettleRows == {",
        ",\n".join(_settle_row(*row) for row in settle_rows()),
        "}",
        "=" * 80,
        "",
    ]
    return "\n".join(lines)


# The renderer is looked up when called, so a patched planner or table renders anew.
_GENERATED = Generated(
    MODULE, REGEN_COMMAND, "omni_core/fsm (its transition and settle tables)", "version table", lambda: render()
)
default_path, is_fresh, stale_message, write = (
    _GENERATED.default_path,
    _GENERATED.is_fresh,
    _GENERATED.stale_message,
    _GENERATED.write,
)


def main(argv: list[str] | None = None) -> int:
    return _GENERATED.main(argv, __doc__ or "")


if __name__ == "__main__":
    raise SystemExit(main())
