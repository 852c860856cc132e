"""The P-17 cases of where an update is legal and which version every reply names, one per
rule: the Hello of a fresh worker names no version (rule 2); an update is accepted in PARTIAL
with 'weights' awake and in NEEDS_RELOAD, refused with 'weights' asleep (rule 1); a reload
brings the version back to 0 (rule 2); every Result, Nack and Ack after an update names it
(rule 2); names, shapes, dtypes and senders are checked before anything is written (rule 4);
a wake after an update restores the update, never the weights before it (rule 5); ShareWeights
only with valid weights awake (rule 9).

The updates that must succeed take the worker's own weights back (`ShareWeights`), or those
weights with every tensor's elements reversed (`weight_copies`), which the suite writes into
host buckets of its own: weights that differ, of the model's own shapes, without a trainer.
"""

from __future__ import annotations

from omni_core.conformance.cases import LEVEL2, PARTIAL_WAKE, WEIGHTS, Ctx, case
from omni_core.conformance.cases_weights import (
    SHARE_BUCKET_BYTES,
    WEIGHT_UPDATE,
    _self_update,
    _version,
    share_weights,
)
from omni_core.conformance.weight_copies import (
    GONE_PID,
    NotHostBuckets,
    from_gone_sender,
    other_dtype,
    reversed_weights,
    with_tensor,
)
from omni_core.protocol import (
    Ack,
    Execute,
    Message,
    NackReason,
    ReloadWeights,
    Result,
    ShareWeights,
    ShmSource,
    UpdateWeights,
    WorkerState,
)


def _other_tags(ctx: Ctx) -> tuple[str, ...]:
    """The worker's tags beside 'weights': PARTIAL needs 'weights' and at least one other."""
    others = tuple(t for t in ctx.worker.tags if t != WEIGHTS)
    if WEIGHTS not in ctx.worker.tags or not others:
        ctx.skip(f"the worker's tags {list(ctx.worker.tags)} have no 'weights' beside another tag, so no PARTIAL")
    return others


def _share(ctx: Ctx, state: WorkerState = WorkerState.ACTIVE) -> Ack:
    return share_weights(ctx, state)


def _update(ctx: Ctx, version: int, source: object, state: WorkerState, what: str = "") -> Ack:
    update = ctx.cmd(UpdateWeights, what or f"v{version}", version=version, source=source)
    done = ctx.ack(ctx.request(update), update, state=state)
    _names_version(ctx, update, done, version)
    return done


def _names_version(ctx: Ctx, sent: object, reply: Message, version: int) -> None:
    held = getattr(reply, "weights_version", None)
    ctx.check(
        held == version,
        f"the {type(reply).__name__} names weights version {held}; it must name {version}, the version held",
        sent=sent,
        got=reply,
        expected=f"{type(reply).__name__} with weights_version {version}",
    )


def _reload(ctx: Ctx, state: WorkerState) -> Ack:
    reload = ctx.cmd(ReloadWeights)
    done = ctx.ack(ctx.request(reload), reload, state=state)
    _names_version(ctx, reload, done, 0)
    return done


@case(
    "P-17",
    "hello_names_no_version",
    "a worker just started holds its runner's own weights: its Hello MUST name weights version 0 (rule 2)",
)
def hello_names_no_version(ctx: Ctx) -> None:
    hello = ctx.worker.hello
    ctx.check(
        hello is not None and hello.weights_version == 0,
        f"the Hello of a worker just started names weights version {getattr(hello, 'weights_version', None)}",
        sent=f"(nothing: started as rank {ctx.worker.rank})",
        got=hello,
        expected="Hello with weights_version 0 (left off the wire): no update has been taken",
    )


@case(
    "P-17",
    "update_in_partial_weights_awake",
    "'weight_update' and 'partial_wake' declared: after a sleep and a wake of 'weights' alone (PARTIAL, "
    "weights resident), UpdateWeights MUST be acknowledged in PARTIAL at its version (rule 1)",
    needs=(WEIGHT_UPDATE, PARTIAL_WAKE),
)
def update_in_partial_weights_awake(ctx: Ctx) -> None:
    _other_tags(ctx)
    first = ctx.execute()
    current = _version(ctx)
    shared = _share(ctx)
    ctx.sleep(1)
    _, woke = ctx.wake(tags=(WEIGHTS,))
    ctx.check(woke.state is WorkerState.PARTIAL, f"a wake of 'weights' alone ended in {woke.state.value}", got=woke)
    _update(ctx, current + 1, shared.shared, WorkerState.PARTIAL)
    ctx.back_to_active()
    _names_version(ctx, "Status", ctx.status(), current + 1)
    ctx.same_output(first, "after an update of the weights it held, taken in PARTIAL")


