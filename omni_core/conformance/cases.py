"""The cases: one function each, naming the requirement of `specs/protocol.md` it checks.

A case talks to the worker through a `Ctx` (send, wait for the reply, check it) and raises
`CaseFailure` with what it sent and what came back. Cases of scope `shared` run on one
worker kept across cases and must leave it ACTIVE with nothing asleep (the runner checks,
and starts a fresh worker when a case did not); `own` cases start their own workers;
`consume` cases end the shared worker (Shutdown). `needs` lists capabilities from Hello a
case requires: a worker that does not declare them gets a reported skip, never a pass.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from omni_core.conformance.harness import CaseFailure, CaseSkip, Harness, Peer, SuiteOptions
from omni_core.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    AckStatus,
    Command,
    Execute,
    Hello,
    Message,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    Shutdown,
    Sleep,
    Status,
    Wake,
    WorkerState,
    encode,
)
from omni_core.protocol.auth import RANK_SECRET_ENV, verify_hello_proof

Scope = Literal["shared", "own", "consume", "global"]
# No runner can read this: the NUL byte is not valid in a path, a seed or a URL.
EPOCH_WINDOW = 64  # P-13's words, not the implementation's constant: a worker that widens it fails
UNUSABLE_SOURCE = "\0omni-core-conformance: no runner can use this source"
WEIGHTS = "weights"
LEVEL2 = "level2"
PARTIAL_WAKE = "partial_wake"


@dataclass(frozen=True)
class Case:
    req: str  # "P-n"
    name: str  # short id, unique
    title: str
    run: Callable[[Ctx], None]
    needs: tuple[str, ...] = ()  # capabilities the worker must declare, else SKIP
    unless: tuple[str, ...] = ()  # capabilities whose presence makes the case not apply
    scope: Scope = "shared"

    @property
    def id(self) -> str:
        return f"{self.req}/{self.name}"


CASES: list[Case] = []


def case(
    req: str,
    name: str,
    title: str,
    *,
    needs: tuple[str, ...] = (),
    unless: tuple[str, ...] = (),
    scope: Scope = "shared",
) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def register(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        assert all(c.name != name for c in CASES), f"duplicate case name {name}"
        CASES.append(Case(req, name, title, fn, needs, unless, scope))
        return fn

    return register


def _a(name: str) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


class Ctx:
    """What a case works with: the worker, a way to start more, and checks that explain."""

    _task_ids = itertools.count(1)

    def __init__(
        self,
        case: Case,
        worker: Peer | None,
        harness: Harness | None,
        options: SuiteOptions,
        new_harness: Callable[[], Harness],
    ) -> None:
        self.case = case
        self._worker = worker
        self.harness = harness
        self.options = options
        self._new_harness = new_harness
        self.stray_note: str = ""  # global cases get the run's record here
        self.failing_factory: Callable[[str, int, int], Any] | None = None  # a worker that greets FAILED
        self.pressure_factory: Callable[[], Any] | None = None  # memory-pressure hooks (P-16)

    @property
    def worker(self) -> Peer:
        assert self._worker is not None, f"case {self.case.id} has no shared worker"
        return self._worker

    def own_harness(self) -> Harness:
        if self.harness is None:
            self.harness = self._new_harness()
        return self.harness

    # ------------------------------------------------------------------ commands

    def task(self, what: str) -> str:
        return f"{self.case.name}-{what}-{next(self._task_ids)}"

    def cmd(self, cls: type[Command], what: str = "", *, peer: Peer | None = None, **fields: Any) -> Any:
        peer = peer or self.worker
        fields.setdefault("epoch", peer.epoch)
        return cls(task_id=self.task(what or cls.__name__.lower()), **fields)

    def request(self, command: Command, peer: Peer | None = None) -> Message:
        return (peer or self.worker).request(command)

    def execute(self, peer: Peer | None = None) -> tuple[Execute, Message]:
        command = self.cmd(Execute, peer=peer, payload=self.options.execute_payload)
        return command, self.request(command, peer)

    def status(self, peer: Peer | None = None) -> Ack:
        return self.status_exchange(peer)[1]

    def status_exchange(self, peer: Peer | None = None) -> tuple[Status, Ack]:
        """A Status, checked against the reply before it: a Status changes nothing, so a state
        it reports that the previous answer did not is blamed on the Status (or on that answer's
        misreport), not on whatever the case sent before."""
        peer = peer or self.worker
        before = peer.last_stated
        command = self.cmd(Status, peer=peer)
        ack = self.ack(self.request(command, peer), command)
        if before is not None:
            said_tags = set(before.asleep_tags) if isinstance(before, Ack) else set(ack.asleep_tags)
            if ack.state is not before.state or set(ack.asleep_tags) != said_tags:
                said = f"{before.state.value}" + (f", asleep {sorted(said_tags)}" if isinstance(before, Ack) else "")
                raise CaseFailure(
                    f"the Status reports {ack.state.value}, asleep {sorted(ack.asleep_tags)}, but the answer just "
                    f"before it ({type(before).__name__} of {before.command} {before.task_id!r}) said {said}: a "
                    "Status must change nothing, so either this Status changed the worker or that answer misreported "
                    "its state",
                    sent=command,
                    got=ack,
                    expected=f"Ack of Status in {said}",
                )
        return command, ack

    # ------------------------------------------------------------------ checks

    def check(self, condition: bool, problem: str, *, sent: Any = None, got: Any = None, expected: Any = None) -> None:
        if not condition:
            raise CaseFailure(problem, sent=sent, got=got, expected=expected)

    def skip(self, reason: str) -> None:
        raise CaseSkip(reason)

    def ack(
        self, reply: Message, sent: Command, *, state: WorkerState | None = None, status: AckStatus | None = None
    ) -> Ack:
        name = type(sent).__name__
        want = (
            f"Ack of {name}"
            + (f" with state {state.value}" if state else "")
            + (f", status {status.value}" if status else "")
        )
        self.check(isinstance(reply, Ack), f"{name} was not acknowledged", sent=sent, got=reply, expected=want)
        assert isinstance(reply, Ack)
        self.check(
            reply.task_id == sent.task_id and reply.command == name,
            f"the Ack does not answer the {name} sent",
            sent=sent,
            got=reply,
            expected=want,
        )
        if state is not None:
            self.check(
                reply.state is state,
                f"{name} ended in state {reply.state.value}, not {state.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        if status is not None:
            self.check(
                reply.status is status,
                f"{name} was acknowledged with status {reply.status.value}, not {status.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        return reply

    def nack(
        self,
        reply: Message,
        sent: Any,
        reason: NackReason,
        *,
        state: WorkerState | None = None,
        names_state: bool = False,
        task_id: str | None = None,
    ) -> Nack:
        want = (
            f"Nack {reason.value}"
            + (f" in state {state.value}" if state else "")
            + (" whose detail names the state" if names_state else "")
        )
        self.check(
            isinstance(reply, Nack),
            f"expected a refusal ({reason.value}), got {_a(type(reply).__name__)}",
            sent=sent,
            got=reply,
            expected=want,
        )
        assert isinstance(reply, Nack)
        self.check(
            reply.reason is reason,
            f"refused with {reply.reason.value}, not {reason.value}",
            sent=sent,
            got=reply,
            expected=want,
        )
        if task_id is not None:
            self.check(
                reply.task_id == task_id,
                f"the refusal carries task_id {reply.task_id!r}, not {task_id!r}",
                sent=sent,
                got=reply,
                expected=want,
            )
        if state is not None:
            self.check(
                reply.state is state,
                f"the refusal says state {reply.state.value}, not {state.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        if names_state:
            self.check(
                reply.state.value in reply.detail,
                f"the refusal's detail does not name the state {reply.state.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        return reply

    def executed_or_runner_error(self, sent: Execute, reply: Message) -> None:
        """In ACTIVE an Execute runs: a Result, or the runner's own EXECUTE_ERROR (the payload
        is the user's), never a state refusal."""
        ok = isinstance(reply, Result) or (
            isinstance(reply, Nack) and reply.reason is NackReason.EXECUTE_ERROR and reply.state is WorkerState.ACTIVE
        )
        self.check(
            ok and reply.task_id == sent.task_id,
            "Execute in ACTIVE was not run",
            sent=sent,
            got=reply,
            expected="Result (or Nack EXECUTE_ERROR from the runner, state ACTIVE)",
        )

    def sleep(self, level: int = 1, peer: Peer | None = None, **fields: Any) -> tuple[Sleep, Ack]:
        command = self.cmd(Sleep, peer=peer, level=level, **fields)
        return command, self.ack(self.request(command, peer), command)

    def wake(self, peer: Peer | None = None, **fields: Any) -> tuple[Wake, Ack]:
        command = self.cmd(Wake, peer=peer, **fields)
        return command, self.ack(self.request(command, peer), command)

    def back_to_active(self, peer: Peer | None = None) -> None:
        """Wake (and reload, after level 2) until ACTIVE: cases leave the worker usable."""
        _, woke = self.wake(peer)
        if woke.state is WorkerState.NEEDS_RELOAD:
            command = self.cmd(ReloadWeights, peer=peer)
            self.ack(self.request(command, peer), command, state=WorkerState.ACTIVE)
        else:
            self.check(
                woke.state is WorkerState.ACTIVE,
                f"Wake of every tag ended in {woke.state.value}",
                got=woke,
                expected="ACTIVE",
            )


