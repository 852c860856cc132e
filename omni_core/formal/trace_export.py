"""Project a JSON-lines trace (omni_core/trace.py) onto the events tla/trace/OmniTrace.tla
replays, one stage at a time, and write them as a TLA+ module (`TraceData`) and a TLC
configuration.

Which lines become which event (everything else is dropped, and counted):

- engine `state` of stage S -> `state`: a lifecycle call (IssueSleep, IssueWake,
  IssueReload) when it first names its task; Restart (why=restart); a Deadline; or else
  the check of the change the previous engine step made;
- engine `send` -> `send`: IssueExecute for a request's first send (several requests may be
  in flight: the config's MaxRequests is the most the trace has at once), otherwise the
  check that the command is one a step put on the network;
- engine `recv` -> `recv`: StageReceive of that reply or Hello;
- engine `rank_died` -> `died`: Crash (a killed process logs nothing), then RankDied;
- worker `S/<rank>` `start` -> Loaded, or LoadFailed when it logs FAILED (the runner or the
  backend raised while loading: a fault of kind "error"); `recv:<Cmd>` -> WorkerReceive; `done:<Cmd>`,
  `error:<Cmd>` -> Done, EffectError; `state` -> the check of the worker's change;
  `send:<Reply>` -> the check that such a reply left the rank.

Dropped: engine `spawn` (the spec's ranks exist from the start) and `auto_wake` (written by
engines before the core started its own wakes; such a wake is logged as a `state` line);
Status and Shutdown commands and everything carrying their task ids (the spec does not
model them: they never change residency); everything of
the stage from its first Shutdown on (the engine's shutdown ends the trace); a worker's
`bad_message` with its NACK BAD_MESSAGE and `parent_gone`; any line that names another stage.

Task ids become 1, 2, ... in the order the engine first names them (the spec's task
counter); "hello" is task 0. A `state` line that first names a task carries the command
(and level, tags) of that task's first send, since the spec issues a command and its sends
in one step.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from omni_core.trace import read_trace

UNKNOWN = "?"
HELLO_TASK = "hello"
MODULE = "TraceData"
DROPPED_COMMANDS = ("Status", "Shutdown")
REPLY_KINDS = {"Ack": "ack", "Nack": "nack", "Result": "result", "Hello": "hello"}
EFFECT_COMMANDS = {"Reload": "ReloadWeights"}  # done:/error: name the effect: ReloadEffect -> "Reload"


@dataclass
class TraceEvent:
    """One projected event. `line` is its 1-based line in the trace file; the other fields
    are what OmniTrace.tla compares (UNKNOWN / 0 / None where the line says nothing)."""

    kind: str
    line: int
    record: dict[str, Any] = field(repr=False)
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
    note: str = ""  # why this line is outside what the spec models, if it is

    def tla(self) -> str:
        tags = "{" + ", ".join(_str(t) for t in (self.tags if self.tags is not None else (UNKNOWN,))) + "}"
        return (f"[k |-> {_str(self.kind)}, r |-> {self.rank}, t |-> {self.task}, e |-> {self.epoch}, "
                f"c |-> {_str(self.cmd)}, s |-> {_str(self.state)}, b |-> {_str(self.before)}, "
                f"w |-> {_str(self.wstate)}, x |-> {_str(self.info)}, lvl |-> {self.level}, "
                f"tg |-> {tags}]")  # fmt: skip

    def describe(self) -> str:
        """The trace line, for reports: `line 37: engine recv Ack rank 1 task sleep-... ...`."""
        r = self.record
        keys = ("event", "msg", "rank", "task_id", "epoch", "state", "before", "worker_state", "status",
                "reason", "previous", "why")  # fmt: skip
        parts = [f"{k}={r[k]}" for k in keys if r.get(k) not in (None, "")]
        return f"line {self.line}: {r.get('node', '?')} " + " ".join(parts)


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

    @property
    def name(self) -> str:
        return self.stage if self.parts == 1 else f"{self.stage} [{self.part}/{self.parts}]"

    @property
    def rank_set(self) -> str:
        return "{" + ", ".join(str(r) for r in range(self.ranks)) + "}"


def _str(value: Any) -> str:
    return json.dumps(str(value))  # a TLA+ string literal: double quotes, backslash escapes


def _stage_of(record: dict[str, Any]) -> tuple[str | None, int | None]:
    """(stage, rank) of a worker line, (stage, None) of an engine line naming a stage."""
    node = record.get("node", "")
    if node == "engine":
        return record.get("stage"), None
    stage, sep, rank = node.rpartition("/")
    if sep and rank.isdigit():
        return stage, int(rank)
    return None, None


def stages_in(records: Iterable[dict[str, Any]]) -> list[str]:
    """Stage names in order of first appearance."""
    seen: dict[str, None] = {}
    for record in records:
        stage, _ = _stage_of(record)
        if stage:
            seen.setdefault(stage, None)
    return list(seen)


def _lines(records: list[dict[str, Any]], stage: str) -> list[tuple[int, dict[str, Any], int | None]]:
    """(line number, record, rank or None for the engine) of this stage, up to its shutdown."""
    out = []
    for n, record in enumerate(records, start=1):
        s, rank = _stage_of(record)
        if s != stage:
            continue
        if record.get("node") == "engine" and record.get("event") == "send" and record.get("msg") == "Shutdown":
            break  # the engine's shutdown ends the stage's trace
        out.append((n, record, rank))
    return out


def project(records: list[dict[str, Any]], stage: str) -> StageTrace:
    lines = _lines(records, stage)
    dropped: Counter = Counter()
    # Tasks of commands the spec does not model: their lines go, wherever they are.
    skip_tasks = {r.get("task_id") for _, r, rank in lines
                  if (rank is None and r.get("event") == "send" and r.get("msg") in DROPPED_COMMANDS)
                  or (rank is not None and r.get("event", "").removeprefix("recv:") in DROPPED_COMMANDS)}  # fmt: skip
    skip_tasks.discard(None)
    tasks: dict[str, int] = {}
    first_send: dict[str, dict[str, Any]] = {}
    worker_cmd: dict[str, str] = {}
    for _, r, rank in lines:
        task = r.get("task_id") or ""
        if rank is None and r.get("event") == "send":
            first_send.setdefault(task, r)
        elif rank is not None and r.get("event", "").startswith("recv:"):
            worker_cmd.setdefault(task, r["event"].removeprefix("recv:"))
    events: list[TraceEvent] = []
    ranks = max([rank + 1 for _, _, rank in lines if rank is not None]
                + [r["rank"] + 1 for _, r, rank in lines if rank is None and isinstance(r.get("rank"), int)]
                + [1])  # fmt: skip
    skip_next_nack: set[int] = set()
    for n, r, rank in lines:
        event = r.get("event", "")
        task_id = r.get("task_id") or ""
        if task_id in skip_tasks:
            dropped["Status/Shutdown"] += 1
            continue
        if rank is None:
            ev = _engine_event(n, r, event, task_id, tasks, first_send, worker_cmd)
        else:
            if event == "bad_message":
                skip_next_nack.add(rank)
                ev = None
            elif event == "send:Nack" and rank in skip_next_nack:
                skip_next_nack.discard(rank)
                dropped["bad_message"] += 1
                continue
            else:
                ev = _worker_event(n, r, rank, event, task_id, tasks)
        if ev is None:
            dropped[event or "?"] += 1
            continue
        events.append(ev)
    _note_unmodelled(events)
    return _finish(stage, events, ranks, tasks, dropped)


def _finish(stage: str, events: list[TraceEvent], ranks: int, tasks: dict[str, int], dropped: Counter,
            min_epoch: int = 0) -> StageTrace:  # fmt: skip
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
    if any(e.kind == "state" and (e.state == "FAILED" or (e.before, e.state) == ("DRAINING", "RUNNING"))
           for e in events):  # fmt: skip
        faults.append("timeout")  # a deadline may have passed (it logs only the state change)
    max_epoch = max([e.epoch for e in events] + [min_epoch])
    return StageTrace(stage, events, ranks, tasks, max_epoch, faults, died + errors + resent + taken_twice,
                      dropped, max_requests=max_in_flight(events, ranks))  # fmt: skip


def max_in_flight(events: Iterable[TraceEvent], ranks: int) -> int:
    """The most requests in flight at once, as the spec counts them: from a request's first
    Execute send until the engine has taken a Result or Nack of it from every rank, or the
    stage failed or restarted (at least 1)."""
    in_flight: dict[int, set[int]] = {}  # request task -> ranks whose answer the engine took
    most = 1
    for ev in events:
        if ev.kind == "send" and ev.cmd == "Execute" and ev.task not in in_flight:
            in_flight[ev.task] = set()
            most = max(most, len(in_flight))
        elif ev.kind == "recv" and ev.task in in_flight and ev.cmd in ("result", "nack"):
            in_flight[ev.task].add(ev.rank)
            if len(in_flight[ev.task]) >= ranks:
                del in_flight[ev.task]
        elif ev.kind == "state" and (ev.state == "FAILED" or ev.info == "restart"):
            in_flight.clear()
    return most


def _repeats(events: Iterable[TraceEvent]) -> int:
    seen: Counter = Counter((e.task, e.rank, e.cmd) for e in events)
    return sum(n - 1 for n in seen.values())


STARTED = ("ACTIVE", "FAILED", UNKNOWN)  # a rank loads (Loaded) or fails to (LoadFailed)


def _note_unmodelled(events: list[TraceEvent]) -> None:
    """Mark lines that fall outside OmniSleep's abstractions, so that a divergence there
    is reported as such and not as a protocol error."""
    for ev in events:
        if ev.kind == "start" and ev.wstate not in STARTED:
            ev.note = (f"rank {ev.rank} started in {ev.wstate}; the spec's ranks start ACTIVE (Loaded) or "
                       "FAILED (LoadFailed)")  # fmt: skip


CHUNK_EVENTS = 400
SETTLED = ("RUNNING", "SLEEPING", "PARTIAL", "NEEDS_RELOAD")
ENGINE_KINDS = ("recv", "send", "state", "died")


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
    while k < len(rest):
        current.append(rest[k])
        k += 1
        if len(current) >= chunk_events and _is_commit(current[-1]) and len(rest) - k >= chunk_events // 4:
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
    renumbered = [replace(e, task=e.task - offset if e.task > offset else (0 if e.task == 0 else -1))
                  for e in events]  # fmt: skip
    count = max([e.task for e in renumbered] + [0])
    tasks = {t: n - offset for t, n in trace.tasks.items() if offset < n <= offset + count}
    previous = [e.epoch for c in chunks[:index] for e in c]
    out = _finish(trace.stage, renumbered, trace.ranks, tasks, trace.dropped if index == 0 else Counter(),
                  max(previous + [0]))  # fmt: skip
    out.part, out.parts, out.chunk_end = index + 1, len(chunks), index + 1 < len(chunks)
    return out


def _task_number(task_id: str, tasks: dict[str, int], *, assign: bool) -> int:
    if not task_id or task_id == HELLO_TASK:
        return 0
    if task_id not in tasks:
        if not assign:
            return -1  # a task the engine never named: no message can match it
        tasks[task_id] = len(tasks) + 1
    return tasks[task_id]


def _wire_tags(record: dict[str, Any]) -> tuple[str, ...] | None:
    if "tags" not in record or record.get("msg") not in ("Sleep", "Wake"):
        return None  # not traced (an older trace), or a command without tags
    tags = record["tags"]
    return ("all",) if tags is None else tuple(sorted(tags))


def _engine_event(n: int, r: dict[str, Any], event: str, task_id: str, tasks: dict[str, int],
                  first_send: dict[str, dict[str, Any]], worker_cmd: dict[str, str]) -> TraceEvent | None:  # fmt: skip
    rank = r.get("rank") if isinstance(r.get("rank"), int) else -1
    epoch = int(r.get("epoch") or 0)
    state = r.get("state") or UNKNOWN
    if event == "state":
        new = bool(task_id) and task_id not in tasks
        ev = TraceEvent("state", n, r, task=_task_number(task_id, tasks, assign=True), epoch=epoch,
                        state=state, before=r.get("before") or UNKNOWN, info=r.get("why") or UNKNOWN)  # fmt: skip
        if new:  # the step that issues this task: what it sends comes from its first send
            send = first_send.get(task_id)
            if send is not None:
                ev.cmd = send.get("msg") or UNKNOWN
                ev.level = int(send.get("level") or 0) if send.get("msg") == "Sleep" else 0
                ev.tags = _wire_tags(send)
            elif task_id in worker_cmd:
                ev.cmd = worker_cmd[task_id]
            elif state == "DRAINING":
                ev.cmd = "Sleep"
        return ev
    if event == "send":
        msg = r.get("msg") or UNKNOWN
        return TraceEvent("send", n, r, rank=rank, task=_task_number(task_id, tasks, assign=True),
                          epoch=epoch, cmd=msg, state=state,
                          level=int(r.get("level") or 0) if msg == "Sleep" else 0, tags=_wire_tags(r))  # fmt: skip
    if event == "recv":
        msg = r.get("msg") or UNKNOWN
        info = r.get("status") if msg == "Ack" else r.get("reason") if msg == "Nack" else None
        return TraceEvent("recv", n, r, rank=rank, task=_task_number(task_id, tasks, assign=False),
                          epoch=epoch, cmd=REPLY_KINDS.get(msg, msg), state=state,
                          wstate=r.get("worker_state") or UNKNOWN, info=info or UNKNOWN)  # fmt: skip
    if event == "rank_died":
        return TraceEvent("died", n, r, rank=rank, epoch=epoch, state=state)
    return None  # spawn, auto_wake, bad_reply


def _worker_event(n: int, r: dict[str, Any], rank: int, event: str, task_id: str,
                  tasks: dict[str, int]) -> TraceEvent | None:  # fmt: skip
    epoch = int(r.get("epoch") or 0)
    state = r.get("state") or UNKNOWN
    task = _task_number(task_id, tasks, assign=False)
    kind, _, name = event.partition(":")
    if event == "start":
        return TraceEvent("start", n, r, rank=rank, epoch=epoch, wstate=state)
    if event == "state":
        return TraceEvent("wstate", n, r, rank=rank, task=task, epoch=epoch, wstate=state,
                          before=r.get("previous") or UNKNOWN)  # fmt: skip
    if kind == "recv" and name:
        return TraceEvent("wrecv", n, r, rank=rank, task=task, epoch=epoch, cmd=name, wstate=state)
    if kind in ("done", "error") and name:
        return TraceEvent(kind, n, r, rank=rank, task=task, epoch=epoch,
                          cmd=EFFECT_COMMANDS.get(name, name), wstate=state)  # fmt: skip
    if kind == "send" and name:
        return TraceEvent("wsend", n, r, rank=rank, task=task, epoch=epoch,
                          cmd=REPLY_KINDS.get(name, name), wstate=state)  # fmt: skip
    return None  # parent_gone, ...


def load(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return read_trace(path)


def render_module(trace: StageTrace) -> str:
    body = ",\n    ".join(e.tla() for e in trace.events)
    carried = trace.carried or "[none |-> TRUE]"
    first = trace.events[0].line if trace.events else 0
    last = trace.events[-1].line if trace.events else 0
    return (f"---- MODULE {MODULE} ----\n"
            f"\\* GENERATED by omni_core/formal/trace_export.py: stage {trace.stage!r}, chunk {trace.part} of "
            f"{trace.parts}, {len(trace.events)} events (trace lines {first}..{last}). Do not edit.\n"
            f"EXTENDS Integers, TLC\n"
            f"FromStart == {'FALSE' if trace.carried else 'TRUE'}\n"
            f"ChunkEnd == {'TRUE' if trace.chunk_end else 'FALSE'}\n"
            f"Carried == {carried}\n"
            f"Trace == <<\n    {body}\n>>\n====\n")  # fmt: skip


def render_config(trace: StageTrace, invariants: Iterable[str] = ()) -> str:
    faults = "{" + ", ".join(_str(f) for f in trace.faults) + "}"
    names = "\n    ".join(["TraceAccepted", *invariants])
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
    SleepTags = {{"all", "weights", "kv_cache"}}
    WakeTags = {{"all", "weights", "kv_cache"}}
    Requests = TRUE
    MaxRequests = {trace.max_requests}
    SerialShell = TRUE
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
