"""The cases of the envelope and of repeated or out-of-date commands: what a reply carries
(P-3), what a copy of a command gets (P-2), a command with nothing left to do (P-4), and
epoch fencing (P-6)."""

from __future__ import annotations

import re

from omni_core.conformance.cases import Ctx, case
from omni_core.protocol import (
    PROTOCOL_VERSION,
    AckStatus,
    Execute,
    Hello,
    Message,
    NackReason,
    Shutdown,
    Sleep,
    Status,
    Wake,
    WorkerState,
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
    answers = [m for m in replies if isinstance(m, Message) and m.task_id == second.task_id] if second_delivered else []
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