@case(
    "P-17",
    "update_refused_weights_asleep",
    "'weight_update' and 'partial_wake' declared: in PARTIAL with 'weights' asleep (another tag woken), "
    "UpdateWeights MUST be refused INVALID_STATE naming the state; the tags and the version unchanged (rule 1)",
    needs=(WEIGHT_UPDATE, PARTIAL_WAKE),
)
def update_refused_weights_asleep(ctx: Ctx) -> None:
    others = _other_tags(ctx)
    current = _version(ctx)
    shared = _share(ctx)
    ctx.sleep(1)
    _, woke = ctx.wake(tags=others)
    update = ctx.cmd(UpdateWeights, version=current + 1, source=shared.shared)
    ctx.nack(ctx.request(update), update, NackReason.INVALID_STATE, state=woke.state, names_state=True)
    status = ctx.status()
    ctx.check(
        set(status.asleep_tags) == set(woke.asleep_tags) and (status.weights_version or 0) == current,
        "the refused UpdateWeights changed the asleep tags or the version",
        sent=update,
        got=status,
        expected=f"asleep {sorted(woke.asleep_tags)}, version {current}",
    )
    ctx.back_to_active()


@case(
    "P-17",
    "update_in_needs_reload",
    "'weight_update' and 'level2' declared: after a level-2 sleep and a wake (NEEDS_RELOAD), UpdateWeights "
    "MUST replace the reload: acknowledged ACTIVE at its version, Execute's output that of the weights sent (rule 1)",
    needs=(WEIGHT_UPDATE, LEVEL2),
)
def update_in_needs_reload(ctx: Ctx) -> None:
    first = ctx.execute()
    current = _version(ctx)
    shared = _share(ctx)
    ctx.sleep(2)
    _, woke = ctx.wake()
    ctx.check(woke.state is WorkerState.NEEDS_RELOAD, f"a wake after a level-2 sleep ended in {woke.state.value}")
    _update(ctx, current + 1, shared.shared, WorkerState.ACTIVE)
    ctx.same_output(first, "after an update in NEEDS_RELOAD with the weights it held before the sleep")


@case(
    "P-17",
    "reload_resets_version",
    "'weight_update' and 'level2' declared: after an update, ReloadWeights in ACTIVE brings the runner's own "
    "weights back and MUST name version 0 (Ack and Status); after another update, a level-2 sleep's wake "
    "names the version held last in NEEDS_RELOAD, and the reload names 0 again (rule 2)",
    needs=(WEIGHT_UPDATE, LEVEL2),
)
def reload_resets_version(ctx: Ctx) -> None:
    current = _version(ctx)
    _self_update(ctx, current + 1)
    _reload(ctx, WorkerState.ACTIVE)
    _names_version(ctx, "Status", ctx.status(), 0)
    _self_update(ctx, current + 2)
    ctx.sleep(2)
    wake, woke = ctx.wake()
    ctx.check(woke.state is WorkerState.NEEDS_RELOAD, f"a wake after a level-2 sleep ended in {woke.state.value}")
    _names_version(ctx, wake, woke, current + 2)
    _reload(ctx, WorkerState.ACTIVE)
    _names_version(ctx, "Status", ctx.status(), 0)


@case(
    "P-17",
    "replies_name_the_version",
    "'weight_update' declared: after an update, the Ack of Status, Execute's Result, the Nack of an Execute "
    "while SLEEPING and that of an UpdateWeights from an older epoch (STALE_EPOCH) MUST all name the version "
    "(rules 2, 6)",
    needs=(WEIGHT_UPDATE,),
)
def replies_name_the_version(ctx: Ctx) -> None:
    version = _version(ctx) + 1
    update, _ = _self_update(ctx, version)
    _names_version(ctx, "Status", ctx.status(), version)
    run, result = ctx.execute()
    ctx.executed_or_runner_error(run, result)
    _names_version(ctx, run, result, version)
    old = ctx.cmd(UpdateWeights, "old-epoch", version=version + 1, source=update.source, epoch=ctx.worker.epoch - 1)
    _names_version(ctx, old, ctx.nack(ctx.request(old), old, NackReason.STALE_EPOCH), version)
    ctx.sleep(1)
    asleep = ctx.cmd(Execute, "asleep", payload=ctx.options.execute_payload)
    _names_version(ctx, asleep, ctx.nack(ctx.request(asleep), asleep, NackReason.INVALID_STATE), version)
    ctx.back_to_active()
    _names_version(ctx, "Status", ctx.status(), version)


def _first_result(ctx: Ctx) -> tuple[Execute, Result]:
    run, reply = ctx.execute()
    ctx.executed_or_runner_error(run, reply)
    if not isinstance(reply, Result):
        ctx.skip(
            "Execute gives no Result with this payload, so its output cannot tell the weights apart; pass one "
            "your model accepts (--payload)"
        )
    assert isinstance(reply, Result)
    return run, reply