# ============================================================================ P-3 envelope


@case("P-3", "greeting", "Hello first: version, rank and epoch it was started with, its tags, ACTIVE")
def greeting(ctx: Ctx) -> None:
    hello = ctx.worker.hello
    assert isinstance(hello, Hello)
    sent = f"(nothing: started as rank {ctx.worker.rank}, epoch {ctx.options.epoch})"
    ctx.check(hello.v == PROTOCOL_VERSION, f"Hello has version {hello.v}", sent=sent, got=hello)
    ctx.check(
        hello.rank == ctx.worker.rank,
        f"Hello names rank {hello.rank}, started as {ctx.worker.rank}",
        sent=sent,
        got=hello,
    )
    ctx.check(
        hello.epoch == ctx.options.epoch,
        f"Hello carries epoch {hello.epoch}, started in {ctx.options.epoch}",
        sent=sent,
        got=hello,
    )
    ctx.check(bool(hello.tags), "Hello lists no memory tags", sent=sent, got=hello)
    ctx.check(len(set(hello.tags)) == len(hello.tags), "Hello lists a tag twice", sent=sent, got=hello)


@case("P-3", "reply_envelope", "a reply carries v, the command's task_id and epoch, and the worker's rank")
def reply_envelope(ctx: Ctx) -> None:
    for command in (ctx.cmd(Status), ctx.cmd(Execute, payload=ctx.options.execute_payload)):
        reply = ctx.request(command)
        ctx.check(reply.v == PROTOCOL_VERSION, f"reply has version {reply.v}", sent=command, got=reply)
        ctx.check(
            getattr(reply, "rank", None) == ctx.worker.rank,
            f"reply names rank {getattr(reply, 'rank', None)}, the worker is rank {ctx.worker.rank}",
            sent=command,
            got=reply,
        )
        ctx.check(
            reply.epoch == command.epoch,
            f"reply carries epoch {reply.epoch}, the command {command.epoch}",
            sent=command,
            got=reply,
        )


@case("P-3", "unsupported_version", "another protocol version: Nack UNSUPPORTED_VERSION naming both, then service")
def unsupported_version(ctx: Ctx) -> None:
    other = PROTOCOL_VERSION + 1
    # A Sleep of another version must not take effect either.
    for command in (ctx.cmd(Status, v=other), ctx.cmd(Sleep, v=other, level=1)):
        ctx.worker.send(command)
        reply = ctx.worker.reply(command.task_id, sent=command)
        nack = ctx.nack(reply, command, NackReason.UNSUPPORTED_VERSION)
        named = re.search(rf"\b{other}\b", nack.detail) and re.search(rf"\b{PROTOCOL_VERSION}\b", nack.detail)
        ctx.check(
            bool(named),
            f"the detail does not name both versions ({other} and {PROTOCOL_VERSION})",
            sent=command,
            got=nack,
        )
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "after a Sleep of another version the worker is not ACTIVE with every tag resident",
        sent="Status",
        got=status,
    )


# ============================================================================ P-2 duplicates


