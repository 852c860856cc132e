"""Agreement over replies at two ranks: StageCore against OmniAgreeRanks.tla.

TLC runs `tla/OmniAgreeRanks.tla`: a settled stage of two ranks at epoch 2 takes one
lifecycle call (a Sleep from RUNNING, a Wake from SLEEPING, a Wake that may wait for
memory) with the spec's IssueSleep/IssueWake, then every short sequence of replies, each
from one rank (a well-formed ACK, wrong asleep tags, the wrong state, another epoch, the
rank's previous reply again, its refusal), through the spec's StageReceive; after each step
it prints what the stage holds. This module drives StageCore through the same call and the
same replies, using only `StageCore.step`, and compares after each step: every difference
names the call, the sequence and the step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omni_core.formal.agree import AgreeParseError, parse_lines
from omni_core.formal.tlc import EXIT_OK, run_tlc
from omni_core.fsm import inputs as I
from omni_core.fsm.stage import StageCore
from omni_core.fsm.stage_step import StageSnapshot
from omni_core.protocol import Ack, AckStatus, Capability, MemoryReport, Nack, NackReason, StageState, WorkerState

SPEC = "OmniAgreeRanks.tla"
CONFIG = "agree_ranks.cfg"
TAG = "AGREE2"
DEFAULT_TIMEOUT_S = 300.0
STAGE_EPOCH = 2  # as StageEpoch in the spec: rank 0's other epoch is older, rank 1's newer
RANKS = 2
_TASK = "1"
KINDS = ("ok", "tags", "state", "epoch", "dup", "nack")  # as Kinds in the spec
_NONE = "-"

Call = tuple[str, bool]  # (Sleep | Wake, whether the wake may wait for memory)
Choice = tuple[int, str]  # (rank, kind of reply)
Case = tuple[Call, tuple[Choice, ...]]
# (stage state, failed ranks, task outcome, asleep tags, weights valid, ranks that ACKed,
#  ranks that refused); the last two only while the task is pending
Result = tuple[str, frozenset[int], str, frozenset[str], bool, Any, Any]


def table_from_lines(lines: list[tuple[Any, ...]]) -> dict[Case, dict[int, Result]]:
    """(call, sequence) -> {step: what the spec's stage holds after it}; step 1 is the call,
    step k + 1 the k-th reply."""
    table: dict[Case, dict[int, Result]] = {}
    for call, seq, step, result in lines:
        state, failed, outcome, asleep, valid, acks, nacks = result
        if outcome != "pending":  # the spec keeps its answer sets past the task; the code drops them
            acks = nacks = _NONE
        steps = table.setdefault((tuple(call), tuple(seq)), {})
        value = (state, failed, outcome, asleep, valid, acks, nacks)
        if steps.get(step, value) != value:
            raise AgreeParseError(f"the spec gives two results for {call} {seq} step {step}")
        steps[step] = value
    return table


def spec_table(root: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[Case, dict[int, Result]]:
    """Run TLC over OmniAgreeRanks and read what it printed."""
    result = run_tlc(root / SPEC, root / CONFIG, workers=1, timeout_s=timeout_s)
    if result.exit_code != EXIT_OK:
        raise AgreeParseError(f"TLC on {SPEC} did not finish cleanly: {result.error or result.exit_code}")
    table = table_from_lines(parse_lines(result.output, TAG))
    if not table:
        raise AgreeParseError(f"TLC on {SPEC} printed no steps; is PrintRankSteps in {CONFIG}?")
    return table


# ----------------------------------------------------------------- the code's side


def _resolve(seq: tuple[Choice, ...], i: int) -> str:
    """The kind a reply stands for: a duplicate is its rank's last reply that was not one."""
    rank, kind = seq[i]
    if kind != "dup":
        return kind
    for j in range(i - 1, -1, -1):
        if seq[j][0] == rank and seq[j][1] != "dup":
            return seq[j][1]
    raise AgreeParseError(f"a duplicate with no earlier reply of rank {rank} in {seq}")


def reply(call: Call, rank: int, kind: str, tags: tuple[str, ...]) -> Ack | Nack:
    command = call[0]
    good_state = WorkerState.SLEEPING if command == "Sleep" else WorkerState.ACTIVE
    good_asleep = tags if command == "Sleep" else ()
    if kind == "nack":
        return Nack(
            task_id=_TASK,
            epoch=STAGE_EPOCH,
            rank=rank,
            command=command,
            reason=NackReason.NO_MEMORY if command == "Wake" else NackReason.BUSY,
            detail="agreement case",
            state=WorkerState.ACTIVE if command == "Sleep" else WorkerState.SLEEPING,
        )
    state, asleep, epoch = good_state, good_asleep, STAGE_EPOCH
    if kind == "tags":
        asleep = tuple(t for t in tags if t not in good_asleep)
    elif kind == "state":
        state = WorkerState.PARTIAL if command == "Sleep" else WorkerState.SLEEPING
    elif kind == "epoch":
        epoch = STAGE_EPOCH - 1 if rank == 0 else STAGE_EPOCH + 1
    elif kind != "ok":
        raise AgreeParseError(f"unknown reply kind {kind!r}")
    memory = MemoryReport(pool_bytes_before={}, pool_bytes_after={}, process_bytes_source="none: agreement case")
    return Ack(
        task_id=_TASK,
        epoch=epoch,
        rank=rank,
        command=command,
        state=state,
        status=AckStatus.OK,
        asleep_tags=asleep,
        memory=memory,
    )


def _holds(stage: StageCore, outcome: str) -> Result:
    task = stage.task if outcome == "pending" else None
    return (
        stage.state.value,
        frozenset(stage.failed_ranks),
        outcome,
        stage.residency.asleep,
        stage.residency.weights_valid,
        frozenset(task.acks) if task is not None else _NONE,
        frozenset(task.refusals) if task is not None else _NONE,
    )


def _outcome(step: Any, before: str) -> str:
    o = step.outcome
    if o is None:
        return before
    return "ok" if o.ok else "refused" if o.refused else "failed"


def run_case(call: Call, seq: tuple[Choice, ...], factory: Callable[..., StageCore] = StageCore) -> dict[int, Result]:
    """What StageCore holds after the call (step 1) and after each reply (step k + 1)."""
    command, wait = call
    stage = factory("agree", RANKS, epoch=STAGE_EPOCH)
    settled = StageState.RUNNING if command == "Sleep" else StageState.SLEEPING
    rank_state = WorkerState.ACTIVE if command == "Sleep" else WorkerState.SLEEPING
    snapshot = StageSnapshot(
        settled,
        frozenset() if command == "Sleep" else frozenset(stage.tags),
        rank_state={r: rank_state for r in range(RANKS)},
        rank_capabilities={r: frozenset({Capability.SWAP}) for r in range(RANKS)},  # a wake may wait (P-16)
    )
    stage.restore(snapshot)
    if command == "Sleep":
        step = stage.step(I.SleepCall(_TASK, 1, None, 10.0), 0.0)
    else:
        step = stage.step(I.WakeCall(_TASK, None, 10.0, memory_wait_s=1.0 if wait else 0.0), 0.0)
    outcome = _outcome(step, "pending" if stage.task is not None else "none")
    held = {1: _holds(stage, outcome)}
    for i, (rank, _) in enumerate(seq):
        step = stage.step(I.Received(reply(call, rank, _resolve(seq, i), stage.tags)), 0.1 * (i + 1))
        outcome = _outcome(step, outcome)
        held[i + 2] = _holds(stage, outcome)
    return held


# ----------------------------------------------------------------- the comparison


@dataclass(frozen=True)
class Disagreement:
    call: Call
    seq: tuple[Choice, ...]
    step: int
    spec: Result
    code: Any

    def __str__(self) -> str:
        what = {0: "raising", 1: "the call"}.get(self.step, f"reply {self.step - 1}")
        return (
            f"{self.call[0]}{' (may wait)' if self.call[1] else ''} then replies {list(self.seq)}: after {what} "
            f"the spec holds {self.spec}, the code {self.code}"
        )


def compare(table: dict[Case, dict[int, Result]], factory: Callable[..., StageCore] = StageCore) -> list[Disagreement]:
    """Every sequence where the code and the spec differ, at its first differing step, in a
    stable order (shortest sequences first: the case to fix)."""
    out: list[Disagreement] = []
    for (call, seq), spec in sorted(table.items(), key=lambda kv: (len(kv[0][1]), repr(kv[0]))):
        if sorted(spec) != list(range(1, len(seq) + 2)):
            raise AgreeParseError(f"the spec printed steps {sorted(spec)} for {call} {seq}")
        try:
            code = run_case(call, seq, factory)
        except Exception as exc:  # an invariant the core raises is an answer too
            out.append(Disagreement(call, seq, 0, spec[1], f"{type(exc).__name__}: {exc}"))
            continue
        for step in sorted(spec):
            if code[step] != spec[step]:
                out.append(Disagreement(call, seq, step, spec[step], code[step]))
                break
    return out
