"""`omni-core check --trace FILE`: validate a trace of a real run against the spec.

For each stage in the file (or the one named by `--stage`), the trace is projected
(`trace_export`) onto the events `tla/trace/OmniTrace.tla` replays, written as a generated
module next to copies of the specs in a temporary folder, and model-checked by TLC: the
trace spec's steps are OmniSleep's own actions, each chosen by the event it consumes and
checked against what the line logged.

TLC 2.15 has no POSTCONDITION, so acceptance is an invariant, `TraceAccepted`, that is
violated exactly when the whole trace has been replayed with nothing left owed: TLC's exit
12 naming it means ACCEPTED. Any other end means the trace diverged; the trace spec prints
the index each explored state reached (a state constraint), and the highest one, with its
event, is reported. An invariant of the base spec broken along the replay (P-1..P-11) is
reported as that invariant, at the index of the state that breaks it.
"""

from __future__ import annotations

import argparse
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from omni_core.formal import reports, trace_export
from omni_core.formal.manifest import tla_dir
from omni_core.formal.tlc import EXIT_SAFETY, TlcNotFoundError, TlcResult, run_tlc
from omni_core.fsm.trace_records import TraceLine
from omni_core.resources import MissingDataError
from omni_core.trace import TraceFormatError

ACCEPTED = "TraceAccepted"
SPEC_INVARIANTS = (
    "TypeOK",
    "P1_OneTerminalReplyPerTask",
    "P2_NoTaskAppliedTwice",
    "P3_MessagesCarryIds",
    "P4_AlreadyIsNoOp",
    "P5_CommitOnlyOnAllAcks",
    "P5_SleepingOnlyIfEveryRankAsleep",
    "P5_RanksAgreeWithStage",
    "P6_StaleNeverChangesState",
    "P7_ExecuteOnlyWhenResident",
    "P8_NoExecuteAfterL2BeforeReload",
    "P9_FailedNamesRanks",
    "P10_BadBytesKeepServing",
    "P11_RefusalHasNoEffect",
    "WorkerCoreInvariants",
    "StageCoreInvariants",
    "WeightsTypeOK",
    "W_NoMixedVersions",
    "W_SettledOnCommitted",
    "W_NoServingOnInvalid",
    "W_NoServingBelowFloor",
)
DEFAULT_TIMEOUT_S = 120.0
OWED_AT_END = (
    "the trace ends with a step still owed (a logged state change or send; for a chunk, something still in flight)"
)
_PROGRESS = re.compile(r'^<<\s*"@trace",\s*(\d+),\s*(.*?)\s*>>$')
_TRACE_I = re.compile(r"^/\\ i = (\d+)\s*$", re.MULTILINE)


@dataclass
class TraceVerdict:
    """The result of validating one stage's events. `index` is the 1-based event index where
    the replay stopped (None when accepted); `event` that event's trace line."""

    stage: str
    events: int
    accepted: bool
    index: int | None
    event: str
    reason: str
    seconds: float
    states: int | None
    spec_view: str = ""
    result: TlcResult | None = None

    def to_json(self) -> dict:
        return {
            "stage": self.stage,
            "events": self.events,
            "accepted": self.accepted,
            "index": self.index,
            "event": self.event,
            "reason": self.reason,
            "seconds": round(self.seconds, 3),
            "states": self.states,
            "spec_view": self.spec_view,
        }

    def line(self) -> str:
        head = f"{self.stage:<16} {self.events:>5} events  "
        timing = f"  ({self.seconds:.1f} s, {self.states if self.states is not None else '-'} states)"
        if self.accepted:
            return head + "accepted" + timing
        where = f"DIVERGED at event {self.index}" if self.index is not None else "NOT ACCEPTED"
        text = head + f"{where}: {self.reason}" + timing
        if self.event:
            text += f"\n    {self.event}"
        if self.spec_view:
            text += f"\n    spec there: {self.spec_view}"
        return text