@case("P-2", "duplicate_answered_from_cache", "a repeated task_id gets the first reply again, and no second effect")
def duplicate_answered_from_cache(ctx: Ctx) -> None:
    sleep, first = ctx.sleep(1)
    again = ctx.request(sleep)
    ctx.check(
        again == first, "a copy of an answered Sleep got a different reply", sent=sleep, got=again, expected=first
    )
    ctx.wake()
    later = ctx.request(sleep)  # after a wake: still the recorded reply, and nothing sleeps
    ctx.check(
        later == first,
        "a copy of an answered Sleep, sent after a Wake, got a different reply",
        sent=sleep,
        got=later,
        expected=first,
    )
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "a copy of an answered Sleep took effect a second time (the worker went back to sleep)",
        sent=sleep,
        got=status,
        expected="Status: ACTIVE, nothing asleep",
    )
    command, result = ctx.execute()
    repeat = ctx.request(command)
    ctx.check(
        repeat == result,
        "a copy of an answered Execute got a different reply",
        sent=command,
        got=repeat,
        expected=result,
    )


@case("P-2", "task_id_reused", "another command under a used task_id: Nack TASK_ID_REUSED, no effect")
def task_id_reused(ctx: Ctx) -> None:
    command, _ = ctx.execute()
    reused = Sleep(task_id=command.task_id, epoch=command.epoch, level=1)
    ctx.nack(ctx.request(reused), reused, NackReason.TASK_ID_REUSED)
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "the refused Sleep took effect",
        sent=reused,
        got=status,
        expected="Status: ACTIVE, nothing asleep",
    )


# ============================================================================ P-4 ALREADY


@case("P-4", "sleep_already", "Sleep of tags all asleep: Ack ALREADY, no effect, worker serving")
def sleep_already(ctx: Ctx) -> None:
    _, first = ctx.sleep(1)
    ctx.check(first.status is AckStatus.OK, "the first Sleep was not status OK", got=first)
    again = ctx.cmd(Sleep, "again", level=1)
    reply = ctx.request(again)
    already = ctx.ack(reply, again, state=first.state, status=AckStatus.ALREADY)
    ctx.check(
        set(already.asleep_tags) == set(first.asleep_tags),
        "the ALREADY Sleep changed the asleep tags",
        sent=again,
        got=already,
        expected=first.asleep_tags,
    )
    one_tag = ctx.cmd(Sleep, "one-tag", level=1, tags=(ctx.worker.tags[0],))
    ctx.ack(ctx.request(one_tag), one_tag, state=first.state, status=AckStatus.ALREADY)
    status = ctx.status()
    ctx.check(status.state is first.state, f"after ALREADY the worker is {status.state.value}", got=status)
    ctx.back_to_active()


@case("P-4", "wake_already", "Wake of tags all resident: Ack ALREADY, still ACTIVE and executing")
def wake_already(ctx: Ctx) -> None:
    wake = ctx.cmd(Wake)
    ctx.ack(ctx.request(wake), wake, state=WorkerState.ACTIVE, status=AckStatus.ALREADY)
    one_tag = ctx.cmd(Wake, "one-tag", tags=(ctx.worker.tags[0],))
    ctx.ack(ctx.request(one_tag), one_tag, state=WorkerState.ACTIVE, status=AckStatus.ALREADY)
    ctx.executed_or_runner_error(*ctx.execute())


@case(
    "P-4",
    "second_shutdown",
    "a second Shutdown: Ack ALREADY, or no reply from a process that exited cleanly; never a crash",
    scope="consume",
)
def second_shutdown(ctx: Ctx) -> None:
    peer = ctx.worker
    first, second = ctx.cmd(Shutdown, "first"), ctx.cmd(Shutdown, "second")
    peer.send(first)
    # Back to back, so it is usually queued before the first completes; on a loaded machine the
    # worker may already have answered the first and closed its socket, which is allowed too.
    second_delivered = peer.send_unless_gone(second)
    ctx.ack(peer.reply(first.task_id, sent=first), first, state=WorkerState.STOPPED, status=AckStatus.OK)
    replies = peer.collect(ctx.options.quiet_s)
    code = peer.process.wait(ctx.options.exit_timeout_s)
    answers = [m for m in replies if getattr(m, "task_id", None) == second.task_id] if second_delivered else []
    if answers:
        ctx.ack(answers[0], second, state=WorkerState.STOPPED, status=AckStatus.ALREADY)
    else:
        ctx.check(
            code is not None,
            f"the second Shutdown got no reply and the process is still running "
            f"{ctx.options.exit_timeout_s:g} s after the first Ack",
            sent=second,
            got=None,
            expected="Ack ALREADY, or a clean exit",
        )
    ctx.check(
        code in (0, None),
        f"the process exited with code {code} after Shutdown",
        sent=[first, second],
        got=f"exit code {code}",
        expected="exit code 0",
    )


# ============================================================================ P-6 fencing


@case("P-6", "stale_epoch_refused", "a command from an older epoch: Nack STALE_EPOCH, no effect")
def stale_epoch_refused(ctx: Ctx) -> None:
    old = ctx.worker.epoch - 1
    for command in (
        ctx.cmd(Status, epoch=old),
        ctx.cmd(Sleep, epoch=old, level=1),
        ctx.cmd(Execute, epoch=old, payload=ctx.options.execute_payload),
    ):
        ctx.nack(ctx.request(command), command, NackReason.STALE_EPOCH)
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "a Sleep from an older epoch took effect",
        got=status,
        expected="Status: ACTIVE, nothing asleep",
    )


@case("P-6", "newer_epoch_adopted", "a command from a newer epoch is served and the old epoch is then stale")
def newer_epoch_adopted(ctx: Ctx) -> None:
    old = ctx.worker.epoch
    newer = ctx.cmd(Status, epoch=old + 1)
    reply = ctx.ack(ctx.request(newer), newer)
    ctx.check(reply.epoch == old + 1, f"the reply carries epoch {reply.epoch}", sent=newer, got=reply)
    stale = ctx.cmd(Status, epoch=old)
    ctx.nack(ctx.request(stale), stale, NackReason.STALE_EPOCH)


# ============================================================================ P-7 execution


@case("P-7", "execute_in_active", "Execute in ACTIVE runs (Result, or the runner's EXECUTE_ERROR)")
def execute_in_active(ctx: Ctx) -> None:
    ctx.executed_or_runner_error(*ctx.execute())


