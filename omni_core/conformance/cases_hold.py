"""The P-23 cases (pause mode keep: HoldRequests). They need no capability: every worker of
version 1 that knows the command answers it. A hold with nothing running holds nothing and is
acknowledged at once, a second is ALREADY, and the release ends it; a hold is refused outside
ACTIVE naming the state. Beside a running request a hold either freezes it (a runner that
stops between its steps) or has it answered first (one that cannot, as mode `wait`): the case
accepts either and checks what each one owes, so it holds for any runner. Where the worker
declares 'weight_update', an update runs while the request may be held, and a request released
after it must name the new version and the spans of both.
"""

from __future__ import annotations

from omni_core.conformance.cases import Ctx, case
from omni_core.conformance.cases_weights import WEIGHT_UPDATE, _version, share_weights
from omni_core.protocol import (
    Ack,
    AckStatus,
    Execute,
    HoldRequests,
    Message,
    NackReason,
    Result,
    UpdateWeights,
    WorkerState,
)


def _hold(ctx: Ctx, hold: bool, status: AckStatus, version: int, what: str = "") -> Ack:
    """HoldRequests acknowledged in ACTIVE with `status`, nothing asleep, at `version`."""
    command = ctx.cmd(HoldRequests, what or ("hold" if hold else "release"), hold=hold)
    ack = ctx.ack(ctx.request(command), command, state=WorkerState.ACTIVE, status=status)
    _unchanged(ctx, command, ack, version)
    return ack


def _unchanged(ctx: Ctx, sent: HoldRequests, ack: Ack, version: int) -> None:
    ctx.check(
        not ack.asleep_tags and (ack.weights_version or 0) == version,
        f"the Ack of HoldRequests says asleep {list(ack.asleep_tags)} at weights version {ack.weights_version}: a "
        f"hold changes no residency and no version (ACTIVE, nothing asleep, version {version})",
        sent=sent,
        got=ack,
        expected=f"Ack in ACTIVE, nothing asleep, weights_version {version}",
    )


@case(
    "P-23",
    "hold_of_nothing_is_acked_then_already_until_released",
    "in ACTIVE with nothing running: HoldRequests(hold=true) is acknowledged OK in ACTIVE at the version held, "
    "a copy gets the same Ack, a second hold is ALREADY; hold=false is OK, a second release ALREADY, and a hold "
    "after the release is OK again (the release ended the first)",
)
def hold_of_nothing_is_acked_then_already_until_released(ctx: Ctx) -> None:
    version = _version(ctx)
    command = ctx.cmd(HoldRequests, "hold", hold=True)
    first = ctx.ack(ctx.request(command), command, state=WorkerState.ACTIVE, status=AckStatus.OK)
    _unchanged(ctx, command, first, version)
    copy = ctx.request(command)
    ctx.check(copy == first, "a copy of the answered HoldRequests got another answer", sent=command, got=copy)
    _hold(ctx, True, AckStatus.ALREADY, version, "hold-again")
    _hold(ctx, False, AckStatus.OK, version)
    _hold(ctx, False, AckStatus.ALREADY, version, "release-again")
    _hold(ctx, True, AckStatus.OK, version, "hold-after-release")
    _hold(ctx, False, AckStatus.OK, version, "release-last")


