"""The cases of hostile input: undecodable bytes (P-10), input past the bounds a worker must
keep (P-13), and the proof a rank gives of its secret (P-14)."""

from __future__ import annotations

import os
from typing import Any

import msgspec

from omni_core.conformance.cases import EPOCH_WINDOW, LEVEL2, UNUSABLE_SOURCE, WEIGHTS, Ctx, case
from omni_core.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Execute,
    Hello,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    Sleep,
    Status,
    WorkerState,
    encode,
)
from omni_core.protocol.auth import RANK_SECRET_ENV, verify_hello_proof

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
        # A decoder that reads the task_id as text ends its loop with UnicodeDecodeError here.
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
        refusal = ctx.nack(reply, sent, NackReason.BAD_MESSAGE, task_id=task_id)
        ctx.check(bool(refusal.detail.strip()), "the refusal's detail is empty", sent=sent, got=reply)
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