@case("P-7", "execute_refused_sleeping", "Execute while SLEEPING: Nack INVALID_STATE naming the state")
def execute_refused_sleeping(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    command, reply = ctx.execute()
    ctx.nack(reply, command, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    ctx.back_to_active()


@case(
    "P-7",
    "execute_refused_partial",
    "Execute with some tags asleep: Nack INVALID_STATE naming the state",
    needs=(PARTIAL_WAKE,),
)
def execute_refused_partial(ctx: Ctx) -> None:
    tags = ctx.worker.tags
    if len(tags) < 2:
        ctx.skip(f"the worker has one tag ({tags[0]}); a partial wake needs two")
    ctx.sleep(1)
    first = WEIGHTS if WEIGHTS in tags else tags[0]
    _, woke = ctx.wake(tags=(first,))
    ctx.check(
        woke.state is not WorkerState.ACTIVE and bool(woke.asleep_tags),
        f"a Wake of {first!r} alone left nothing asleep",
        got=woke,
    )
    command, reply = ctx.execute()
    ctx.nack(reply, command, NackReason.INVALID_STATE, state=woke.state, names_state=True)
    ctx.back_to_active()


# ============================================================================ P-8 level 2


@case(
    "P-8",
    "level2_wake_needs_reload",
    "after a level-2 sleep a Wake ends in NEEDS_RELOAD; nothing runs until ReloadWeights",
    needs=(LEVEL2,),
)
def level2_wake_needs_reload(ctx: Ctx) -> None:
    if WEIGHTS not in ctx.worker.tags:
        ctx.skip(f"the worker has no {WEIGHTS!r} tag, so no weights to reload")
    ctx.sleep(2)
    command, reply = ctx.execute()
    ctx.nack(reply, command, NackReason.INVALID_STATE, names_state=True)
    wake, woke = ctx.wake()
    ctx.check(
        woke.state is WorkerState.NEEDS_RELOAD,
        f"Wake after a level-2 sleep ended in {woke.state.value}",
        sent=wake,
        got=woke,
        expected="Ack with state NEEDS_RELOAD",
    )
    command, reply = ctx.execute()
    ctx.nack(reply, command, NackReason.INVALID_STATE, state=WorkerState.NEEDS_RELOAD, names_state=True)
    reload = ctx.cmd(ReloadWeights)
    ctx.ack(ctx.request(reload), reload, state=WorkerState.ACTIVE)
    ctx.executed_or_runner_error(*ctx.execute())


@case(
    "P-8",
    "level2_refused_without_capability",
    "no 'level2' declared: Sleep(level=2) is refused UNSUPPORTED, no effect",
    unless=(LEVEL2,),
)
def level2_refused_without_capability(ctx: Ctx) -> None:
    command = ctx.cmd(Sleep, level=2)
    ctx.nack(ctx.request(command), command, NackReason.UNSUPPORTED)
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "the refused Sleep took effect",
        sent=command,
        got=status,
    )


# ============================================================================ P-10 bad bytes


def _msgpack(obj: Any) -> bytes:
    return msgspec.msgpack.encode(obj)


def _garbage(ctx: Ctx) -> list[tuple[str, bytes, str]]:
    """(what, bytes, task_id the refusal must carry)."""
    epoch = ctx.worker.epoch
    hello = Hello(task_id="conf-bad-hello", epoch=epoch, rank=0, pid=1, device="cpu", backend="x", tags=("weights",))
    return [
        ("an empty frame", b"", "-"),
        ("one zero byte", b"\x00", "-"),
        ("bytes that are not msgpack", b"\xc1\xc1 not msgpack at all \xff", "-"),
        ("truncated msgpack", encode(ctx.cmd(Status))[:-3], "-"),
        ("a msgpack array", _msgpack([1, 2, 3]), "-"),
        ("a map naming no known type", _msgpack({"type": "Explode", "v": PROTOCOL_VERSION}), "-"),
        ("a Sleep without task_id and epoch", _msgpack({"type": "Sleep", "v": PROTOCOL_VERSION}), "-"),
        (
            "a Sleep of level 3",
            _msgpack({"type": "Sleep", "v": PROTOCOL_VERSION, "task_id": "conf-bad-level", "epoch": epoch, "level": 3}),
            "conf-bad-level",
        ),
        (
            "a Status with an unknown field",
            _msgpack(
                {
                    "type": "Status",
                    "v": PROTOCOL_VERSION,
                    "task_id": "conf-bad-field",
                    "epoch": epoch,
                    "please": "crash",
                }
            ),
            "conf-bad-field",
        ),
        ("a Hello (a reply, not a command)", encode(hello), "conf-bad-hello"),
        ("deeply nested arrays", b"\x91" * 2000 + b"\x00", "-"),
        # Issue 10: a task_id that is not UTF-8 once ended the loop with UnicodeDecodeError.
        ("a task_id that is not UTF-8", b"\x84\xa4type\xa6Status\xa1v\x01\xa5epoch\x00\xa7task_id\xa2\xff\xfe", "-"),
    ]


@case(
    "P-10",
    "garbage_then_service",
    "undecodable bytes: Nack BAD_MESSAGE (task_id when readable, else '-') "
    "saying what was wrong; the worker goes on serving",
)
def garbage_then_service(ctx: Ctx) -> None:
    peer = ctx.worker
    for what, data, task_id in _garbage(ctx):
        peer.send_raw(data, task_id)
        reply = peer.next_message(sent=data)
        sent = f"{what}: {data[:48]!r}{'...' if len(data) > 48 else ''}"
        ctx.nack(reply, sent, NackReason.BAD_MESSAGE, task_id=task_id)
        ctx.check(bool(reply.detail.strip()), "the refusal's detail is empty", sent=sent, got=reply)
        status = ctx.status()  # still serving, and nothing changed
        ctx.check(
            status.state is WorkerState.ACTIVE and not status.asleep_tags,
            f"after {what} the worker is not ACTIVE with every tag resident",
            sent=sent,
            got=status,
        )
    ctx.executed_or_runner_error(*ctx.execute())


# ============================================================================ P-13 bounded input


@case("P-13", "epoch_far_ahead_refused", "an epoch far ahead: Nack EPOCH_AHEAD, the worker's epoch unchanged")
def epoch_far_ahead_refused(ctx: Ctx) -> None:
    peer, epoch = ctx.worker, ctx.worker.epoch
    for command in (
        ctx.cmd(Status, epoch=epoch + 10_000),
        ctx.cmd(Status, epoch=2**64 - 1),
        ctx.cmd(Sleep, epoch=2**64 - 1, level=1),
    ):
        # Raw, so the harness does not adopt the refused epoch for its later commands.
        peer.send_raw(encode(command), command.task_id)
        ctx.nack(peer.reply(command.task_id, sent=command), command, NackReason.EPOCH_AHEAD)
    # Just past the window P-13 states (64), not only far past it: a wider window is a fault.
    command = ctx.cmd(Status, epoch=epoch + EPOCH_WINDOW + 1)
    peer.send_raw(encode(command), command.task_id)
    ctx.nack(peer.reply(command.task_id, sent=command), command, NackReason.EPOCH_AHEAD)
    status = ctx.status()  # at its own epoch: not fenced off by the refused one
    ctx.check(
        status.epoch == epoch and status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "after a refused far-ahead epoch the worker is not serving its own epoch, unchanged",
        got=status,
        expected=f"Status Ack at epoch {epoch}, ACTIVE, nothing asleep",
    )


@case(
    "P-13",
    "oversized_frame_refused",
    "a frame over 64 MiB: Nack BAD_MESSAGE before the answer to the next command, and the worker goes on serving",
)
def oversized_frame_refused(ctx: Ctx) -> None:
    peer = ctx.worker
    command = ctx.cmd(Execute, payload=b"\0" * (DEFAULT_MAX_FRAME_BYTES + 1))
    peer.send_raw(encode(command), "-")  # unread, so the refusal cannot name the task
    sent = f"an Execute of {DEFAULT_MAX_FRAME_BYTES + 1} payload bytes"
    # Not "nothing within a while": a worker answers in order, so the refusal comes before
    # its answer to the Status sent after the frame, however slow it is.
    status = ctx.cmd(Status)
    ctx.ack(ctx.request(status), status)
    early = peer.collect(0.0)
    want = "one Nack BAD_MESSAGE with task_id '-', before the answer to the Status sent after the frame"
    ctx.check(
        len(early) == 1,
        f"{len(early)} replies to an oversized frame before the answer to the next command",
        sent=[sent, status],
        got=early or None,
        expected=want,
    )
    reply = early[0]
    ctx.check(
        isinstance(reply, Nack) and reply.reason is NackReason.BAD_MESSAGE and reply.task_id == "-",
        "an oversized frame was not refused unread",
        sent=sent,
        got=reply,
        expected=want,
    )
    ctx.executed_or_runner_error(*ctx.execute())


@case(
    "P-13",
    "unusable_reload_source_refused",
    "ReloadWeights from a source the runner cannot use: Nack "
    "INVALID_ARGUMENT, still NEEDS_RELOAD, then a good reload works",
    needs=(LEVEL2,),
)
def unusable_reload_source_refused(ctx: Ctx) -> None:
    if WEIGHTS not in ctx.worker.tags:
        ctx.skip(f"the worker has no {WEIGHTS!r} tag, so no weights to reload")
    ctx.sleep(2)
    _, woke = ctx.wake()
    bad = ctx.cmd(ReloadWeights, source=UNUSABLE_SOURCE)
    reply = ctx.request(bad)
    if isinstance(reply, Ack):
        ctx.skip("the runner accepted a reload source no runner can use; it may treat every source as its own")
    ctx.nack(reply, bad, NackReason.INVALID_ARGUMENT, state=woke.state)
    ctx.back_to_active()


@case(
    "P-13",
    "reload_refused_in_active_no_effect",
    "ReloadWeights from an unusable source in ACTIVE: Nack "
    "INVALID_ARGUMENT, still ACTIVE, and Execute's output unchanged (nothing was written)",
)
def reload_refused_in_active_no_effect(ctx: Ctx) -> None:
    first_run, first = ctx.execute()
    ctx.executed_or_runner_error(first_run, first)
    bad = ctx.cmd(ReloadWeights, source=UNUSABLE_SOURCE)
    reply = ctx.request(bad)
    if isinstance(reply, Ack):
        ctx.skip("the runner accepted a reload source no runner can use; it may treat every source as its own")
    ctx.nack(reply, bad, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    last_run, last = ctx.execute()
    ctx.executed_or_runner_error(last_run, last)
    if isinstance(first, Result):
        ctx.check(
            isinstance(last, Result) and last.output == first.output,
            "Execute's output changed across the refused reload: it wrote the weights before refusing the source",
            sent=[first_run, bad, last_run],
            got=last,
            expected=first,
        )


# ============================================================================ P-14 authenticated ranks


@case(
    "P-14",
    "hello_proof",
    "a worker given a rank secret proves its Hello (HMAC over stage, rank, epoch, pid, identity)",
    scope="own",
)
def hello_proof(ctx: Ctx) -> None:
    (peer,) = ctx.own_harness().start([0], epoch=ctx.options.epoch)
    secret = peer.process.rank_secret
    if secret is None:
        ctx.skip("the factory started the process itself, so the suite could not give it a rank secret")
    hello = peer.hello
    assert hello is not None and peer.identity is not None
    expected = "proof = hello_proof(secret, stage, rank, epoch, pid, socket identity)"
    sent = f"(nothing: started as rank 0 with {RANK_SECRET_ENV} set in its environment)"
    ctx.check(bool(hello.proof), "the Hello carries no proof", sent=sent, got=hello, expected=expected)
    ok = verify_hello_proof(
        secret,
        hello.proof,
        stage=hello.stage,
        rank=hello.rank,
        epoch=hello.epoch,
        pid=hello.pid,
        identity=peer.identity,
    )
    ctx.check(
        ok,
        "the Hello's proof does not verify with the secret the worker was given",
        sent=sent,
        got=hello,
        expected=expected,
    )
    ctx.check(
        hello.rank == 0 and hello.epoch == ctx.options.epoch,
        "the Hello names another rank or epoch than the worker was started with",
        got=hello,
    )
    started = peer.process.pid
    if started is not None and os.path.isdir("/proc"):
        ctx.check(
            _descends_from(hello.pid, started),
            f"the Hello names pid {hello.pid}, which is neither the "
            f"process the suite started ({started}) nor one of its descendants: a valid proof over another "
            "process's pid",
            sent=sent,
            got=hello,
            expected=f"pid {started} or a descendant",
        )


def _descends_from(pid: int, ancestor: int) -> bool:
    """Whether `pid` is `ancestor` or a process below it (Linux /proc; a factory may start
    the worker through a shell or a launcher)."""
    for _ in range(64):  # a bound on the walk: a launcher chain is never that deep
        if pid == ancestor:
            return True
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])  # ppid: after the command name
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


