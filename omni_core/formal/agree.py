"""Agreement of the Python cores with the spec beyond the generated tables.

The tables are generated into the spec; the order of a worker's checks, the settle logic,
`plan_sleep` and the stage's expectations are not. So TLC runs `tla/OmniAgree.tla`: every
small case (worker state, asleep tags, weights valid, pending effect, reply cache; command
kind, level, tags, epoch and task relation; settled stage residency and lifecycle call)
takes one step of the spec's real actions (WorkerReceive, Done, IssueSleep/Wake/Reload with
Expect), and TLC prints each case and each result. This module puts the Python cores in the
same case, feeds them the same input and compares: every disagreement names the case and
the command, and `omni-core check` fails on the first one.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_core.formal.tlc import EXIT_OK, run_tlc
from omni_core.fsm import inputs as I
from omni_core.fsm.stage import StageCommandError, StageCore
from omni_core.fsm.stage_step import StageSnapshot
from omni_core.fsm.tags import Residency, plan_sleep
from omni_core.fsm.worker import CommandReceived, EffectCompleted, WorkerCore
from omni_core.fsm.worker_step import PendingEffect, WorkerSnapshot, _CachedReply, command_digest
from omni_core.protocol import (
    Ack,
    AckStatus,
    Execute,
    MemoryReport,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    Sleep,
    StageState,
    Wake,
    WorkerState,
)

SPEC = "OmniAgree.tla"
CONFIG = "agree.cfg"
DEFAULT_TIMEOUT_S = 300.0
_EPOCH = 1  # the rank's epoch in every case: a command of epoch 0 is stale
_NONE = "-"


class AgreeParseError(ValueError):
    """TLC printed something the reader of OmniAgree's lines cannot parse."""


# ----------------------------------------------------------------- TLC's printed values

_TOKEN = re.compile(r'\s*(<<|>>|\{|\}|,|"(?:[^"\\]|\\.)*"|-?\d+|TRUE|FALSE)')


def _tokens(text: str, pos: int) -> Iterator[tuple[str, int]]:
    while True:
        match = _TOKEN.match(text, pos)
        if match is None:
            raise AgreeParseError(f"unexpected text at {pos}: {text[pos : pos + 60]!r}")
        pos = match.end()
        yield match.group(1), pos


def _value(tokens: Iterator[tuple[str, int]], first: str) -> Any:
    if first in ("<<", "{"):
        close = ">>" if first == "<<" else "}"
        items: list[Any] = []
        tok, _ = next(tokens)
        while tok != close:
            items.append(_value(tokens, tok))
            tok, _ = next(tokens)
            if tok == ",":
                tok, _ = next(tokens)
        return tuple(items) if first == "<<" else frozenset(items)
    if first.startswith('"'):
        return first[1:-1]
    if first in ("TRUE", "FALSE"):
        return first == "TRUE"
    if first.lstrip("-").isdigit():
        return int(first)
    raise AgreeParseError(f"unexpected token {first!r}")


def parse_lines(output: str, tag: str = "AGREE") -> list[tuple[Any, ...]]:
    """Every `<<"AGREE", ...>>` value TLC printed (PrintT wraps long ones over lines)."""
    found = []
    for match in re.finditer(rf'<<\s*"{tag}"', output):
        tokens = _tokens(output, match.start())
        first, _ = next(tokens)
        found.append(_value(tokens, first)[1:])
    return found


# ----------------------------------------------------------------- the spec's table

Key = tuple[Any, ...]


@dataclass
class SpecTable:
    worker_cases: list[Key]  # (W, M)
    recv: dict[Key, tuple]  # (W, M) -> outcome
    done: dict[Key, tuple]  # W -> outcome
    stage_cases: list[Key]  # (S, C)
    issue: dict[Key, tuple]  # (S, C) -> outcome; absent: the spec has no such step
    reply: dict[Key, tuple] = field(default_factory=dict)  # (S, C, X) -> what the stage did with reply X


def table_from_lines(lines: list[tuple[Any, ...]]) -> SpecTable:
    table = SpecTable([], {}, {}, [], {})
    for line in lines:
        kind, *rest = line
        if kind == "case":
            table.worker_cases.append(tuple(rest))
        elif kind == "scase":
            table.stage_cases.append(tuple(rest))
        else:
            target = {"recv": table.recv, "done": table.done, "issue": table.issue, "reply": table.reply}[kind]
            if kind == "done":
                key, value = rest[0], rest[1]
            elif kind == "reply":
                key, value = tuple(rest[:3]), rest[3]
            else:
                key, value = tuple(rest[:2]), rest[2]
            if target.get(key, value) != value:
                raise AgreeParseError(f"the spec gives two results for {kind} {key}: {target[key]} and {value}")
            target[key] = value
    return table


