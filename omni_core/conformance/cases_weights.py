"""The P-17 cases (versioned weight updates), in their own module so they register after the
others (`omni_core.conformance` imports it).

A worker that does not declare 'weight_update' gets one case: an UpdateWeights is refused
UNSUPPORTED with no effect. A worker that declares it gets the version fence (STALE_VERSION
naming both versions), the state fence (INVALID_STATE while SLEEPING; with 'host_refit', the
update into the host copy instead, and INVALID_STATE after a level-2 sleep), a disk source it cannot
read refused INVALID_ARGUMENT before anything is written, and the reply cache. The suite needs
no trainer for an update that succeeds: the worker shares its own weights (ShareWeights) and
takes them back as the next version, so Execute's output must not change.
"""

from __future__ import annotations

from omni_core.conformance.cases import UNUSABLE_SOURCE, Ctx, case
from omni_core.protocol import (
    Ack,
    DiskSource,
    Nack,
    NackReason,
    ShareWeights,
    UpdateWeights,
    WorkerState,
)

WEIGHT_UPDATE = "weight_update"  # the capability a worker declares when it takes UpdateWeights (P-17)
HOST_REFIT = "host_refit"  # ... and UpdateWeights into its host copy while the weights sleep (P-17 rule 10)
SHARE_BUCKET_BYTES = 64 << 20  # small buckets: the suite's workers are small, and so is the host
# A checkpoint directory that no worker can have: UpdateWeights from disk must refuse it.
MISSING_PATH = "/nonexistent/omni-core-conformance/no-checkpoint-here"


def _version(ctx: Ctx) -> int:
    status = ctx.status()
    return status.weights_version or 0


def share_weights(ctx: Ctx, state: WorkerState | None = None) -> Ack:
    """ShareWeights acknowledged (in `state`, when given) with the buckets it filled."""
    share = ctx.cmd(ShareWeights, bucket_bytes=SHARE_BUCKET_BYTES)
    shared = ctx.ack(ctx.request(share), share, state=state)
    ctx.check(
        shared.shared is not None,
        "ShareWeights was acknowledged without the buckets it filled",
        sent=share,
        got=shared,
        expected="Ack with `shared` listing the buckets",
    )
    return shared


def _self_update(ctx: Ctx, version: int) -> tuple[UpdateWeights, Ack]:
    """The worker shares its own weights and takes them back as `version`: an update that
    must succeed without a trainer, and must leave Execute's output as it was."""
    shared = share_weights(ctx)
    update = ctx.cmd(UpdateWeights, f"v{version}", version=version, source=shared.shared)
    done = ctx.ack(ctx.request(update), update, state=WorkerState.ACTIVE)
    ctx.check(
        done.weights_version == version,
        f"the update's Ack reports weights version {done.weights_version}, not {version}",
        sent=update,
        got=done,
        expected=f"Ack with weights_version {version}",
    )
    return update, done


@case(
    "P-17",
    "update_refused_without_weight_update",
    "no 'weight_update' declared: UpdateWeights is refused "
    "UNSUPPORTED (BAD_MESSAGE from a worker that predates the message: an unknown type, P-10), nothing "
    "changes",
    unless=(WEIGHT_UPDATE,),
)
def update_refused_without_weight_update(ctx: Ctx) -> None:
    first = ctx.execute()
    update = ctx.cmd(UpdateWeights, version=1, source=DiskSource(path=MISSING_PATH))
    reply = ctx.request(update)
    known = isinstance(reply, Nack) and reply.reason is NackReason.UNSUPPORTED
    ctx.nack(reply, update, NackReason.UNSUPPORTED if known else NackReason.BAD_MESSAGE, state=WorkerState.ACTIVE)
    ctx.same_output(first, "after a refused UpdateWeights")


