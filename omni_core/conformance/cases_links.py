"""The P-18 cases (a Sleep or Wake with a link plan), in their own module so they register
after the others (`omni_core.conformance` imports it).

A worker that does not declare 'multi_path' must refuse any plan, its own link alone
included, with UNSUPPORTED and no effect. One that declares it must end a planned Sleep and
Wake exactly where the same commands without a plan end: the state, the asleep tags, the pool
bytes released and restored, and Execute's output. The plan the suite sends uses the worker's
own link and each peer its Hello lists in `relay_peers`, as an orchestrator's planner would.
"""

from __future__ import annotations

from omni_core.conformance.cases import Ctx, case
from omni_core.protocol import NackReason, Sleep, Wake, WorkerState
from omni_core.protocol.messages import LinkShare

MULTI_PATH = "multi_path"  # the capability of a worker that takes link plans (P-18)
OWN_LINK = (LinkShare(peer=None, share=1.0),)  # the smallest plan: the rank's own host link


@case(
    "P-18",
    "links_refused_without_multi_path",
    "no 'multi_path' declared: a Sleep with a link plan (its own link alone) is refused UNSUPPORTED, nothing "
    "sleeps; asleep, a Wake with that plan is refused UNSUPPORTED, nothing wakes",
    unless=(MULTI_PATH,),
)
def links_refused_without_multi_path(ctx: Ctx) -> None:
    planned = ctx.cmd(Sleep, "planned", level=1, links=OWN_LINK)
    ctx.nack(ctx.request(planned), planned, NackReason.UNSUPPORTED, state=WorkerState.ACTIVE)
    status = ctx.status()
    ctx.check(
        status.state is WorkerState.ACTIVE and not status.asleep_tags,
        "the refused Sleep with a link plan put tags to sleep",
        sent=planned,
        got=status,
        expected="ACTIVE, nothing asleep",
    )
    ctx.executed_or_runner_error(*ctx.execute())
    _, slept = ctx.sleep(1)
    wake = ctx.cmd(Wake, "planned", links=OWN_LINK)
    ctx.nack(ctx.request(wake), wake, NackReason.UNSUPPORTED, state=slept.state)
    status = ctx.status()
    ctx.check(
        status.state is slept.state and set(status.asleep_tags) == set(slept.asleep_tags),
        "the refused Wake with a link plan woke tags",
        sent=wake,
        got=status,
        expected=f"{slept.state.value}, asleep {sorted(slept.asleep_tags)}",
    )
    ctx.back_to_active()


@case(
    "P-18",
    "links_leave_what_the_command_leaves",
    "'multi_path' declared: a level-1 Sleep and a Wake planned over the worker's own link and each of its "
    "relay_peers end as the same commands without a plan: SLEEPING with every pool at 0, then ACTIVE with every "
    "pool back at its bytes, Execute's output unchanged",
    needs=(MULTI_PATH,),
)
def links_leave_what_the_command_leaves(ctx: Ctx) -> None:
    hello = ctx.worker.hello
    peers = tuple(hello.relay_peers) if hello is not None else ()
    plan = OWN_LINK + tuple(LinkShare(peer=p, share=1.0) for p in peers)
    first = ctx.execute()
    _, plain = ctx.sleep(1)
    ctx.back_to_active()
    _, planned = ctx.sleep(1, links=plan)
    for what, ack in (("plain", plain), ("planned", planned)):
        memory = ack.memory
        ctx.check(
            memory is not None and not any(memory.pool_bytes_after.values()),
            f"the {what} Sleep left pool bytes resident",
            got=ack,
            expected="every pool at 0 after a level-1 Sleep of every tag",
        )
    ctx.check(
        planned.state is plain.state and set(planned.asleep_tags) == set(plain.asleep_tags),
        "the planned Sleep ended elsewhere than the plain one",
        got=planned,
        expected=plain,
    )
    wake, woke = ctx.wake(links=plan)
    ctx.check(woke.state is WorkerState.ACTIVE, f"the planned Wake ended in {woke.state.value}", sent=wake, got=woke)
    before = planned.memory.pool_bytes_before if planned.memory else {}
    after = woke.memory.pool_bytes_after if woke.memory else {}
    ctx.check(after == before, "the planned Wake restored other pool bytes than the Sleep released", got=woke)
    ctx.same_output(first, "across a sleep and wake planned over more links")
