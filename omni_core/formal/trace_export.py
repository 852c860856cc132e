"""Project a trace of typed records (omni_core/fsm/trace_records.py) onto the events
tla/trace/OmniTrace.tla replays, one stage at a time, and write them as a TLA+ module
(`TraceData`) and a TLC configuration.

Each record kind is one event kind, and each event kind one action of the trace spec
(`RECORD_EVENTS`; no line is reinterpreted from its neighbours): StageIssued -> issue
(IssueSleep/IssueWake/IssueReload), StageDispatched -> dispatch (IssueExecute), StageSent
-> send, StageReceived -> recv (StageReceive), StageChanged -> state, StageDeadline ->
deadline (Deadline), StageRestarted -> restart (Restart), RankDied -> died (Crash, then
RankDied); WorkerStarted -> start (Loaded/LoadedNeedsReload/LoadFailed), WorkerReceived -> wrecv
(WorkerReceive), EffectDone/EffectFailed/EffectRefused -> done/error/refused
(Done/EffectError/Refused), WorkerChanged -> wstate, ReplySent -> wsend, TaskEnded ->
ended and RequestAnswered -> answered (what a caller heard, tied to the outcome the ranks'
answers gave). The send, state, wstate, wsend, ended and answered events are checks of what
the steps before them did.

Dropped (counted by kind): the kinds the spec does not model (StageStarting, requests'
submissions, spawns, link plans, refused peers, a worker's BadMessage with its NACK, ParentGone); a
RankDied of another epoch (the core ignored it); the lines of a process a restart replaced,
until its death is recorded; after the stage's StageStopped (the engine's shutdown ends the
trace, and only it sends Shutdown), the ranks' last replies it drains, deaths, callers told
of failures and the ranks' Shutdown: any other line after a stop is refuted. No
line is dropped for what it names: Profile tasks are replayed (IssueProfile) and a rank's
Status is checked to change nothing (P-7), so relabelling a line hides nothing.

Refuted (kind "refuted", which no action takes, with the reason): a line of a process
after its death was recorded; a deadline that no earlier line of its task set, that is not
the deadline that line set, that fired before it, or whose issue's deadline is not the
issue's time plus the timeout the call asked for (`trace_order.DeadlineClock`); a line
the admission tables, the answers, the epoch fence or a wake's wait refute, and a run that
ended owing an answer (`trace_admission.RecordChecks`: a last refuted event); a link plan
that breaks P-18's rules (`trace_links.LinkChecks`).

P-17's weight commands (UpdateWeights, InitWeightGroup, ShareWeights) and P-19's
ResetPrefixCache (and P-21's SaveWeights) replay on the actions of tla/trace/OmniWeights.tla, and every event
carries the weights version its record names (`v`): an UpdateWeights' issue and send
(the send also as its level, which is how the spec's wire carries it), each reply
(ReplySent, StageReceived) and the committed version after each StageChanged.

Outside the model (kept, with a note the verdict names): a rank that starts in a state
other than ACTIVE or FAILED.

Task ids become 1, 2, ... in the order the engine first names them (the spec's task
counter); "hello" is task 0. The TLC configuration gets the traced stage's tags
(StageStarting.tags) as the spec's `Tags`, so a stage with tags of its own is checked with
them.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from omni_core.formal.trace_admission import RecordChecks
from omni_core.formal.trace_links import LinkChecks
from omni_core.formal.trace_order import DeadlineClock, program_order
from omni_core.fsm import trace_records as T
from omni_core.fsm.tags import DEFAULT_TAGS
from omni_core.trace import read_trace

UNKNOWN = "?"
HELLO_TASK = "hello"
MODULE = "TraceData"
REFUTED = "refuted"  # an event kind no action of the trace spec takes
RECORD_EVENTS: dict[type, str] = {
    T.StageIssued: "issue",
    T.StageDispatched: "dispatch",
    T.StageSent: "send",
    T.StageReceived: "recv",
    T.StageChanged: "state",
    T.StageDeadline: "deadline",
    T.StageRestarted: "restart",
    T.RankDied: "died",
    T.WorkerStarted: "start",
    T.WorkerReceived: "wrecv",
    T.EffectDone: "done",
    T.EffectFailed: "error",
    T.EffectRefused: "refused",
    T.WorkerChanged: "wstate",
    T.ReplySent: "wsend",
    T.TaskEnded: "ended",
    T.RequestAnswered: "answered",
}


@dataclass
class TraceEvent:
    """One projected event. `line` is its 1-based line in the trace file; the other fields
    are what OmniTrace.tla compares (UNKNOWN / 0 / None where the record says nothing)."""

    kind: str
    line: int
    record: T.TraceLine = field(repr=False)
    rank: int = -1
    task: int = 0
    epoch: int = 0
    cmd: str = UNKNOWN
    state: str = UNKNOWN
    before: str = UNKNOWN
    wstate: str = UNKNOWN
    info: str = UNKNOWN
    level: int = 0
    tags: tuple[str, ...] | None = None  # None: unknown; ("all",): tags=None on the wire
    process_epoch: int = 0  # the epoch of the process that wrote the line (a worker's: its own)
    late_us: int = 0  # a deadline: how far past it the record's clock was (negative: early)
    failed: tuple[int, ...] | None = None  # a deadline into FAILED: the ranks it names
    version: int = 0  # the weights version the record names (P-17; see _event)
    note: str = ""  # why this line is outside what the spec models, if it is
    refuted: str = ""  # why the records around this line show it is no behaviour (kind REFUTED)

    def tla(self) -> str:
        tags = "{" + ", ".join(_str(t) for t in (self.tags if self.tags is not None else (UNKNOWN,))) + "}"
        return (
            f"[k |-> {_str(self.kind)}, r |-> {self.rank}, t |-> {self.task}, e |-> {self.epoch}, "
            f"c |-> {_str(self.cmd)}, s |-> {_str(self.state)}, b |-> {_str(self.before)}, "
            f"w |-> {_str(self.wstate)}, x |-> {_str(self.info)}, lvl |-> {self.level}, "
            f"tg |-> {tags}, pe |-> {self.process_epoch}, late |-> {self.late_us}, "
            f"fr |-> {{{', '.join(str(r) for r in (self.failed or ()))}}}, v |-> {self.version}]"
        )

    def describe(self) -> str:
        """The trace line, for reports: `line 37: talker/engine StageReceived rank=1 task_id=... ...`."""
        line = self.record
        who = "engine" if line.is_engine else f"rank{line.rank}"
        fields = msgspec.structs.asdict(line.record)
        parts = [f"{k}={v}" for k, v in fields.items() if v not in (None, "", {}, ())]
        return f"line {self.line}: {line.stage}/{who} {line.kind} " + " ".join(parts)


@dataclass
class StageTrace:
    """The events of one stage, and the constants the TLC configuration needs."""

    stage: str
    events: list[TraceEvent]
    ranks: int
    tasks: dict[str, int]
    max_epoch: int
    faults: list[str]
    max_faults: int
    dropped: Counter = field(default_factory=Counter)
    max_requests: int = 1  # the most requests in flight at once (MaxRequests)
    part: int = 1  # chunk number (split), 1-based
    parts: int = 1
    carried: str | None = None  # a later chunk's initial state: TLA+ record text (trace_check)
    chunk_end: bool = False  # a chunk that is not the last: it must end quiescent
    tags: tuple[str, ...] = DEFAULT_TAGS  # the stage's tags: the spec's Tags
    order_error: tuple[int, str] | None = None  # (line, why): the first line out of program order

    @property
    def name(self) -> str:
        return self.stage if self.parts == 1 else f"{self.stage} [{self.part}/{self.parts}]"

    @property
    def rank_set(self) -> str:
        return "{" + ", ".join(str(r) for r in range(self.ranks)) + "}"


def _str(value: Any) -> str:
    return json.dumps(str(value))  # a TLA+ string literal: double quotes, backslash escapes


def stages_in(lines: Iterable[T.TraceLine]) -> list[str]:
    """Stage names in order of first appearance."""
    return list(dict.fromkeys(line.stage for line in lines if line.stage))


def _lines(lines: list[T.TraceLine], stage: str) -> list[tuple[int, T.TraceLine]]:
    """(line number, line) of this stage, its StageStopped included."""
    return [(n, line) for n, line in enumerate(lines, start=1) if line.stage == stage]


def _after_stop(line: T.TraceLine, shutdowns: set[str]) -> bool:
    """May `line` follow the stage's StageStopped? Only its ranks' last replies as the engine
    drains them, a death, a caller told of a failure, a swap's devices freed, and the ranks
    finishing what they were sent (`shutdowns`: the task ids sent before the stop, and the
    Shutdown's, named by the WorkerReceived lines that take them)."""
    r: Any = line.record
    if line.is_engine:
        if isinstance(r, T.TaskEnded):
            return not r.ok
        if isinstance(r, T.RequestAnswered):
            return bool(r.error)
        return isinstance(r, (T.StageReceived, T.RankDied, T.IncomingFreed))
    if isinstance(r, T.WorkerReceived) and r.command == "Shutdown":
        shutdowns.add(r.task_id)
    return getattr(r, "task_id", None) in shutdowns


def _command_of(record: Any) -> str:
    return getattr(record, "command", "")


def project(lines: list[T.TraceLine], stage: str) -> StageTrace:
    ours = _lines(lines, stage)
    dropped: Counter = Counter()
    tasks: dict[str, int] = {}
    events: list[TraceEvent] = []
    ranks = max(
        [line.rank + 1 for _, line in ours]
        + [line.record.rank + 1 for _, line in ours if isinstance(line.record, (T.StageSent, T.StageReceived))]
        + [1]
    )
    starts = (T.StageStarting, T.StageRestarted, T.WorkerStarted)  # they name the stage's tags
    tags = next((tuple(line.record.tags) for _, line in ours if isinstance(line.record, starts)), DEFAULT_TAGS)
    epoch_now = 0  # the stage's epoch so far, in file order
    superseded: set[tuple[int, int, str]] = set()  # (rank, epoch, task) of replies dropped below
    deaths: dict[tuple[int, int], int] = {}  # (rank, process epoch) -> the line recording its death
    clock = DeadlineClock(lines)
    checks = RecordChecks(lines, stage, ranks)
    links = LinkChecks(lines, stage)
    stopped = 0  # the line of the stage's StageStopped: the engine's shutdown ends its trace
    shutdowns: set[str] = set()
    for n, line in ours:
        record = line.record
        kind = RECORD_EVENTS.get(type(record))
        if isinstance(record, T.StageStopped) and not stopped:
            stopped = n
            continue
        why = checks.why(n) or links.why(n)  # admission, answers, fencing, waits; link plans
        if why:
            events.append(_refuted(kind or line.kind, n, line, tasks, why))
            continue
        if isinstance(record, T.StageSent) and not stopped:
            shutdowns.add(record.task_id)  # a rank may still finish it after the stop
        if stopped:
            if _after_stop(line, shutdowns):
                dropped["after StageStopped"] += 1
            else:  # what a stopped stage cannot have written: kept, so the replay stops here
                why = f"{line.kind} written for the stage after its StageStopped (line {stopped})"
                events.append(_refuted(kind or line.kind, n, line, tasks, why))
            continue
        if isinstance(record, T.StageRestarted):
            epoch_now = record.epoch
        if not line.is_engine and (line.rank, line.epoch) in deaths:
            # A process writes nothing after it ended, and its end is recorded only after it
            # ended: this line is not the dead process's. Kept, so the replay stops here.
            why = f"rank {line.rank} of epoch {line.epoch} wrote this after its death was recorded"
            events.append(_refuted(kind or "dead", n, line, tasks, f"{why} (line {deaths[line.rank, line.epoch]})"))
            continue
        if isinstance(record, T.RankDied):
            deaths.setdefault((record.rank, record.process_epoch), n)
        if not line.is_engine and line.epoch < epoch_now:
            # A process a restart replaced, still writing until its kill lands: the spec's
            # Restart replaced it already, and the epoch fences whatever it sends.
            dropped["superseded by a restart"] += 1
            if isinstance(record, T.ReplySent):
                superseded.add((line.rank, record.epoch, record.task_id))
            continue
        if isinstance(record, T.StageReceived) and (record.rank, record.epoch, record.task_id) in superseded:
            dropped["superseded by a restart"] += 1  # a reply whose sending was dropped above
            continue
        if kind is None or getattr(record, "fenced", False) or getattr(record, "to_bad_bytes", False):
            dropped[line.kind] += 1
            continue
        event = _event(kind, n, line, tasks)
        if isinstance(record, (T.StageIssued, T.StageDispatched, T.StageStarting, T.StageRestarted)):
            clock.set_by(n, line)
        elif isinstance(record, T.StageDeadline):
            why = clock.check(n, line)
            if why:
                event = _refuted(kind, n, line, tasks, why)
        events.append(event)
    events += _owed(checks, lines, tasks)
    _note_unmodelled(events)
    trace = _finish(stage, events, ranks, tasks, dropped)
    trace.tags = tags
    trace.order_error = program_order(lines, {n for n, _ in ours})
    return trace


def _owed(checks: RecordChecks, lines: list[T.TraceLine], tasks: dict[str, int]) -> list[TraceEvent]:
    """Liveness at the end of a run that ended: an event after the stage's last line, which
    the replay reaches once everything before it replayed, refuted with what is owed."""
    if not checks.owed():
        return []
    last = checks.last_line
    return [_refuted("owed", last, lines[last - 1], tasks, checks.owed())]


def _refuted(kind: str, n: int, line: T.TraceLine, tasks: dict[str, int], why: str) -> TraceEvent:
    """An event that the records around it already show is no behaviour: no action takes it."""
    event = _event(kind, n, line, tasks) if kind in RECORD_EVENTS.values() else TraceEvent(kind, n, line)
    event.kind, event.refuted = REFUTED, why
    return event


def _event(kind: str, n: int, line: T.TraceLine, tasks: dict[str, int]) -> TraceEvent:
    """The event of one record: the fields its action compares, taken as they are."""
    r: Any = line.record
    ev = TraceEvent(
        kind,
        n,
        line,
        rank=getattr(r, "rank", line.rank),
        epoch=getattr(r, "epoch", line.epoch),
        process_epoch=line.epoch,
    )
    task_id = getattr(r, "task_id", "") or getattr(r, "request_id", "")
    ev.task = _task_number(task_id, tasks, assign=kind in ("issue", "dispatch", "send"))
    if line.is_engine:
        ev.state = getattr(r, "after", "") or getattr(r, "state", UNKNOWN)
        ev.before = getattr(r, "before", UNKNOWN)
        if kind in ("issue", "send"):
            ev.cmd, ev.level, ev.tags = r.command, r.level, _wire_tags(r.command, r.tags)
            ev.version = r.version
            if kind == "send" and r.command == "UpdateWeights":
                ev.level = r.version  # the spec's wire carries an update's version as its level
        elif kind == "recv":
            ev.cmd, ev.wstate, ev.info = r.reply, r.worker_state or UNKNOWN, r.info or UNKNOWN
            ev.version = r.weights_version
        elif kind in ("state", "restart"):  # a restart: the version its fresh ranks start at
            ev.version = r.weights_version
            if kind == "restart":  # and what it planned: NEEDS_RELOAD (info) under a floor (level)
                ev.level, ev.info = r.version_floor, "needs_reload" if r.needs_reload else UNKNOWN
        elif kind == "ended":
            ev.cmd, ev.info = r.command, "ok" if r.ok else "failed"
        elif kind == "answered":
            ev.info = r.error or "ok"
        elif kind == "deadline":
            ev.late_us = late_us(min(r.now_s, line.mono_s), r.deadline_at_s)
            ev.failed = tuple(sorted(int(k) for k in r.failed_ranks))
    else:
        ev.rank = line.rank
        ev.wstate = getattr(r, "after", "") or getattr(r, "state", UNKNOWN)
        ev.before = getattr(r, "before", UNKNOWN)
        ev.cmd = getattr(r, "reply", None) or _command_of(r) or UNKNOWN
        if kind == "wsend":
            ev.info, ev.version = r.info or UNKNOWN, r.weights_version
        elif kind == "done":  # a reload: the version its source holds (a save's, P-21)
            ev.version = r.weights_version
    return ev


LATE_LIMIT_US = 10**9  # TLC's integers are 32-bit: lateness is clipped to +-1000 s, its sign kept


def late_us(now_s: float, deadline_at_s: float) -> int:
    """Microseconds from the deadline to `now_s` (negative: before it), clipped. Floors
    both, so a record at its deadline is never judged early."""
    late = int(now_s * 1e6 // 1) - int(deadline_at_s * 1e6 // 1)
    return max(-LATE_LIMIT_US, min(LATE_LIMIT_US, late))


def _finish(
    stage: str, events: list[TraceEvent], ranks: int, tasks: dict[str, int], dropped: Counter, min_epoch: int = 0
) -> StageTrace:
    """The constants of the TLC model for these events."""
    died = sum(1 for e in events if e.kind == "died")
    errors = sum(1 for e in events if e.kind == "error" or (e.kind == "start" and e.wstate == "FAILED"))
    # A command sent again under the same task id (a retry) is replayed as a network
    # duplicate: one "dup" for the rank's receipt and one for each reply taken twice.
    resent = _repeats(e for e in events if e.kind == "send")
    taken_twice = _repeats(e for e in events if e.kind == "recv" and e.task > 0)
    faults = []
    if died:
        faults.append("crash")
    if errors:
        faults.append("error")
    if resent:
        faults.append("dup")
    if any(e.kind == "deadline" for e in events):
        faults.append("timeout")  # a deadline passed: the spec lets one pass while a reply is on its way
    if any(e.kind == "restart" and e.before != "FAILED" for e in events):
        faults.append("kill")  # a restart of a stage that still served: its live ranks were killed
    refused = {e.cmd for e in events if e.kind == "refused"}
    if "ReloadWeights" in refused:
        faults.append("badsource")  # a reload source the runner refused
    if "Wake" in refused or any(e.kind in ("issue", "send") and e.cmd == "Wake" and e.level == 1 for e in events):
        # A wake that waits for free memory (P-16: level 1 on the wire, Engine.swap's), refused
        # NO_MEMORY or not: the spec sends a waiting Wake only where it may also be refused.
        faults.append("nomemory")
    max_epoch = max([e.epoch for e in events] + [min_epoch])
    return StageTrace(
        stage,
        events,
        ranks,
        tasks,
        max_epoch,
        faults,
        died + errors + resent + taken_twice,
        dropped,
        max_requests=max_in_flight(events, ranks),
    )


def max_in_flight(events: Iterable[TraceEvent], ranks: int) -> int:
    """The most requests in flight at once, as the spec counts them: from a request's
    dispatch until the engine has taken a Result or Nack of it from every rank, or the
    stage failed or restarted (at least 1)."""
    in_flight: dict[int, set[int]] = {}  # request task -> ranks whose answer the engine took
    most = 1
    for ev in events:
        if ev.kind == "dispatch" and ev.task not in in_flight:
            in_flight[ev.task] = set()
            most = max(most, len(in_flight))
        elif ev.kind == "recv" and ev.task in in_flight and ev.cmd in ("result", "nack"):
            in_flight[ev.task].add(ev.rank)
            if len(in_flight[ev.task]) >= ranks:
                del in_flight[ev.task]
        elif (ev.kind in ("state", "deadline") and ev.state == "FAILED") or ev.kind == "restart":
            in_flight.clear()
    return most


def _repeats(events: Iterable[TraceEvent]) -> int:
    seen: Counter = Counter((e.task, e.rank, e.cmd) for e in events)
    return sum(n - 1 for n in seen.values())


# A rank loads (Loaded), loads weights not to be served (LoadedNeedsReload), or fails to (LoadFailed).
STARTED = ("ACTIVE", "NEEDS_RELOAD", "FAILED", UNKNOWN)


def _note_unmodelled(events: list[TraceEvent]) -> None:
    """Mark lines that fall outside the trace spec's abstractions, so that a divergence there
    is reported as such and not as a protocol error."""
    for ev in events:
        if ev.kind == "start" and ev.wstate not in STARTED:
            ev.note = (
                f"rank {ev.rank} started in {ev.wstate}; the spec's ranks start ACTIVE (Loaded) or FAILED (LoadFailed)"
            )
        # A pause's drain that outlives its deadline is not replayed (OmniTrace's EnginePause).
        elif ev.kind == "deadline" and ev.state == "RUNNING" and ev.before == "DRAINING" and ev.task == 0:
            ev.note = "a pause's drain that ran out of time: model-checked in tla/OmniPause.tla, not replayed"


CHUNK_EVENTS = 400
SETTLED = ("RUNNING", "SLEEPING", "PARTIAL", "NEEDS_RELOAD")
ENGINE_KINDS = ("issue", "dispatch", "send", "recv", "state", "deadline", "restart", "died", "ended", "answered")


def _is_commit(ev: TraceEvent) -> bool:
    return ev.kind == "state" and ev.state in SETTLED and ev.before in ("TRANSITIONING", "WAKING", "STARTING")


def _cut_here(current: list[TraceEvent], rest: list[TraceEvent], k: int, ranks: int) -> list[int] | None:
    """Can a chunk end with `current` (which ends with a commit line)? Only when nothing of
    the current epoch is in flight: every command sent was received and answered, none was
    sent twice. Returns the indices in `rest` (from k) of the chunk's own trailing worker
    lines (a worker logs "state" and "send:" after the fact, so they can follow the
    engine's commit in the file), or None when the chunk cannot end here."""
    epoch = current[-1].epoch
    sends = [(e.task, e.rank) for e in current if e.kind == "send" and e.epoch == epoch]
    recvs = [(e.task, e.rank) for e in current if e.kind == "recv" and e.task > 0]
    received = {(e.task, e.rank) for e in current if e.kind == "wrecv"}
    if len(sends) != len(set(sends)) or len(recvs) != len(set(recvs)):
        return None  # a re-sent command or a reply taken twice: a copy may still be in flight
    if any(key not in received or key not in recvs for key in sends):
        return None
    tasks = {e.task for e in current if e.task > 0}
    hellos = {(e.rank, e.epoch) for e in current if e.kind == "start"}
    moved: list[int] = []
    moved_on: set[int] = set()  # ranks whose next line is about later work
    for j in range(k, len(rest)):
        e = rest[j]
        if e.kind in ENGINE_KINDS or e.rank in moved_on:
            continue
        if e.task in tasks or (e.kind == "wsend" and e.task == 0 and (e.rank, e.epoch) in hellos):
            if e.kind not in ("wsend", "wstate"):
                return None  # the rank still works on this chunk's task
            moved.append(j)
        else:
            moved_on.add(e.rank)
            if len(moved_on) >= ranks:
                break
    return moved


def _paused_after(ev: TraceEvent, paused: bool) -> bool:
    """Whether the stage is paused after `ev`: from a commit of PAUSED until a resume or a
    restart (a paused stage's sleep and wake keep the pause)."""
    if ev.kind == "restart":
        return False
    if ev.kind == "state" and ev.state == "PAUSED":
        return True
    if ev.kind == "state" and ev.before == "PAUSED" and ev.state == "RUNNING":
        return False
    return paused


def split(trace: StageTrace, chunk_events: int = CHUNK_EVENTS) -> list[list[TraceEvent]]:
    """The stage's events cut into chunks of about `chunk_events` (0: no cut), each ending
    with the commit of a task (a settled stage) when nothing is in flight. Events keep the
    stage's task numbers; `part` renumbers them."""
    if chunk_events <= 0 or len(trace.events) <= chunk_events:
        return [trace.events]
    chunks: list[list[TraceEvent]] = []
    current: list[TraceEvent] = []
    rest = list(trace.events)
    k = 0
    paused = False  # a chunk starts unpaused (Carried holds no pause): never cut inside a pause
    while k < len(rest):
        current.append(rest[k])
        paused = _paused_after(current[-1], paused)
        k += 1
        cut = not paused and len(current) >= chunk_events and _is_commit(current[-1])
        if cut and len(rest) - k >= chunk_events // 4:
            moved = _cut_here(current, rest, k, trace.ranks)
            if moved is not None:
                current += [rest[j] for j in moved]
                for j in reversed(moved):
                    del rest[j]
                chunks.append(current)
                current = []
    if current:
        chunks.append(current)
    return chunks


def part(trace: StageTrace, chunks: list[list[TraceEvent]], index: int) -> StageTrace:
    """Chunk `index` (0-based) as a trace of its own: tasks renumbered from 1 (a line that
    names an earlier chunk's task gets -1, which no message matches)."""
    events = chunks[index]
    if len(chunks) == 1:
        return trace
    offset = max([e.task for c in chunks[:index] for e in c] + [0])
    renumbered = [replace(e, task=e.task - offset if e.task > offset else (0 if e.task == 0 else -1)) for e in events]
    count = max([e.task for e in renumbered] + [0])
    tasks = {t: n - offset for t, n in trace.tasks.items() if offset < n <= offset + count}
    previous = [e.epoch for c in chunks[:index] for e in c]
    out = _finish(
        trace.stage, renumbered, trace.ranks, tasks, trace.dropped if index == 0 else Counter(), max(previous + [0])
    )
    out.part, out.parts, out.chunk_end = index + 1, len(chunks), index + 1 < len(chunks)
    out.tags = trace.tags
    return out


def _task_number(task_id: str, tasks: dict[str, int], *, assign: bool) -> int:
    if not task_id or task_id == HELLO_TASK:
        return 0
    if task_id not in tasks:
        if not assign:
            return -1  # a task the engine never named: no message can match it
        tasks[task_id] = len(tasks) + 1
    return tasks[task_id]


def _wire_tags(command: str, tags: tuple[str, ...] | None) -> tuple[str, ...] | None:
    if command not in ("Sleep", "Wake"):
        return None  # a command without tags
    return ("all",) if tags is None else tuple(sorted(tags))


def load(path: str | os.PathLike[str]) -> list[T.TraceLine]:
    return read_trace(path)


def render_module(trace: StageTrace) -> str:
    body = ",\n    ".join(e.tla() for e in trace.events)
    carried = trace.carried or "[none |-> TRUE]"
    first = trace.events[0].line if trace.events else 0
    last = trace.events[-1].line if trace.events else 0
    return (
        f"---- MODULE {MODULE} ----\n"
        f"\\* GENERATED by omni_core/formal/trace_export.py: stage {trace.stage!r}, chunk {trace.part} of "
        f"{trace.parts}, {len(trace.events)} events (trace lines {first}..{last}). Do not edit.\n"
        f"EXTENDS Integers, TLC\n"
        f"FromStart == {'FALSE' if trace.carried else 'TRUE'}\n"
        f"ChunkEnd == {'TRUE' if trace.chunk_end else 'FALSE'}\n"
        f"Carried == {carried}\n"
        f"Trace == <<\n    {body}\n>>\n====\n"
    )


def render_config(trace: StageTrace, invariants: Iterable[str] = ()) -> str:
    faults = "{" + ", ".join(_str(f) for f in trace.faults) + "}"
    names = "\n    ".join(["TraceAccepted", *invariants])
    tags = "{" + ", ".join(_str(t) for t in trace.tags) + "}"
    calls = "{" + ", ".join(_str(t) for t in ("all", *trace.tags)) + "}"  # "all": tags=None
    return f"""\\* GENERATED by omni_core/formal/trace_export.py for stage {trace.stage!r}
INIT TraceInit
NEXT TraceNext
CONSTANTS
    Ranks = {trace.rank_set}
    MaxTask = {max(len(trace.tasks), 1)}
    MaxEpoch = {trace.max_epoch}
    Faults = {faults}
    MaxFaults = {trace.max_faults}
    SleepLevels = {{1, 2}}
    Tags = {tags}
    SleepTags = {calls}
    WakeTags = {calls}
    Requests = TRUE
    MaxRequests = {trace.max_requests}
    SerialShell = TRUE
    Profiles = TRUE
    Bug = "none"
CONSTRAINT TraceProgress
INVARIANTS
    {names}
"""


def write(trace: StageTrace, folder: Path, invariants: Iterable[str] = ()) -> tuple[Path, Path]:
    """Write TraceData.tla and OmniTrace.cfg into `folder`; returns (module, config)."""
    folder.mkdir(parents=True, exist_ok=True)
    module = folder / f"{MODULE}.tla"
    config = folder / "OmniTrace.cfg"
    module.write_text(render_module(trace))
    config.write_text(render_config(trace, invariants))
    return module, config