@case(
    "P-17",
    "stale_version_refused",
    "'weight_update' declared: an update to a version not above the "
    "worker's MUST be refused STALE_VERSION naming both versions, with no effect (rule 3): the version and "
    "Execute's output unchanged",
    needs=(WEIGHT_UPDATE,),
)
def stale_version_refused(ctx: Ctx) -> None:
    first = ctx.execute()
    ctx.executed_or_runner_error(*first)
    current = _version(ctx)
    _self_update(ctx, current + 1)
    _self_update(ctx, current + 2)
    held = current + 2
    for stale in (held, held - 1):
        update = ctx.cmd(UpdateWeights, f"stale{stale}", version=stale, source=DiskSource(path=MISSING_PATH))
        refused = ctx.nack(ctx.request(update), update, NackReason.STALE_VERSION, state=WorkerState.ACTIVE)
        ctx.check(
            str(stale) in refused.detail and str(held) in refused.detail,
            f"the STALE_VERSION detail does not name both versions ({stale} sent, {held} held)",
            sent=update,
            got=refused,
            expected=f"a detail naming {stale} and {held}",
        )
    status = ctx.status()
    ctx.check(
        status.weights_version == held,
        f"after the stale updates the worker reports weights version {status.weights_version}, not {held}",
        got=status,
        expected=held,
    )
    ctx.same_output(first, "across updates that wrote the weights it already held")