@case(
    "P-23",
    "hold_refused_outside_active",
    "after a level-1 sleep (SLEEPING): HoldRequests, hold=true and hold=false alike, is refused INVALID_STATE "
    "naming the state, the worker still SLEEPING; from an older epoch, in ACTIVE: STALE_EPOCH",
)
def hold_refused_outside_active(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    for hold in (True, False):
        command = ctx.cmd(HoldRequests, f"asleep-{hold}", hold=hold)
        ctx.nack(ctx.request(command), command, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    ctx.status()  # still as the Sleep left it: the refusals changed nothing
    ctx.back_to_active()
    stale = ctx.cmd(HoldRequests, "stale", hold=True, epoch=ctx.worker.epoch - 1)
    ctx.nack(ctx.request(stale), stale, NackReason.STALE_EPOCH)


def _until(ctx: Ctx, sent: dict[str, object], last: str) -> list[Message]:
    """The replies to the tasks of `sent` in the order they arrive, up to `last`'s reply."""
    arrived: list[Message] = []
    while not arrived or arrived[-1].task_id != last:
        message = ctx.worker.next_message(sent=sent[last])
        ctx.check(
            message.task_id in sent,
            f"a reply to task {message.task_id!r}, which this case did not send, came while it waited",
            sent=list(sent.values()),
            got=message,
        )
        arrived.append(message)
    return arrived


def _spans_tell(ctx: Ctx, result: Result, started: int, released: int, sent: object) -> None:
    """A request released under `released` after starting under `started`: the Result names the
    version it finished under, and its spans (if any) run from token 0, in order, to that one."""
    ctx.check(
        result.weights_version == released,
        f"the Result of the request held and released under weights version {released} names version "
        f"{result.weights_version}: it went on under {released} (P-23)",
        sent=sent,
        got=result,
        expected=f"Result with weights_version {released}",
    )
    spans = result.version_spans
    starts = [s.start_token for s in spans]
    versions = [s.weights_version for s in spans]
    # Restarted by clear_cache, its first span is the version it restarted under, not `started`.
    first = versions[0] == started or result.discarded_tokens > 0 if spans else True
    ok = not spans or (
        starts[0] == 0 and starts == sorted(starts) and versions == sorted(set(versions)) and versions[-1] == released
    )
    ctx.check(
        ok and first,
        f"the Result's version spans {[(s.weights_version, s.start_token) for s in spans]} do not say which "
        f"version computed which token: from ({started}, 0), in token order, versions rising, the last {released}",
        sent=sent,
        got=result,
        expected=f"version_spans from ({started}, 0) to ({released}, k), or none",
    )


@case(
    "P-23",
    "hold_beside_a_request_answers_it_once",
    "an Execute and a HoldRequests(hold=true) sent together: the request is answered once, before the hold's "
    "Ack (a runner that cannot freeze it) or after the release's (frozen, then resumed), never between them; "
    "with 'weight_update', an UpdateWeights between hold and release is acknowledged at the next version and a "
    "request released after it names that version, its spans from token 0 in order to it",
)
def hold_beside_a_request_answers_it_once(ctx: Ctx) -> None:
    version = _version(ctx)
    shared = share_weights(ctx, WorkerState.ACTIVE) if WEIGHT_UPDATE in ctx.worker.capabilities else None
    execute = ctx.cmd(Execute, payload=ctx.options.execute_payload)
    hold = ctx.cmd(HoldRequests, "hold", hold=True)
    ctx.worker.send(execute)
    ctx.worker.send(hold)
    before = _until(ctx, {execute.task_id: execute, hold.task_id: hold}, hold.task_id)
    held = ctx.ack(before[-1], hold, state=WorkerState.ACTIVE, status=AckStatus.OK)
    _unchanged(ctx, hold, held, version)
    released_under = version
    if shared is not None:
        update = ctx.cmd(UpdateWeights, f"v{version + 1}", version=version + 1, source=shared.shared)
        done = ctx.ack(ctx.request(update), update, state=WorkerState.ACTIVE)
        ctx.check(
            done.weights_version == version + 1,
            f"the update beside the hold is acknowledged at weights version {done.weights_version}, not {version + 1}",
            sent=update,
            got=done,
        )
        released_under = version + 1
    release = ctx.cmd(HoldRequests, "release", hold=False)
    ctx.worker.send(release)
    pending = {execute.task_id: execute, release.task_id: release}
    after = _until(ctx, pending, release.task_id)
    ctx.ack(after[-1], release, state=WorkerState.ACTIVE, status=AckStatus.OK)
    answered = [m for m in before[:-1] if m.task_id == execute.task_id]
    between = [m for m in after[:-1] if m.task_id == execute.task_id]
    ctx.check(
        not between,
        "the request was answered while it was held: between the hold's Ack and the release's (P-23)",
        sent=[execute, hold, release],
        got=between,
        expected="its answer before the hold's Ack (answered first) or after the release's (frozen)",
    )
    if answered:
        ctx.executed_or_runner_error(execute, answered[0])
        _finished_before(ctx, answered[0], version, execute)
        return
    reply = ctx.worker.reply(execute.task_id, sent=execute)
    ctx.executed_or_runner_error(execute, reply)
    if isinstance(reply, Result):
        _spans_tell(ctx, reply, version, released_under, execute)


def _finished_before(ctx: Ctx, reply: Message, version: int, sent: object) -> None:
    """A request answered before the hold's Ack ran under the version it started with, whole."""
    if isinstance(reply, Result):
        ctx.check(
            (reply.weights_version or 0) == version and not reply.version_spans,
            f"the request answered before the hold names weights version {reply.weights_version} and spans "
            f"{list(reply.version_spans)}: it ran wholly under version {version}",
            sent=sent,
            got=reply,
            expected=f"Result with weights_version {version}, no spans",
        )
