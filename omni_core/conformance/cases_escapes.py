"""Cases that each close an escape of a plausible worker bug that passed every case of the
other modules (the mutants in tests/conformance/mutants.py show each is caught): a reply
cache a Status empties or that keeps too few answers, a Status that wakes, an unknown tag
in a Wake, memory acknowledged before it is released, an NVML label on the CPU, and a
Shutdown from a state other than ACTIVE."""

from __future__ import annotations

from omni_core.conformance.cases import LEVEL2, PARTIAL_WAKE, WEIGHTS, Ctx, case
from omni_core.conformance.cases_effects import memory_report
from omni_core.conformance.harness import CaseFailure, Peer
from omni_core.protocol import (
    Ack,
    AckStatus,
    Command,
    Execute,
    Nack,
    NackReason,
    Shutdown,
    Sleep,
    Wake,
    WorkerState,
)

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
    stated = ctx.status()
    ctx.check(
        stated.state is WorkerState.ACTIVE and not stated.asleep_tags,
        "a copy of an answered Wake took effect again after a Status",
        got=stated,
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
    memory = memory_report(ctx, ack, command)
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
    memory = memory_report(ctx, ack, command)
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
