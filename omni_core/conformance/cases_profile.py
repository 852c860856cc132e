"""The P-15 cases (Profile) and the P-19 cases (ResetPrefixCache): commands that never change
the state, kept in their own module so they register after the others (`omni_core.conformance`
imports it) without touching the cases of other requirements."""

from __future__ import annotations

import os
import re

from omni_core.conformance.cases import LEVEL2, PARTIAL_WAKE, Ctx, case
from omni_core.protocol import Ack, AckStatus, NackReason, Profile, ResetPrefixCache, WorkerState

# What a worker must refuse as a file-name part (P-15): a path separator, a parent
# directory, NUL, the empty string, more than 64 characters.
BAD_PREFIXES = ("../up", "a/b", "x\0y", "", "p" * 65)
PROFILE = "profile"  # the capability a worker declares when it answers Profile
# A profiler's first start loads its libraries (torch's Kineto: seconds on a loaded machine)
# and a stop exports the trace: Profile answers get this long, not the suite's reply timeout.
PROFILE_REPLY_TIMEOUT_S = 60.0


def _name(ctx: Ctx, prefix: str) -> re.Pattern[str]:
    stage = re.escape(ctx.worker.hello.stage if ctx.worker.hello else "")
    return re.compile(rf"^{stage}-rank{ctx.worker.rank}-{re.escape(prefix)}-\d{{8}}T\d{{6}}\.\d{{6}}Z\.json\.gz$")


def _profile(
    ctx: Ctx,
    start: bool,
    prefix: str | None = None,
    *,
    state: WorkerState = WorkerState.ACTIVE,
    status: AckStatus | None = None,
) -> tuple[Profile, Ack]:
    command = ctx.cmd(Profile, "start" if start else "stop", start=start, prefix=prefix)
    reply = ctx.worker.request(command, timeout_s=max(ctx.options.reply_timeout_s, PROFILE_REPLY_TIMEOUT_S))
    return command, ctx.ack(reply, command, state=state, status=status)


@case(
    "P-15",
    "profile_start_stop_lists_traces",
    "Profile start, a second start (ALREADY), stop: the stop's Ack "
    "lists {stage}-rank{r}-{prefix}-{time}.json.gz traces; a copy gets the same Ack; a stop with none "
    "running is ALREADY with no paths",
    needs=(PROFILE,),
)
def profile_start_stop_lists_traces(ctx: Ctx) -> None:
    _profile(ctx, True, "conformance", status=AckStatus.OK)
    _profile(ctx, True, "other", status=AckStatus.ALREADY)
    ctx.executed_or_runner_error(*ctx.execute())
    stop, stopped = _profile(ctx, False, status=AckStatus.OK)
    ctx.check(
        bool(stopped.trace_paths),
        "the stop's Ack lists no trace",
        sent=stop,
        got=stopped,
        expected="trace_paths with one path per trace written",
    )
    pattern = _name(ctx, "conformance")
    for path in stopped.trace_paths:
        ctx.check(
            os.path.isabs(path) and bool(pattern.match(os.path.basename(path))),
            f"trace path {path!r} is not absolute or not named {{stage}}-rank{{r}}-{{prefix}}-{{time}}.json.gz",
            sent=stop,
            got=stopped,
            expected=pattern.pattern,
        )
    copy = ctx.request(stop)
    ctx.check(copy == stopped, "a copy of the answered stop got another reply", sent=stop, got=copy, expected=stopped)
    _, none = _profile(ctx, False, status=AckStatus.ALREADY)
    ctx.check(
        none.trace_paths == (), "a stop with no profile running lists traces", got=none, expected="trace_paths empty"
    )


@case(
    "P-15",
    "profile_keeps_sleep",
    "Profile started while ACTIVE, stopped while SLEEPING: every answer in the "
    "state the worker was in, and it stays asleep",
    needs=(PROFILE,),
)
def profile_keeps_sleep(ctx: Ctx) -> None:
    _profile(ctx, True, "sleep", status=AckStatus.OK)
    _, slept = ctx.sleep(1)
    stop, stopped = _profile(ctx, False, state=slept.state, status=AckStatus.OK)
    _still_asleep(ctx, "stop", stop, stopped, slept)
    ctx.back_to_active()


def _still_asleep(ctx: Ctx, what: str, sent: Profile, answer: Ack, slept: Ack) -> None:
    """The Profile's Ack, and a Status after it, show the worker where the Sleep left it."""
    ctx.check(
        set(answer.asleep_tags) == set(slept.asleep_tags),
        f"the {what}'s Ack reports other asleep tags than the Sleep left",
        sent=sent,
        got=answer,
        expected=list(slept.asleep_tags),
    )
    status = ctx.status()
    ctx.check(
        status.state is slept.state and set(status.asleep_tags) == set(slept.asleep_tags),
        f"the Profile {what} changed the state or the asleep tags",
        sent=sent,
        got=status,
        expected=f"{slept.state.value} with {list(slept.asleep_tags)} asleep",
    )


