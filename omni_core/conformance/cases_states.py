"""The cases of what each state allows: Execute only in ACTIVE (P-7), and the level-2 sleep
that must end in NEEDS_RELOAD until ReloadWeights (P-8)."""

from __future__ import annotations

from omni_core.conformance.cases import LEVEL2, PARTIAL_WAKE, WEIGHTS, Ctx, case
from omni_core.protocol import (
    NackReason,
    ReloadWeights,
    Sleep,
    WorkerState,
)

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