SPEC_FILES = (
    "OmniSleep.tla",
    "OmniTransitions.tla",
    "OmniMemory.tla",
    "trace/OmniWeights.tla",
    "trace/OmniTrace.tla",
)  # what a replay needs


def missing_spec_files(root: Path) -> list[Path]:
    return [root / name for name in SPEC_FILES if not (root / name).is_file()]


def _copy_specs(folder: Path, root: Path) -> Path:
    for name in SPEC_FILES:
        shutil.copy(root / name, folder / Path(name).name)
    return folder / "OmniTrace.tla"


def progress_of(output: str) -> list[tuple[int, str]]:
    """(index, spec view) of every line TraceProgress printed; TLC breaks a long value over
    indented lines, which are joined back."""
    blocks: list[str] = []
    for line in output.splitlines():
        if line.startswith("<<"):
            blocks.append(line)
        elif blocks and line[:1].isspace() and not blocks[-1].endswith(">>"):
            blocks[-1] += " " + line.strip()
    out = []
    for block in blocks:
        m = _PROGRESS.match(" ".join(block.split()))
        if m:
            out.append((int(m.group(1)), m.group(2)))
    return out


def _describe_view(view: str) -> str:
    """`"RUNNING", 0, <<"ACTIVE", ...>>, ...` printed by TraceProgress, in words."""
    return (
        "[sstate, epoch, worker states, alive, owed stage line, unlogged sends, owed worker "
        f"lines, owed worker replies] = [{view}]"
    )


def judge(trace: trace_export.StageTrace, result: TlcResult) -> TraceVerdict:
    n = len(trace.events)
    progress = progress_of(result.output)
    reached = max((i for i, _ in progress), default=1)
    view = next((v for i, v in progress if i == reached), "")

    def at(index: int) -> str:
        return trace.events[index - 1].describe() if 1 <= index <= n else ""

    if result.outcome == "invariant" and result.violated == ACCEPTED and result.exit_code == EXIT_SAFETY:
        return TraceVerdict(
            trace.name, n, True, None, "", "accepted", result.seconds, result.distinct_states, result=result
        )
    if result.outcome in ("invariant", "action_property"):
        states = _TRACE_I.findall(result.output)
        index = int(states[-1]) - 1 if states else reached  # the event whose step broke it
        return TraceVerdict(
            trace.name,
            n,
            False,
            index,
            at(index),
            f"the replay breaks {result.violated}",
            result.seconds,
            result.distinct_states,
            result=result,
        )
    if result.outcome == "ok":
        if reached > n:
            reason = OWED_AT_END
            index = n
        else:
            index = reached
            event = trace.events[index - 1]
            reason = (
                f"refuted by the records around it: {event.refuted}"
                if event.refuted
                else f"outside the model: {event.note}"
                if event.note
                else "no spec action matches this event"
            )
        return TraceVerdict(
            trace.name,
            n,
            False,
            index,
            at(index),
            reason,
            result.seconds,
            result.distinct_states,
            _describe_view(view),
            result=result,
        )
    if result.outcome == "timeout":
        done = f"replayed {min(reached, n + 1) - 1} of {n} events"
        return TraceVerdict(
            trace.name,
            n,
            False,
            None,
            "",
            f"{result.error} ({done}; a smaller --chunk-events keeps each run short)",
            result.seconds,
            None,
            result=result,
        )
    reason = result.error or f"TLC {result.outcome} (exit {result.exit_code})"
    if not progress:  # TLC stopped before the first state (a parse or configuration error)
        return TraceVerdict(trace.name, n, False, None, "", reason, result.seconds, None, result=result)
    return TraceVerdict(
        trace.name,
        n,
        False,
        reached,
        at(reached),
        reason,
        result.seconds,
        result.distinct_states,
        _describe_view(view) if view else "",
        result=result,
    )