@case(
    "P-15",
    "profile_start_while_asleep",
    "Profile started while SLEEPING and stopped there: every answer in "
    "SLEEPING with the same asleep tags; the worker does not wake",
    needs=(PROFILE,),
)
def profile_start_while_asleep(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    start, started = _profile(ctx, True, "asleep", state=slept.state, status=AckStatus.OK)
    _still_asleep(ctx, "start", start, started, slept)
    _profile(ctx, False, state=slept.state, status=AckStatus.OK)
    ctx.back_to_active()


@case(
    "P-15",
    "profile_bad_prefix_refused",
    "Profile start with a prefix that is no safe file-name part ('../', "
    "'/', NUL, empty, 65 characters): Nack INVALID_ARGUMENT, nothing starts",
    needs=(PROFILE,),
)
def profile_bad_prefix_refused(ctx: Ctx) -> None:
    for prefix in BAD_PREFIXES:
        command = ctx.cmd(Profile, "bad", start=True, prefix=prefix)
        ctx.nack(ctx.request(command), command, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    _profile(ctx, False, status=AckStatus.ALREADY)  # nothing was started


@case(
    "P-15",
    "profile_stale_epoch_refused",
    "Profile from an older epoch: Nack STALE_EPOCH, nothing starts",
    needs=(PROFILE,),
)
def profile_stale_epoch_refused(ctx: Ctx) -> None:
    old = ctx.worker.epoch - 1
    command = ctx.cmd(Profile, epoch=old, start=True, prefix="stale")
    ctx.nack(ctx.request(command), command, NackReason.STALE_EPOCH)
    status = ctx.status()  # still serving, at its own epoch
    ctx.check(status.state is WorkerState.ACTIVE, "the worker left ACTIVE after a stale Profile", got=status)
    _profile(ctx, False, status=AckStatus.ALREADY)


@case(
    "P-19",
    "reset_prefix_cache_moves_no_memory",
    "ResetPrefixCache in ACTIVE: Ack OK in ACTIVE, pool bytes unchanged; a copy gets the same Ack; "
    "while SLEEPING: Nack INVALID_STATE naming the state",
)
def reset_prefix_cache_moves_no_memory(ctx: Ctx) -> None:
    command = ctx.cmd(ResetPrefixCache, "reset")
    ack = ctx.ack(ctx.request(command), command, state=WorkerState.ACTIVE, status=AckStatus.OK)
    memory = ack.memory
    ctx.check(
        memory is not None and memory.pool_bytes_before == memory.pool_bytes_after and not ack.asleep_tags,
        "ResetPrefixCache moved pool memory or put tags to sleep",
        sent=command,
        got=ack,
        expected="a memory report with equal pool bytes before and after, nothing asleep",
    )
    copy = ctx.request(command)
    ctx.check(copy == ack, "a copy of the answered ResetPrefixCache got another answer", sent=command, got=copy)
    _, slept = ctx.sleep(1)
    asleep = ctx.cmd(ResetPrefixCache, "reset-asleep")
    ctx.nack(ctx.request(asleep), asleep, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    ctx.back_to_active()


def _reset_keeps(ctx: Ctx, state: WorkerState, asleep: set[str], what: str) -> None:
    """ResetPrefixCache in `state`: Ack OK there, the same tags asleep, no pool byte moved."""
    command = ctx.cmd(ResetPrefixCache, what)
    ack = ctx.ack(ctx.request(command), command, state=state, status=AckStatus.OK)
    memory = ack.memory
    ctx.check(
        memory is not None and memory.pool_bytes_before == memory.pool_bytes_after and set(ack.asleep_tags) == asleep,
        f"ResetPrefixCache in {state.value} moved pool memory or changed the asleep tags",
        sent=command,
        got=ack,
        expected=f"equal pool bytes before and after, asleep {sorted(asleep)}",
    )


@case(
    "P-19",
    "reset_prefix_cache_in_partial",
    "'partial_wake' declared: after a sleep and a wake of one tag (PARTIAL), ResetPrefixCache is acknowledged "
    "OK in PARTIAL, the same tags asleep, pool bytes unchanged; from an older epoch it is refused STALE_EPOCH",
    needs=(PARTIAL_WAKE,),
)
def reset_prefix_cache_in_partial(ctx: Ctx) -> None:
    if len(ctx.worker.tags) < 2:
        ctx.skip(f"the worker has one tag ({list(ctx.worker.tags)}), so no PARTIAL")
    ctx.sleep(1)
    _, woke = ctx.wake(tags=(ctx.worker.tags[0],))
    _reset_keeps(ctx, woke.state, set(woke.asleep_tags), "partial")
    stale = ctx.cmd(ResetPrefixCache, "stale", epoch=ctx.worker.epoch - 1)
    ctx.nack(ctx.request(stale), stale, NackReason.STALE_EPOCH)
    ctx.back_to_active()
    _reset_keeps(ctx, WorkerState.ACTIVE, set(), "active")


@case(
    "P-19",
    "reset_prefix_cache_refused_needs_reload",
    "'level2' declared: after a level-2 sleep and a wake (NEEDS_RELOAD), ResetPrefixCache is refused "
    "INVALID_STATE naming the state, still NEEDS_RELOAD",
    needs=(LEVEL2,),
)
def reset_prefix_cache_refused_needs_reload(ctx: Ctx) -> None:
    ctx.sleep(2)
    _, woke = ctx.wake()
    command = ctx.cmd(ResetPrefixCache, "needs-reload")
    ctx.nack(ctx.request(command), command, NackReason.INVALID_STATE, state=woke.state, names_state=True)
    ctx.back_to_active()
