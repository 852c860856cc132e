"""The cases of what a command does: never half applied (P-11), the memory it reports
(P-12), and exactly one reply per command and rank (P-1)."""

from __future__ import annotations

import itertools

from omni_core.conformance.cases import LEVEL2, WEIGHTS, Ctx, case
from omni_core.protocol import (
    Ack,
    Command,
    Execute,
    MemoryReport,
    Nack,
    NackReason,
    ReloadWeights,
    Shutdown,
    Sleep,
    Status,
    Wake,
    WorkerState,
)

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


def memory_report(ctx: Ctx, ack: Ack, sent: Command) -> MemoryReport:
    memory = ack.memory
    ctx.check(memory is not None, f"the Ack of {type(sent).__name__} carries no memory report", sent=sent, got=ack)
    assert memory is not None
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
    memory_report(ctx, ctx.ack(ctx.request(status_cmd), status_cmd), status_cmd)
    sleep, slept = ctx.sleep(1)
    memory = memory_report(ctx, slept, sleep)
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
    memory = memory_report(ctx, woke, wake)
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
    memory = memory_report(ctx, slept, sleep)
    for tag in slept.asleep_tags:
        ctx.check(
            memory.pool_bytes_after.get(tag) == 0,
            f"the level-2 Sleep Ack reports bytes in the pool of asleep tag {tag!r}",
            sent=sleep,
            got=slept,
        )
    wake, woke = ctx.wake()
    memory_report(ctx, woke, wake)
    reload = ctx.cmd(ReloadWeights)
    reloaded = ctx.ack(ctx.request(reload), reload, state=WorkerState.ACTIVE)
    memory_report(ctx, reloaded, reload)


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