def validate_part(
    trace: trace_export.StageTrace,
    *,
    root: Path | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    keep: Path | None = None,
) -> TraceVerdict:
    """One TLC run over one stage (or chunk); `keep` also leaves the generated files there."""
    root = root or tla_dir()
    if not trace.events:
        return TraceVerdict(trace.name, 0, False, None, "", "no events of this stage in the trace", 0.0, None)
    with tempfile.TemporaryDirectory(prefix="omni-trace-") as tmp:
        folder = Path(tmp)
        spec = _copy_specs(folder, root)
        _, config = trace_export.write(trace, folder, SPEC_INVARIANTS)
        result = run_tlc(spec, config, workers=1, timeout_s=timeout_s)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            tag = trace.stage if trace.parts == 1 else f"{trace.stage}_{trace.part}"
            for path in folder.glob("*.tla"):
                shutil.copy(path, keep / (path.name if path.name != "TraceData.tla" else f"TraceData_{tag}.tla"))
            shutil.copy(config, keep / f"OmniTrace_{tag}.cfg")
    return judge(trace, result)


CARRIED = (
    "wstate",
    "alive",
    "wasleep",
    "wvalid",
    "wepoch",
    "wprof",
    "sstate",
    "sepoch",
    "sacks",
    "sasleep",
    "svalid",
    "failedRanks",
    "wver",
    "sver",
    "sneeds",
    "sfloor",
)
_STATE_HEADER = re.compile(r"^State \d+: .*$", re.MULTILINE)


def final_state(output: str) -> dict[str, str]:
    """The variables of the last state of TLC's error trace, as TLA+ text."""
    heads = list(_STATE_HEADER.finditer(output))
    if not heads:
        return {}
    values: dict[str, str] = {}
    name = None
    for line in output[heads[-1].end() :].splitlines()[1:]:
        if line.startswith("/\\ "):
            name, _, value = line[3:].partition(" = ")
            values[name] = value.strip()
        elif not line.strip() or name is None:
            break
        else:
            values[name] += " " + line.strip()
    return values


def carried_state(output: str) -> str | None:
    """The initial state of the next chunk: where this one ended (TraceData's `Carried`)."""
    values = final_state(output)
    if any(k not in values for k in CARRIED):
        return None
    return "[" + ", ".join(f"{k} |-> {values[k]}" for k in CARRIED) + "]"


def validate_stage(
    trace: trace_export.StageTrace, *, chunk_events: int = trace_export.CHUNK_EVENTS, echo=None, **kwargs
) -> list[TraceVerdict]:
    """Validate one stage, in chunks when it is long: each chunk starts from the state the
    previous one ended in. Stops at the first chunk that diverges. A chunk that could not
    end quiescent (its cut was premature) is merged with the next one and run again.

    A line out of its process's program order (`trace.order_error`) is a divergence of its
    own: the events before it are replayed, and the first divergent line is reported, that
    one if everything before it replays."""
    if trace.order_error is not None:
        return _validate_up_to_order_error(trace, chunk_events=chunk_events, echo=echo, **kwargs)
    chunks = trace_export.split(trace, chunk_events)
    verdicts: list[TraceVerdict] = []
    carried: str | None = None
    index = 0
    while index < len(chunks):
        piece = trace_export.part(trace, chunks, index)
        piece.carried = carried
        verdict = validate_part(piece, **kwargs)
        if not verdict.accepted and piece.chunk_end and verdict.reason == OWED_AT_END and index + 1 < len(chunks):
            chunks[index : index + 2] = [chunks[index] + chunks[index + 1]]
            continue
        verdicts.append(verdict)
        if echo is not None:
            echo(verdict.line())
        if not verdict.accepted:
            break
        if piece.chunk_end:
            carried = carried_state(verdict.result.output if verdict.result else "")
            if carried is None:
                verdict.accepted, verdict.reason = False, "TLC printed no final state to carry into the next chunk"
                break
        index += 1
    return verdicts