# ============================================================================ P-11 no half-applied


@case("P-11", "invalid_state_no_effect", "ReloadWeights while SLEEPING: Nack INVALID_STATE naming the state, no effect")
def invalid_state_no_effect(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    reload = ctx.cmd(ReloadWeights)
    reply = ctx.request(reload)
    if LEVEL2 not in ctx.worker.capabilities and isinstance(reply, Nack) and reply.reason is NackReason.UNSUPPORTED:
        pass  # a worker without level 2 may refuse ReloadWeights as unsupported
    else:
        ctx.nack(reply, reload, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    status = ctx.status()
    ctx.check(
        status.state is slept.state and set(status.asleep_tags) == set(slept.asleep_tags),
        "the refused ReloadWeights changed the state or the asleep tags",
        sent=reload,
        got=status,
        expected=f"state {slept.state.value}, asleep {list(slept.asleep_tags)}",
    )
    command, reply = ctx.execute()
    ctx.nack(reply, command, NackReason.INVALID_STATE, state=slept.state)
    ctx.back_to_active()


@case("P-11", "unknown_tag_no_effect", "Sleep naming an unknown tag among known ones: Nack UNKNOWN_TAG, nothing sleeps")
def unknown_tag_no_effect(ctx: Ctx) -> None:
    command = ctx.cmd(Sleep, level=1, tags=(*ctx.worker.tags, "conformance-no-such-tag"))
    ctx.nack(ctx.request(command), command, NackReason.UNKNOWN_TAG, state=WorkerState.ACTIVE)
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "the refused Sleep took effect",
        sent=command,
        got=status,
    )


# ============================================================================ P-12 memory reports


def _report(ctx: Ctx, ack: Ack, sent: Command) -> Any:
    memory = ack.memory
    ctx.check(memory is not None, f"the Ack of {type(sent).__name__} carries no memory report", sent=sent, got=ack)
    tags = set(ctx.worker.tags)
    for side in ("pool_bytes_before", "pool_bytes_after"):
        have = set(getattr(memory, side))
        ctx.check(tags <= have, f"{side} lacks tag(s) {sorted(tags - have)}", sent=sent, got=ack)
    ctx.check(bool(memory.process_bytes_source.strip()), "process_bytes_source is empty", sent=sent, got=ack)
    figures = (memory.process_bytes_before, memory.process_bytes_after)
    if memory.process_bytes_source == "nvml":
        ctx.check(None not in figures, "the source says nvml but a process figure is missing", sent=sent, got=ack)
    return memory


@case(
    "P-12",
    "sleep_wake_reports",
    "Status, Sleep and Wake Acks report pool bytes per tag and the process "
    "figure's source; a slept tag's pool is empty when the Ack is sent",
)
def sleep_wake_reports(ctx: Ctx) -> None:
    status_cmd = ctx.cmd(Status)
    _report(ctx, ctx.ack(ctx.request(status_cmd), status_cmd), status_cmd)
    sleep, slept = ctx.sleep(1)
    memory = _report(ctx, slept, sleep)
    resident_before = {t for t in ctx.worker.tags if memory.pool_bytes_before[t] > 0}
    for tag in slept.asleep_tags:
        ctx.check(
            memory.pool_bytes_after.get(tag) == 0,
            f"the Sleep Ack reports {memory.pool_bytes_after.get(tag)} "
            f"bytes still in the pool of asleep tag {tag!r}: acknowledged before the memory was released",
            sent=sleep,
            got=slept,
            expected=f"pool_bytes_after[{tag!r}] == 0",
        )
    wake, woke = ctx.wake()
    memory = _report(ctx, woke, wake)
    for tag in resident_before:
        ctx.check(
            memory.pool_bytes_after.get(tag, 0) > 0,
            f"the Wake Ack reports an empty pool for tag {tag!r}",
            sent=wake,
            got=woke,
            expected=f"pool_bytes_after[{tag!r}] > 0",
        )
    if woke.state is WorkerState.NEEDS_RELOAD:
        ctx.back_to_active()


@case("P-12", "reload_report", "level-2 Sleep, Wake and ReloadWeights Acks carry memory reports", needs=(LEVEL2,))
def reload_report(ctx: Ctx) -> None:
    if WEIGHTS not in ctx.worker.tags:
        ctx.skip(f"the worker has no {WEIGHTS!r} tag, so no weights to reload")
    sleep, slept = ctx.sleep(2)
    memory = _report(ctx, slept, sleep)
    for tag in slept.asleep_tags:
        ctx.check(
            memory.pool_bytes_after.get(tag) == 0,
            f"the level-2 Sleep Ack reports bytes in the pool of asleep tag {tag!r}",
            sent=sleep,
            got=slept,
        )
    wake, woke = ctx.wake()
    _report(ctx, woke, wake)
    reload = ctx.cmd(ReloadWeights)
    reloaded = ctx.ack(ctx.request(reload), reload, state=WorkerState.ACTIVE)
    _report(ctx, reloaded, reload)


# ============================================================================ P-1 one reply


@case("P-1", "copies_back_to_back", "copies of a command sent back to back: never a different or an extra reply")
def copies_back_to_back(ctx: Ctx) -> None:
    peer = ctx.worker
    sleep = ctx.cmd(Sleep, level=1)
    for _ in range(3):
        peer.send(sleep)
    first = ctx.ack(peer.reply(sleep.task_id, sent=sleep), sleep)
    rest = [m for m in peer.collect(ctx.options.quiet_s) if getattr(m, "task_id", None) == sleep.task_id]
    ctx.check(
        all(m == first for m in rest),
        "copies of one Sleep got different replies",
        sent=sleep,
        got=rest,
        expected=f"at most 2 more copies of {first!r}",
    )
    ctx.check(len(rest) <= 2, f"three copies got {1 + len(rest)} replies", sent=sleep, got=rest)
    ctx.back_to_active()


@case(
    "P-1",
    "one_reply_per_rank",
    "two ranks, one task each command: exactly one terminal reply per (task, "
    "rank), Shutdown included, then each process exits",
    scope="consume",
)
def one_reply_per_rank(ctx: Ctx) -> None:
    # Rank 0 is the shared worker (one start fewer); rank 1 joins it on the same socket.
    epoch = ctx.worker.epoch
    peers = [ctx.worker, *ctx.worker.harness.start((1,), epoch)]
    payload = ctx.options.execute_payload
    n = itertools.count()
    sent: list[Command] = []
    for cls, fields in (
        (Status, {}),
        (Sleep, {"level": 1}),
        (Wake, {}),
        (Execute, {"payload": payload}),
        (Shutdown, {}),
    ):
        command = cls(task_id=ctx.task(f"{cls.__name__.lower()}{next(n)}"), epoch=epoch, **fields)
        sent.append(command)
        for peer in peers:  # one task id, sent to every rank, as a stage does
            peer.send(command)
        for peer in peers:
            reply = peer.reply(command.task_id, sent=command)
            ctx.check(
                getattr(reply, "rank", None) == peer.rank,
                f"the reply of rank {peer.rank} names rank {getattr(reply, 'rank', None)}",
                sent=command,
                got=reply,
            )
            if cls is not Execute:
                ctx.ack(reply, command)
    for peer in peers:
        extra = peer.collect(ctx.options.quiet_s)
        ctx.check(
            not extra,
            f"rank {peer.rank} sent more than one reply per task",
            sent=sent,
            got=extra,
            expected="nothing more",
        )
        code = peer.process.wait(ctx.options.exit_timeout_s)
        ctx.check(
            code == 0,
            f"rank {peer.rank} "
            + ("is still running" if code is None else f"exited with code {code}")
            + f" {ctx.options.exit_timeout_s:g} s after acknowledging Shutdown",
            got=peer.process.output_tail() or None,
            expected="a clean exit, code 0",
        )


@case(
    "P-1",
    "no_stray_replies",
    "over the whole run, no reply beyond one per command copy, no second Hello",
    scope="global",
)
def no_stray_replies(ctx: Ctx) -> None:
    ctx.check(
        not ctx.stray_note,
        "a worker sent a message that answers no command it was sent",
        got=ctx.stray_note,
        expected="one terminal reply per (task_id, rank)",
    )


# ============================================================================ what implementers get wrong
# Cases added from the issue-17 audit: each closes an escape of a plausible worker bug that
# passed every case above (the mutants in tests/conformance/mutants.py show each is caught).

UNKNOWN_TAG = "conformance-no-such-tag"
# Answers a worker must still hold a copy of: 64 newer tasks is far inside any sane cache
# (the default keeps 1024), and far outside a toy one.
NEWER_TASKS = 64


@case(
    "P-2",
    "status_keeps_reply_cache",
    "a Status between a command and its copy changes nothing: the copy still gets the first reply",
)
def status_keeps_reply_cache(ctx: Ctx) -> None:
    for first in (ctx.sleep(1), ctx.wake()):
        command, reply = first
        status = ctx.status_exchange()[0]
        again = ctx.request(command)
        ctx.check(
            again == reply,
            f"a copy of an answered {type(command).__name__}, sent after a Status, got a "
            "different reply: the Status emptied or changed the reply cache",
            sent=[command, status, command],
            got=again,
            expected=reply,
        )
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "a copy of an answered Wake took effect again after a Status",
        got=status,
        expected="Status: ACTIVE, nothing asleep",
    )