def spec_table(root: Path, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> SpecTable:
    """Run TLC over OmniAgree and read what it printed."""
    result = run_tlc(root / SPEC, root / CONFIG, workers=1, timeout_s=timeout_s)
    if result.exit_code != EXIT_OK:
        raise AgreeParseError(f"TLC on {SPEC} did not finish cleanly: {result.error or result.exit_code}")
    table = table_from_lines(parse_lines(result.output))
    if not table.worker_cases or not table.stage_cases:
        raise AgreeParseError(f"TLC on {SPEC} printed no cases; is PrintCases in {CONFIG}?")
    return table


# ----------------------------------------------------------------- the cores in a case


def _tags(tags: frozenset[str]) -> tuple[str, ...]:
    return tuple(sorted(tags))


def _command(m: Key) -> Any:
    kind, level, tags, task, epoch = m
    task_id = str(task)
    if kind == "Sleep":
        return Sleep(task_id=task_id, epoch=epoch, level=level, tags=_tags(tags))
    if kind == "Wake":
        return Wake(task_id=task_id, epoch=epoch, tags=_tags(tags))
    if kind == "ReloadWeights":
        return ReloadWeights(task_id=task_id, epoch=epoch)
    return Execute(task_id=task_id, epoch=epoch, payload=None)


def _reply(reply: Any, cached: Any = None) -> tuple:
    if reply is None:
        return ("none", _NONE, _NONE, frozenset())
    if cached is not None and reply is cached:
        return ("ack", "CACHED", "ACTIVE", frozenset())
    if isinstance(reply, Ack):
        return ("ack", reply.status.value, reply.state.value, frozenset(reply.asleep_tags))
    if isinstance(reply, Nack):
        return ("nack", reply.reason.value, reply.state.value, frozenset())
    if isinstance(reply, Result):
        return ("result", _NONE, _NONE, frozenset())
    raise TypeError(f"unexpected reply {reply!r}")


_CORES: dict[Any, Any] = {}


def _reused(factory: Callable[..., Any], *args: Any) -> Any:
    """One core per factory, its state reset per case: building the lifecycle machine takes
    milliseconds, and thousands of cases are replayed."""
    core = _CORES.get((factory, args))
    if core is None:
        core = _CORES[(factory, args)] = factory(*args, epoch=_EPOCH)
    return core


def _worker(w: Key, m: Key | None, factory: Callable[..., WorkerCore]) -> tuple[WorkerCore, Any]:
    state, asleep, valid, ptask, ptype, plevel, pplan, cached = w
    core = _reused(factory, 0)
    pending: PendingEffect | None = None
    running: tuple[Execute, ...] = ()
    if ptask:
        command = _command((ptype, plevel, pplan, ptask, _EPOCH))
        if ptype == "Sleep":
            pending = PendingEffect(command, sleep_plan=plan_sleep(plevel, frozenset(pplan), weights_valid=valid))
        elif ptype == "Wake":
            pending = PendingEffect(command, wake_tags=frozenset(pplan))
        elif isinstance(command, Execute):  # the spec's one request in progress: a batch of one
            running = (command,)
        else:
            pending = PendingEffect(command, state_before=WorkerState.ACTIVE)
    snapshot = WorkerSnapshot(WorkerState(state), _EPOCH, frozenset(asleep), valid, pending=pending, running=running)
    core.restore(snapshot)
    marker = None
    if cached and m is not None:
        command = _command(m[:3] + (2, _EPOCH))
        marker = Ack(
            task_id="2",
            epoch=_EPOCH,
            rank=0,
            command=type(command).__name__,
            state=WorkerState.ACTIVE,
            status=AckStatus.ALREADY,
            asleep_tags=(),
        )
        core.cache.put("2", _CachedReply(command_digest(command), type(command).__name__, marker), 256)
    return core, marker


def worker_recv(w: Key, m: Key, factory: Callable[..., WorkerCore] = WorkerCore) -> tuple:
    core, marker = _worker(w, m, factory)
    task_id = str(m[3])
    before = core.cache._entries.get(task_id)
    step = core.step(CommandReceived(_command(m)))
    effect = step.effect
    replies = step.replies
    if len(replies) > 1:
        raise AssertionError(f"{len(replies)} replies to one command")
    cache_added = core.cache._entries.get(task_id) is not before
    return (
        core.state.value,
        *_pending(core.work.pending or next((PendingEffect(c) for c in core.work.running.values()), None)),
        cache_added,
        effect is not None,
        *_reply(replies[0] if replies else None, marker),
    )


def _pending(pending: PendingEffect | None) -> tuple[str, frozenset[str], frozenset[str]]:
    """(type, tags it moves, tags it offloads) of the effect in progress, as the spec's wpend."""
    if pending is None:
        return _NONE, frozenset(), frozenset()
    name = type(pending.command).__name__
    if pending.sleep_plan is not None:
        return name, pending.sleep_plan.offload | pending.sleep_plan.discard, pending.sleep_plan.offload
    return name, pending.wake_tags, frozenset()


def worker_done(w: Key, factory: Callable[..., WorkerCore] = WorkerCore) -> tuple:
    core, _ = _worker(w, None, factory)
    step = core.step(EffectCompleted("1"))
    res = core.residency
    return (core.state.value, res.asleep, res.weights_valid, *_reply(step.replies[0]))


def _stage(s: Key, factory: Callable[..., StageCore]) -> StageCore:
    state, asleep, valid = s
    stage = factory("agree", 1, epoch=_EPOCH)
    rank_state = {0: WorkerState.ACTIVE if state == "RUNNING" else WorkerState(state)}
    stage.restore(StageSnapshot(StageState(state), frozenset(asleep), valid, rank_state))
    return stage


def _call(stage: StageCore, c: Key) -> Any:
    kind, level, tags = c
    if kind == "Sleep":
        return stage.step(I.SleepCall("1", level, _tags(tags), 10.0), 0.0)
    if kind == "Wake":
        return stage.step(I.WakeCall("1", _tags(tags), 10.0), 0.0)
    return stage.step(I.ReloadCall("1", None, 10.0), 0.0)


def stage_issue(s: Key, c: Key, factory: Callable[..., StageCore] = StageCore) -> tuple | None:
    """What the stage does with the call; None where it refuses it (the spec has no step)."""
    stage = _stage(s, factory)
    try:
        step = _call(stage, c)
    except StageCommandError:
        return None
    sent = frozenset(type(o.command).__name__ for o in step.sends)
    task = stage.task
    if task is None:
        return (
            stage.state.value,
            sent,
            "ok" if step.outcome and step.outcome.ok else "none",
            (_NONE, frozenset(), False, _NONE),
        )
    after = Residency(stage.tags)
    after.asleep, after.weights_valid = stage.residency.asleep, stage.residency.weights_valid
    task.apply(after)
    if after.asleep != task.expect_asleep:
        raise AssertionError(
            f"the stage expects asleep {sorted(task.expect_asleep)} but commits {sorted(after.asleep)}"
        )
    return (
        stage.state.value,
        sent,
        "pending",
        (task.expect_state.value, task.expect_asleep, after.weights_valid, task.commit_trigger),
    )


def _reply_message(command: str, x: Key) -> Ack | Nack:
    kind, info, state, asleep, task, epoch = x
    if kind == "nack":
        return Nack(
            task_id=str(task),
            epoch=epoch,
            rank=0,
            command=command,
            reason=NackReason(info),
            detail="agree",
            state=WorkerState(state),
        )
    memory = MemoryReport(pool_bytes_before={}, pool_bytes_after={}, process_bytes_source="none: agreement case")
    return Ack(
        task_id=str(task),
        epoch=epoch,
        rank=0,
        command=command,
        state=WorkerState(state),
        status=AckStatus(info),
        asleep_tags=_tags(asleep),
        memory=memory,
    )


def stage_reply(s: Key, c: Key, x: Key, factory: Callable[..., StageCore] = StageCore) -> tuple | None:
    """What the stage does with reply `x` to the call `c` it sent from settled case `s`: its
    state, whether it names failed ranks, the task's outcome, the residency it holds."""
    stage = _stage(s, factory)
    _call(stage, c)
    if stage.task is None:
        return None  # nothing was sent: the spec takes no reply either
    step = stage.step(I.Received(_reply_message(c[0], x)), 0.5)
    o = step.outcome
    outcome = "pending" if o is None else "ok" if o.ok else "refused" if o.refused else "failed"
    return (stage.state.value, bool(stage.failed_ranks), outcome, stage.residency.asleep, stage.residency.weights_valid)


# ----------------------------------------------------------------- the comparison


@dataclass(frozen=True)
class Disagreement:
    what: str  # "OnCommand", "Done", "stage call"
    case: Key
    spec: Any
    code: Any

    def __str__(self) -> str:
        return f"{self.what} in {self.case}: the spec gives {self.spec}, the code {self.code}"


def compare(
    table: SpecTable, *, worker: Callable[..., WorkerCore] = WorkerCore, stage: Callable[..., StageCore] = StageCore
) -> list[Disagreement]:
    """Every case where the code and the spec differ, in a stable order (first: the case to fix)."""
    out: list[Disagreement] = []

    def check(what: str, case: Key, spec: Any, run: Callable[[], Any]) -> None:
        try:
            code = run()
        except Exception as exc:  # an invariant the core raises is an answer too
            code = f"{type(exc).__name__}: {exc}"
        if code != spec:
            out.append(Disagreement(what, case, spec, code))

    for w, m in sorted(set(table.worker_cases), key=repr):
        if (w, m) not in table.recv:
            raise AgreeParseError(f"the spec printed no result for the case {w} {m}")
        check("OnCommand", (w, m), table.recv[(w, m)], functools.partial(worker_recv, w, m, worker))
    for w in sorted(table.done, key=repr):
        check("Done", w, table.done[w], functools.partial(worker_done, w, worker))
    for s, c in sorted(set(table.stage_cases), key=repr):
        check("stage call", (s, c), table.issue.get((s, c)), functools.partial(stage_issue, s, c, stage))
    for s, c, x in sorted(table.reply, key=repr):
        check("stage reply", (s, c, x), table.reply[(s, c, x)], functools.partial(stage_reply, s, c, x, stage))
    return out


def counts(table: SpecTable) -> str:
    return (
        f"{len(set(table.worker_cases))} worker commands, {len(table.done)} effect completions, "
        f"{len(set(table.stage_cases))} stage calls, {len(table.reply)} replies to them"
    )
