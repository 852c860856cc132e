"""The P-16 cases (a Wake that waits for free device memory, `NO_MEMORY`), in their own
module so they register after the others (`omni_core.conformance` imports it).

Every worker gets the two compatibility cases (the v1 `Wake` frame still works; a waiting
`Wake` to a worker without 'swap' is refused with no effect). A worker that declares 'swap'
gets the waiting wake's Ack and cache, a swap's outgoing `Sleep` (`incoming_bytes`) answered
as any sleep, and, where a memory-pressure hook can fill its device
(`omni_core.conformance.pressure`), the refusal and its rollback.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec

from omni_core.conformance.cases import Ctx, case
from omni_core.conformance.harness import Peer
from omni_core.protocol import PROTOCOL_VERSION, Ack, AckStatus, Nack, NackReason, Wake, WorkerState

SWAP = "swap"  # the capability a worker declares when a Wake may wait for memory (P-16)
# A wait the suite's workers, which run with room, never use up; and one a squeezed device
# makes run out quickly. Both far below the 3600 s the field allows.
ROOMY_WAIT_S = 5.0
SHORT_WAIT_S = 0.3
# How long a squeezed worker must stay silent on a wake that may wait LONG_WAIT_S: an answer
# inside it either mapped past the device (Ack) or gave up before its time (Nack).
LONG_WAIT_S = 60.0


def _v1_wake(task_id: str, epoch: int) -> bytes:
    """A Wake exactly as a worker that predates P-16 knows it: no memory_wait_s key."""
    return msgspec.msgpack.encode(
        {"type": "Wake", "v": PROTOCOL_VERSION, "task_id": task_id, "epoch": epoch, "tags": None}
    )


@case(
    "P-16",
    "v1_wake_frame",
    "a Wake frame without memory_wait_s (the frame of every v1 worker) wakes a sleeping worker as before",
)
def v1_wake_frame(ctx: Ctx) -> None:
    peer = ctx.worker
    ctx.sleep(1)
    wake = ctx.cmd(Wake, "v1")  # what the raw frame says, to check the answer against
    peer.send_raw(_v1_wake(wake.task_id, wake.epoch), wake.task_id)
    woke = ctx.ack(peer.reply(wake.task_id, sent=wake), wake)
    ctx.check(
        woke.state is WorkerState.ACTIVE,
        f"the v1 Wake of every tag ended in {woke.state.value}",
        sent=wake,
        got=woke,
        expected="Ack with state ACTIVE",
    )
    ctx.executed_or_runner_error(*ctx.execute())


@case(
    "P-16",
    "waiting_wake_refused_without_swap",
    "no 'swap' declared: a Wake with memory_wait_s > 0 is "
    "refused UNSUPPORTED (BAD_MESSAGE naming the field from a worker that predates it), nothing wakes",
    unless=(SWAP,),
)
def waiting_wake_refused_without_swap(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    command = ctx.cmd(Wake, "waits", memory_wait_s=ROOMY_WAIT_S)
    reply = ctx.request(command)
    predates = isinstance(reply, Nack) and reply.reason is NackReason.BAD_MESSAGE and "memory_wait_s" in reply.detail
    if not predates:
        ctx.nack(reply, command, NackReason.UNSUPPORTED, state=slept.state)
    status = ctx.status()
    ctx.check(
        status.state is slept.state and set(status.asleep_tags) == set(slept.asleep_tags),
        "the refused waiting Wake woke tags",
        sent=command,
        got=status,
        expected=f"{slept.state.value}, asleep {sorted(slept.asleep_tags)}",
    )
    ctx.back_to_active()


@case(
    "P-16",
    "waiting_wake_acked_and_cached",
    "'swap' declared, memory free: a Wake with memory_wait_s > 0 "
    "is acknowledged ACTIVE; its copy gets the same Ack; the task_id with another wait is TASK_ID_REUSED",
    needs=(SWAP,),
)
def waiting_wake_acked_and_cached(ctx: Ctx) -> None:
    ctx.sleep(1)
    wake = ctx.cmd(Wake, "waits", memory_wait_s=ROOMY_WAIT_S)
    woke = ctx.ack(ctx.request(wake), wake, state=WorkerState.ACTIVE, status=AckStatus.OK)
    again = ctx.request(wake)
    ctx.check(
        again == woke, "a copy of an answered waiting Wake got a different reply", sent=wake, got=again, expected=woke
    )
    other = msgspec.structs.replace(wake, memory_wait_s=ROOMY_WAIT_S + 1)
    ctx.nack(ctx.request(other), other, NackReason.TASK_ID_REUSED)
    ctx.executed_or_runner_error(*ctx.execute())


@case(
    "P-16",
    "outgoing_sleep_hint",
    "'swap' declared: a Sleep with incoming_bytes (a swap's outgoing half) is acknowledged SLEEPING with "
    "every pool released, as any sleep; its copy gets the same Ack; the wake restores Execute's output",
    needs=(SWAP,),
)
def outgoing_sleep_hint(ctx: Ctx) -> None:
    first_run, first = ctx.execute()
    sleep, slept = ctx.sleep(1, incoming_bytes=1 << 20)  # room for it on any device the suite runs on
    ctx.check(
        slept.state is WorkerState.SLEEPING and slept.status is AckStatus.OK,
        f"a level-1 Sleep of every tag, told what a swap's incoming stage wakes, ended in {slept.state.value}",
        sent=sleep,
        got=slept,
        expected="Ack with state SLEEPING, status OK",
    )
    held = {t: n for t, n in slept.memory.pool_bytes_after.items() if n} if slept.memory else {}
    ctx.check(not held, f"the Sleep's Ack says pools still hold {held}", sent=sleep, got=slept, expected="0 bytes")
    again = ctx.request(sleep)
    ctx.check(again == slept, "a copy of the Sleep got a different reply", sent=sleep, got=again, expected=slept)
    ctx.back_to_active()
    ctx.same_output((first_run, first), "across a sleep told incoming_bytes")


@case(
    "P-16",
    "no_memory_rolls_back",
    "a device held by another process: a waiting Wake is refused NO_MEMORY "
    "naming the holder, back in SLEEPING with the pools released, the refusal cached (also once memory is "
    "free); a Wake that may wait goes on only once the memory is given back, and Execute's output is "
    "unchanged",
    scope="own",
)
def no_memory_rolls_back(ctx: Ctx) -> None:
    if ctx.pressure_factory is None:
        ctx.skip(
            "no memory-pressure hook to fill the worker's device: give one with --memory-pressure "
            "package.module:factory or SuiteOptions(memory_pressure=...) (docs/conformance.md)"
        )
    with contextlib.closing(ctx.pressure_factory()) as pressure:
        (peer,) = ctx.own_harness().start([0], ctx.options.epoch, factory=pressure.worker)
        if SWAP not in peer.capabilities:
            ctx.skip(f"worker does not declare capability {SWAP!r}")
        first_run, first = ctx.execute(peer)
        ctx.executed_or_runner_error(first_run, first)
        sleep, slept = ctx.sleep(1, peer)
        memory = slept.memory
        ctx.check(memory is not None, "the Sleep Ack carries no memory report", sent=sleep, got=slept)
        assert memory is not None
        needed_bytes = sum(memory.pool_bytes_before.get(t, 0) for t in slept.asleep_tags)
        # Room for part of the wake: what it maps before it runs out must be unmapped again.
        holder = pressure.squeeze(needed_bytes // 2)
        wake, refused = _refused_after_its_wait(ctx, peer, slept, holder)
        _rolled_back(ctx, peer, slept, wake)
        _refusal_kept(ctx, peer, slept, wake, refused, pressure)
        pressure.squeeze(needed_bytes // 2)
        _waits_for_memory(ctx, peer, needed_bytes, pressure)
        ctx.same_output((first_run, first), "across the refused wake: the host copies did not stay valid", peer)


def _refused_after_its_wait(ctx: Ctx, peer: Peer, slept: Ack, holder: str) -> tuple[Wake, Nack]:
    """A squeezed wake is refused NO_MEMORY, not before its wait is over, naming the holder."""
    wake = ctx.cmd(Wake, "squeezed", peer=peer, memory_wait_s=SHORT_WAIT_S)
    sent_at_s = time.monotonic()
    refused = ctx.nack(ctx.request(wake, peer), wake, NackReason.NO_MEMORY, state=slept.state)
    waited_s = time.monotonic() - sent_at_s  # at least the worker's wait: it answers after it
    ctx.check(
        waited_s >= SHORT_WAIT_S,
        f"refused NO_MEMORY after {waited_s:.3f} s of a {SHORT_WAIT_S:g} s "
        "wait: the memory could have been given back in the time left",
        sent=wake,
        got=refused,
        expected=f"no refusal before {SHORT_WAIT_S:g} s",
    )
    ctx.check(
        not holder or holder in refused.detail,
        f"the NO_MEMORY detail does not name the holder ({holder})",
        sent=wake,
        got=refused,
        expected=f"a detail naming {holder}",
    )
    return wake, refused


def _rolled_back(ctx: Ctx, peer: Peer, slept: Ack, wake: Wake) -> None:
    """After the refusal the worker is where the Wake found it, its asleep pools unmapped."""
    status_cmd, status = ctx.status_exchange(peer)
    ctx.check(
        status.state is slept.state and set(status.asleep_tags) == set(slept.asleep_tags),
        "after the NO_MEMORY refusal the worker is not where the Wake found it",
        sent=[wake, status_cmd],
        got=status,
        expected=f"{slept.state.value}, asleep {sorted(slept.asleep_tags)}",
    )
    kept = {t: status.memory.pool_bytes_after.get(t, 0) for t in slept.asleep_tags} if status.memory else {}
    ctx.check(
        status.memory is not None and not any(kept.values()),
        f"after the NO_MEMORY refusal the pools "
        f"of asleep tags still hold {kept}: the wake did not unmap what it mapped",
        sent=[wake, status_cmd],
        got=status,
        expected="pool_bytes_after 0 for every asleep tag",
    )


def _refusal_kept(ctx: Ctx, peer: Peer, slept: Ack, wake: Wake, refused: Nack, pressure: Any) -> None:
    """A copy of the refused Wake gets the recorded refusal, even once memory is free."""
    again = ctx.request(wake, peer)
    ctx.check(
        again == refused, "a copy of the refused Wake got a different reply", sent=wake, got=again, expected=refused
    )
    pressure.relieve()
    later = ctx.request(wake, peer)  # the memory is there now: still the recorded refusal, no effect
    ctx.check(
        later == refused,
        "a copy of the refused Wake, sent once the memory was free, got a different "
        "reply: the refusal was not kept in the reply cache",
        sent=wake,
        got=later,
        expected=refused,
    )
    status = ctx.status(peer)
    ctx.check(
        status.state is slept.state,
        f"a copy of the refused Wake took effect ({status.state.value})",
        sent=wake,
        got=status,
        expected=slept.state.value,
    )


def _waits_for_memory(ctx: Ctx, peer: Peer, needed_bytes: int, pressure: Any) -> None:
    """A wake that may wait is not answered while memory is short, and wakes once it frees."""
    waiting = ctx.cmd(Wake, "waits", peer=peer, memory_wait_s=LONG_WAIT_S)
    peer.send(waiting)
    early = [m for m in peer.collect(ctx.options.quiet_s) if getattr(m, "task_id", None) == waiting.task_id]
    ctx.check(
        not early,
        f"a Wake that may wait {LONG_WAIT_S:g} s was answered while the device had only "
        f"{needed_bytes // 2} of the {needed_bytes} bytes it needs free: it mapped past the device (Ack) "
        "or did not wait (Nack)",
        sent=waiting,
        got=early,
        expected="no answer until the memory is given back",
    )
    pressure.relieve()
    ctx.ack(peer.reply(waiting.task_id, sent=waiting), waiting, state=WorkerState.ACTIVE, status=AckStatus.OK)