@case(
    "P-17",
    "update_refused_sleeping",
    "'weight_update' declared: UpdateWeights while SLEEPING (the weights "
    "not resident) is refused INVALID_STATE naming the state, nothing wakes, the version unchanged",
    needs=(WEIGHT_UPDATE,),
    unless=(HOST_REFIT,),
)
def update_refused_sleeping(ctx: Ctx) -> None:
    current = _version(ctx)
    _, slept = ctx.sleep(1)
    update = ctx.cmd(UpdateWeights, version=current + 1, source=DiskSource(path=MISSING_PATH))
    ctx.nack(ctx.request(update), update, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    status = ctx.status()
    ctx.check(
        status.state is slept.state
        and set(status.asleep_tags) == set(slept.asleep_tags)
        and (status.weights_version or 0) == current,
        "the refused UpdateWeights changed the state, the asleep tags or the version",
        sent=update,
        got=status,
        expected=f"{slept.state.value}, asleep {sorted(slept.asleep_tags)}, version {current}",
    )
    ctx.back_to_active()


@case(
    "P-17",
    "unreadable_disk_source_refused",
    "'weight_update' declared: UpdateWeights from a disk path that "
    "does not exist is refused INVALID_ARGUMENT, still ACTIVE, the version and Execute's output unchanged",
    needs=(WEIGHT_UPDATE,),
)
def unreadable_disk_source_refused(ctx: Ctx) -> None:
    first = ctx.execute()
    ctx.executed_or_runner_error(*first)
    current = _version(ctx)
    for path in (MISSING_PATH, UNUSABLE_SOURCE):
        update = ctx.cmd(UpdateWeights, version=current + 1, source=DiskSource(path=path))
        ctx.nack(ctx.request(update), update, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    status = ctx.status()
    ctx.check(
        (status.weights_version or 0) == current,
        f"after refused updates the worker reports weights version {status.weights_version}, not {current}",
        got=status,
        expected=current,
    )
    ctx.same_output(first, "after an UpdateWeights refused before writing")


@case(
    "P-17",
    "update_answered_from_cache",
    "'weight_update' declared: a copy of an acknowledged UpdateWeights "
    "gets the same Ack and is not applied again (no STALE_VERSION, the version unchanged); its task_id with "
    "another version is TASK_ID_REUSED",
    needs=(WEIGHT_UPDATE,),
)
def update_answered_from_cache(ctx: Ctx) -> None:
    current = _version(ctx)
    update, done = _self_update(ctx, current + 1)
    again = ctx.request(update)
    ctx.check(
        again == done,
        "a copy of an acknowledged UpdateWeights got a different reply",
        sent=update,
        got=again,
        expected=done,
    )
    other = UpdateWeights(task_id=update.task_id, epoch=update.epoch, version=current + 5, source=update.source)
    ctx.nack(ctx.request(other), other, NackReason.TASK_ID_REUSED)
    status = ctx.status()
    ctx.check(
        status.weights_version == current + 1,
        f"after the copies the worker reports weights version {status.weights_version}, not {current + 1}",
        got=status,
        expected=current + 1,
    )
    ctx.executed_or_runner_error(*ctx.execute())


def _asleep_as(ctx: Ctx, slept: Ack, version: int, what: str, sent: UpdateWeights) -> None:
    """Status says the rank is still as `slept` left it, at `version`."""
    status = ctx.status()
    ctx.check(
        status.state is slept.state
        and set(status.asleep_tags) == set(slept.asleep_tags)
        and (status.weights_version or 0) == version,
        f"{what} changed the state or the asleep tags, or left the version other than {version}",
        sent=sent,
        got=status,
        expected=f"{slept.state.value}, asleep {sorted(slept.asleep_tags)}, version {version}",
    )


@case(
    "P-17",
    "update_into_host_copy_while_sleeping",
    "'host_refit' declared: UpdateWeights while SLEEPING at level 1 is written into the host copy: "
    "Ack SLEEPING at the new version with the same tags asleep, a refused source leaves the version, "
    "and the wake restores the new version (Execute's output that of the weights written)",
    needs=(WEIGHT_UPDATE, HOST_REFIT),
)
def update_into_host_copy_while_sleeping(ctx: Ctx) -> None:
    first = ctx.execute()
    ctx.executed_or_runner_error(*first)
    current = _version(ctx)
    shared = share_weights(ctx)  # its own weights: the output after the wake must not change
    _, slept = ctx.sleep(1)
    bad = ctx.cmd(UpdateWeights, "missing", version=current + 1, source=DiskSource(path=MISSING_PATH))
    ctx.nack(ctx.request(bad), bad, NackReason.INVALID_ARGUMENT, state=slept.state)
    _asleep_as(ctx, slept, current, "an UpdateWeights refused while asleep", bad)
    update = ctx.cmd(UpdateWeights, "refit", version=current + 1, source=shared.shared)
    done = ctx.ack(ctx.request(update), update, state=slept.state)
    ctx.check(
        done.weights_version == current + 1 and set(done.asleep_tags) == set(slept.asleep_tags),
        f"the update into the host copy was acknowledged at version {done.weights_version} with tags "
        f"{sorted(done.asleep_tags)} asleep",
        sent=update,
        got=done,
        expected=f"Ack {slept.state.value}, version {current + 1}, asleep {sorted(slept.asleep_tags)}",
    )
    _asleep_as(ctx, slept, current + 1, "the update into the host copy", update)
    _, woke = ctx.wake()
    ctx.check(
        woke.state is WorkerState.ACTIVE and woke.weights_version == current + 1,
        f"the wake after the update ended {woke.state.value} at version {woke.weights_version}",
        got=woke,
        expected=f"ACTIVE at version {current + 1}",
    )
    ctx.same_output(first, "after an update of its own weights written into the host copy")


@case(
    "P-17",
    "update_refused_after_level2_sleep",
    "'host_refit' declared: after a level-2 sleep no host copy holds the weights: UpdateWeights is "
    "refused INVALID_STATE naming the state, nothing wakes, the version unchanged",
    needs=(WEIGHT_UPDATE, HOST_REFIT, "level2"),
)
def update_refused_after_level2_sleep(ctx: Ctx) -> None:
    current = _version(ctx)
    _, slept = ctx.sleep(2)
    update = ctx.cmd(UpdateWeights, version=current + 1, source=DiskSource(path=MISSING_PATH))
    ctx.nack(ctx.request(update), update, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    _asleep_as(ctx, slept, current, "an UpdateWeights refused after a level-2 sleep", update)
    ctx.back_to_active()