def _validate_up_to_order_error(trace: trace_export.StageTrace, *, echo=None, **kwargs) -> list[TraceVerdict]:
    assert trace.order_error is not None
    line, why = trace.order_error
    before = [e for e in trace.events if e.line < line]
    index = len(before) + 1
    prefix = replace(trace, events=before, order_error=None)
    verdicts = validate_stage(prefix, **kwargs) if before else []
    if verdicts and not verdicts[-1].accepted and verdicts[-1].reason != OWED_AT_END:
        if echo is not None:
            echo(verdicts[-1].line())
        return verdicts  # the trace diverged before the moved line
    verdicts = [v for v in verdicts if v.accepted]
    at = next((e.describe() for e in trace.events if e.line == line), f"line {line}")
    verdict = TraceVerdict(
        trace.name,
        len(trace.events),
        False,
        index,
        at,
        f"out of program order: {why}",
        sum(v.seconds for v in verdicts),
        None,
    )
    if echo is not None:
        echo(verdict.line())
    return verdicts + [verdict]


def validate_records(records: list[TraceLine], stage: str | None = None, **kwargs) -> list[TraceVerdict]:
    stages = [stage] if stage else trace_export.stages_in(records)
    return [v for s in stages for v in validate_stage(trace_export.project(records, s), **kwargs)]


def validate_file(path: str | Path, stage: str | None = None, **kwargs) -> list[TraceVerdict]:
    return validate_records(trace_export.load(path), stage, **kwargs)


def run(args: argparse.Namespace, echo=print) -> int:
    """The `--trace` mode of `omni-core check`."""
    path = Path(args.trace)
    if not path.is_file():
        echo(f"FAIL no trace file {path}")
        return 2
    try:
        root = args.tla_dir or tla_dir()
    except MissingDataError as exc:
        echo(f"FAIL {exc}")
        return 2
    missing = missing_spec_files(root)
    if missing:
        echo(
            f"FAIL the spec a trace is replayed on is incomplete: missing {', '.join(map(str, missing))}; "
            "reinstall omni-core (its wheel carries tla/) or restore tla/ in the checkout (git checkout -- tla/)"
        )
        return 2
    try:
        records = trace_export.load(path)
    except TraceFormatError as exc:
        echo(f"FAIL {exc}")
        return 2
    stages = trace_export.stages_in(records)
    if args.stage and args.stage not in stages:
        echo(f"FAIL stage {args.stage!r} is not in {path} (stages: {', '.join(stages) or 'none'})")
        return 2
    echo(f"{path}: {len(records)} lines, stages {', '.join(stages) or 'none'}")
    keep = Path(args.keep_trace_spec) if getattr(args, "keep_trace_spec", None) else None
    verdicts: list[TraceVerdict] = []
    start = time.monotonic()
    try:
        for stage in [args.stage] if args.stage else stages:
            trace = trace_export.project(records, stage)
            found = validate_stage(
                trace, chunk_events=args.chunk_events, echo=echo, root=root, timeout_s=args.timeout_s, keep=keep
            )
            verdicts += found
            dropped = ", ".join(f"{k} {v}" for k, v in sorted(trace.dropped.items()))
            if found and not found[-1].accepted and dropped:
                echo(f"    dropped lines: {dropped}")
    except TlcNotFoundError as exc:
        echo(f"FAIL {exc}")
        return 2
    bad = [v for v in verdicts if not v.accepted]
    total_s = time.monotonic() - start
    echo(f"{len(verdicts)} TLC run(s), {len(bad)} diverged, {total_s:.1f} s")
    if getattr(args, "json", None):
        reports.write_json(
            args.json,
            {
                "trace": str(path),
                "total_s": round(total_s, 3),
                "accepted": not bad and bool(verdicts),
                "verdicts": [v.to_json() for v in verdicts],
            },
        )
    return 1 if bad or not verdicts else 0