@case(
    "P-2",
    "duplicate_after_64_newer",
    f"a copy of a Sleep answered {NEWER_TASKS} tasks ago: the first reply, no second effect",
)
def duplicate_after_64_newer(ctx: Ctx) -> None:
    sleep, slept = ctx.sleep(1)
    ctx.wake()
    for _ in range(NEWER_TASKS):  # Executes: an answer that must be kept (no second run)
        ctx.executed_or_runner_error(*ctx.execute())
    again = ctx.request(sleep)
    ctx.check(
        again == slept,
        f"a copy of a Sleep answered {NEWER_TASKS + 1} tasks earlier got a different reply: "
        f"the reply cache keeps fewer than the {NEWER_TASKS} latest answers",
        sent=sleep,
        got=again,
        expected=slept,
    )
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "a copy of an early Sleep took effect a second time",
        sent=sleep,
        got=status,
        expected="Status: ACTIVE, nothing asleep",
    )


@case(
    "P-11", "status_no_effect", "Status while asleep changes nothing: same state and asleep tags, Execute still refused"
)
def status_no_effect(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    statuses = [ctx.status_exchange()[0] for _ in range(2)]  # each checked against the answer before it
    command, reply = ctx.execute()
    ctx.check(
        isinstance(reply, Nack) and reply.reason is NackReason.INVALID_STATE,
        "an Execute after two Statuses of a sleeping worker was not refused: a Status woke it",
        sent=[*statuses, command],
        got=reply,
        expected=f"Nack INVALID_STATE in {slept.state.value}",
    )
    ctx.back_to_active()


@case(
    "P-11", "wake_unknown_tag_refused", "Wake naming an unknown tag, awake or asleep: Nack UNKNOWN_TAG, nothing wakes"
)
def wake_unknown_tag_refused(ctx: Ctx) -> None:
    alone = ctx.cmd(Wake, "alone", tags=(UNKNOWN_TAG,))
    ctx.nack(ctx.request(alone), alone, NackReason.UNKNOWN_TAG, state=WorkerState.ACTIVE)
    _, slept = ctx.sleep(1)
    mixed = ctx.cmd(Wake, "mixed", tags=(*ctx.worker.tags, UNKNOWN_TAG))
    ctx.nack(ctx.request(mixed), mixed, NackReason.UNKNOWN_TAG, state=slept.state)
    status = ctx.status()
    ctx.check(
        set(status.asleep_tags) == set(slept.asleep_tags),
        "the refused Wake woke tags",
        sent=mixed,
        got=status,
        expected=f"asleep {sorted(slept.asleep_tags)}",
    )
    ctx.back_to_active()


@case(
    "P-12",
    "status_while_asleep_shows_release",
    "a Status while asleep reports the asleep tags' pools "
    "empty (released, not just reported so); after a Wake they are full again",
)
def status_while_asleep_shows_release(ctx: Ctx) -> None:
    sleep, slept = ctx.sleep(1)
    command, ack = ctx.status_exchange()
    memory = _report(ctx, ack, command)
    for tag in slept.asleep_tags:
        held = (memory.pool_bytes_before.get(tag), memory.pool_bytes_after.get(tag))
        ctx.check(
            held == (0, 0),
            f"a Status while asleep reports {max(h or 0 for h in held)} bytes in the pool of "
            f"asleep tag {tag!r}: the Sleep was acknowledged before its memory was released",
            sent=[sleep, command],
            got=ack,
            expected=f"pool_bytes_before/after[{tag!r}] == 0",
        )
    ctx.back_to_active()
    command, ack = ctx.status_exchange()
    memory = _report(ctx, ack, command)
    for tag in slept.asleep_tags:
        ctx.check(
            memory.pool_bytes_after.get(tag, 0) > 0,
            f"a Status after the Wake reports an empty pool for tag {tag!r}",
            sent=command,
            got=ack,
            expected=f"pool_bytes_after[{tag!r}] > 0",
        )


def _claims_nvml(source: str) -> bool:
    """'nvml', or 'before: nvml; after: ...': a figure said to come from NVML."""
    parts = (p.strip().removeprefix("before:").removeprefix("after:").strip() for p in source.split(";"))
    return any(p.split(":")[0].strip().lower() == "nvml" for p in parts)


@case(
    "P-12",
    "cpu_figure_not_nvml",
    "a worker on the CPU never labels a figure as NVML's (NVML lists no CPU "
    "process: such a figure is device- or host-wide)",
)
def cpu_figure_not_nvml(ctx: Ctx) -> None:
    device = ctx.worker.hello.device if ctx.worker.hello else ""
    if not device.lower().startswith("cpu"):
        ctx.skip(
            f"the worker runs on {device!r}; over the wire a process's own figure cannot be told from a "
            "device-wide one there"
        )
    exchanges: list[tuple[Command, Ack]] = [ctx.status_exchange(), ctx.sleep(1), ctx.wake()]
    for command, ack in exchanges:
        source = ack.memory.process_bytes_source if ack.memory else ""
        ctx.check(
            not _claims_nvml(source),
            f"a worker on device {device!r} labels its process figure "
            f"{source!r}: NVML sees no process on the CPU, so the figure is someone else's",
            sent=command,
            got=ack,
            expected="a source naming the fallback, e.g. 'none: no CUDA'",
        )
    if exchanges[-1][1].state is WorkerState.NEEDS_RELOAD:
        ctx.back_to_active()


def _shutdown_cleanly(ctx: Ctx, peer: Peer, where: str) -> None:
    """Shutdown in state `where`: one Ack STOPPED, then exit status 0."""
    command = ctx.cmd(Shutdown, peer=peer)
    try:
        ctx.ack(ctx.request(command, peer), command, state=WorkerState.STOPPED, status=AckStatus.OK)
    except CaseFailure as failure:
        failure.problem = f"Shutdown in {where}: {failure.problem}"
        failure.args = (failure.problem,)
        raise
    code = peer.process.wait(ctx.options.exit_timeout_s)
    ctx.check(
        code == 0,
        f"Shutdown in {where}: the worker "
        + ("is still running" if code is None else f"exited with code {code}")
        + f" {ctx.options.exit_timeout_s:g} s after acknowledging it",
        sent=command,
        got=peer.process.output_tail() or None,
        expected="a clean exit, code 0",
    )


@case(
    "P-11",
    "shutdown_while_asleep",
    "Shutdown from SLEEPING and from NEEDS_RELOAD (or PARTIAL): Ack STOPPED, then a clean exit",
    scope="consume",
)
def shutdown_while_asleep(ctx: Ctx) -> None:
    rank0 = ctx.worker
    (rank1,) = rank0.harness.start((1,), rank0.epoch)
    _, slept = ctx.sleep(1, peer=rank0)
    caps, tags = rank1.capabilities, rank1.tags
    if LEVEL2 in caps and WEIGHTS in tags:
        ctx.sleep(2, peer=rank1)
        _, settled = ctx.wake(peer=rank1)
    elif PARTIAL_WAKE in caps and len(tags) > 1:
        ctx.sleep(1, peer=rank1)
        _, settled = ctx.wake(peer=rank1, tags=(tags[0],))
    else:
        _, settled = ctx.sleep(1, peer=rank1)
    _shutdown_cleanly(ctx, rank0, slept.state.value)
    _shutdown_cleanly(ctx, rank1, settled.state.value)


@case(
    "P-11",
    "shutdown_from_failed",
    "a worker whose start-up failed greets FAILED, refuses work with Nack "
    "FAILED naming why, and leaves FAILED by Shutdown: Ack STOPPED, clean exit",
    scope="own",
)
def shutdown_from_failed(ctx: Ctx) -> None:
    if ctx.failing_factory is None:
        ctx.skip(
            "no failing worker to start: name one whose start-up fails (it greets in FAILED) with "
            "--failing-worker TARGET or SuiteOptions(failing_worker=...)"
        )
    (peer,) = ctx.own_harness().start([0], ctx.options.epoch, factory=ctx.failing_factory, state=WorkerState.FAILED)
    assert peer.hello is not None
    ctx.check(
        bool(peer.hello.detail.strip()),
        "a worker greeting in FAILED does not say why",
        got=peer.hello,
        expected="Hello state FAILED with a detail naming the failure",
    )
    status = ctx.status(peer)
    ctx.check(
        status.state is WorkerState.FAILED and bool(status.detail.strip()),
        "Status of a FAILED worker does not say FAILED and why",
        got=status,
        expected="Ack state FAILED, detail naming the failure",
    )
    for command in (ctx.cmd(Execute, peer=peer, payload=ctx.options.execute_payload), ctx.cmd(Sleep, peer=peer)):
        ctx.nack(ctx.request(command, peer), command, NackReason.FAILED, state=WorkerState.FAILED)
    _shutdown_cleanly(ctx, peer, "FAILED")


def run_wide(c: Case) -> bool:
    """A check over the whole run's record, not of one requirement's cases: it always runs."""
    return c.scope == "global"


REQUIREMENT_ORDER = tuple(f"P-{n}" for n in range(1, 19))
_SCOPE_ORDER = {"shared": 0, "own": 1, "consume": 2, "global": 3}


def ordered_cases() -> list[Case]:
    """Shared-worker cases first, then own-worker ones, the Shutdown, and the run-wide check."""
    return sorted(CASES, key=lambda c: _SCOPE_ORDER[c.scope])