@case(
    "P-17",
    "wake_after_update_restores_it",
    "'weight_update' declared, host buckets shared: after a sleep and wake, an update to weights that differ (each "
    "tensor's elements reversed) changes Execute's output; a level-1 sleep and wake then MUST restore the update, not "
    "the weights before it (rule 5); taking the worker's own weights back restores the first output",
    needs=(WEIGHT_UPDATE,),
)
def wake_after_update_restores_it(ctx: Ctx) -> None:
    first = _first_result(ctx)
    current = _version(ctx)
    own = _share(ctx).shared
    ctx.sleep(1)  # a backend that keeps a host copy of the weights has made one now
    ctx.back_to_active()
    try:
        with reversed_weights(own) as changed:
            _update(ctx, current + 1, changed, WorkerState.ACTIVE, "reversed")
            run, reply = ctx.execute()
            ctx.check(
                isinstance(reply, Result) and reply.output != first[1].output,
                "an update to weights with every tensor's elements reversed was acknowledged, but Execute's output "
                "did not change: the update was not written (or the output does not depend on the weights)",
                sent=[first[0], run],
                got=reply,
                expected="a Result whose output differs from the one before the update",
            )
            updated = (run, reply)
            ctx.sleep(1)
            ctx.back_to_active()
            ctx.same_output(updated, "across a level-1 sleep after an update: the wake restored other weights")
    except NotHostBuckets as exc:
        ctx.skip(str(exc))
    _update(ctx, current + 2, own, WorkerState.ACTIVE, "own")
    ctx.same_output(first, "after the worker's own weights were taken back")


@case(
    "P-17",
    "update_checked_before_writing",
    "'weight_update' declared, host buckets shared: UpdateWeights naming a tensor the model lacks, one of "
    "another shape, one of another dtype, or a bucket whose sender does not run MUST be refused INVALID_ARGUMENT "
    "naming the tensor or the sender, still ACTIVE; the version and Execute's output unchanged (rule 4)",
    needs=(WEIGHT_UPDATE,),
)
def update_checked_before_writing(ctx: Ctx) -> None:
    first = ctx.execute()
    ctx.executed_or_runner_error(*first)
    current = _version(ctx)
    own = _share(ctx).shared
    if not isinstance(own, ShmSource):
        ctx.skip(f"the worker shared its weights as {type(own).__name__}, not host buckets (shm)")
    assert isinstance(own, ShmSource)
    spec = own.buckets[0].tensors[0]
    shape = (*spec.shape, 1) if len(spec.shape) < 8 else spec.shape[:-1]
    changed = [
        with_tensor(own, name="omni-conformance-no-such-tensor"),
        with_tensor(own, shape=shape),
        with_tensor(own, dtype=other_dtype(spec.dtype)),
    ]
    sources = [(source, tensor.name) for source, tensor in changed] + [(from_gone_sender(own), str(GONE_PID))]
    for source, named in sources:
        update = ctx.cmd(UpdateWeights, version=current + 1, source=source)
        refused = ctx.nack(ctx.request(update), update, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
        ctx.check(
            named in refused.detail,
            f"the refusal's detail does not name {named}",
            sent=update,
            got=refused,
            expected=f"a detail naming {named}",
        )
        _names_version(ctx, update, refused, current)
    _names_version(ctx, "Status", ctx.status(), current)
    ctx.same_output(first, "after updates refused before writing")


@case(
    "P-17",
    "share_needs_weights_awake",
    "'weight_update' and 'partial_wake' declared: ShareWeights in PARTIAL with 'weights' awake is acknowledged "
    "in PARTIAL with its buckets; while SLEEPING, and in PARTIAL with 'weights' asleep, it MUST be refused "
    "INVALID_STATE naming the state, nothing wakes (rule 9)",
    needs=(WEIGHT_UPDATE, PARTIAL_WAKE),
)
def share_needs_weights_awake(ctx: Ctx) -> None:
    others = _other_tags(ctx)
    ctx.sleep(1)
    ctx.wake(tags=(WEIGHTS,))
    _share(ctx, WorkerState.PARTIAL)
    ctx.back_to_active()
    _, slept = ctx.sleep(1)
    for what in ("sleeping", "weights-asleep"):
        if what != "sleeping":
            _, slept = ctx.wake(tags=others)
        share = ctx.cmd(ShareWeights, what, bucket_bytes=SHARE_BUCKET_BYTES)
        ctx.nack(ctx.request(share), share, NackReason.INVALID_STATE, state=slept.state, names_state=True)
        status = ctx.status()
        ctx.check(
            set(status.asleep_tags) == set(slept.asleep_tags),
            "the refused ShareWeights woke a tag",
            sent=share,
            got=status,
            expected=f"asleep {sorted(slept.asleep_tags)}",
        )
    ctx.back_to_active()
