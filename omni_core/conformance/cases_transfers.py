"""The P-22 cases (stage-to-stage transfers): the rules a worker keeps whatever its runner's
connector exports or imports. They move no tensors, so they hold for any model: an export or a
landing is refused asleep naming the state, a release is taken in every settled state and a
copy gets the same answer, a landing declared for another producer version or naming a tensor
the connector does not take is refused with nothing kept, as is an export of a name it lacks."""

from __future__ import annotations

import os

from omni_core.conformance.cases import Ctx, case
from omni_core.protocol import (
    Bucket,
    NackReason,
    ShmSource,
    TensorSpec,
    TransferIn,
    TransferOut,
    TransferRelease,
    WorkerState,
)

TRANSFER = "transfer"  # the capability a worker declares when it answers the transfer commands
ABSENT = "conformance_absent"  # a connector name no runner of the suite's declares
REQUEST = "conformance-request"


def _source(name: str) -> ShmSource:
    """Buckets nobody made (the file does not exist): every refusal below comes before a handle opens."""
    spec = TensorSpec(name=name, dtype="float32", shape=(1, 4))
    bucket = Bucket(
        handle=f"/dev/shm/omni-weights-{os.getpid()}-00000000-0", nbytes=16, sender_pid=os.getpid(), tensors=(spec,)
    )
    return ShmSource(buckets=(bucket,))


@case(
    "P-22",
    "transfer_refused_asleep_released_anywhere",
    "after a level-1 sleep (SLEEPING): TransferOut is refused INVALID_STATE naming the state; TransferRelease "
    "of a request nothing is held for is acknowledged in SLEEPING, and a copy gets the same Ack",
    needs=(TRANSFER,),
)
def transfer_refused_asleep_released_anywhere(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    out = ctx.cmd(TransferOut, "asleep", request_id=REQUEST, names=(ABSENT,))
    ctx.nack(ctx.request(out), out, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    release = ctx.cmd(TransferRelease, "release-asleep", request_id=REQUEST)
    first = ctx.ack(ctx.request(release), release, state=slept.state)
    copy = ctx.request(release)
    ctx.check(copy == first, "a copy of the answered TransferRelease got another answer", sent=release, got=copy)
    ctx.back_to_active()


@case(
    "P-22",
    "transfer_refused_before_anything_is_kept",
    "in ACTIVE: a TransferIn declared for another producer version is refused INVALID_ARGUMENT naming both "
    "versions; one naming a tensor the connector does not import, and a TransferOut of a name it does not "
    "export, are refused INVALID_ARGUMENT naming it; still ACTIVE and serving; from an older epoch: STALE_EPOCH",
    needs=(TRANSFER,),
)
def transfer_refused_before_anything_is_kept(ctx: Ctx) -> None:
    other = ctx.cmd(
        TransferIn, "other-version", request_id=REQUEST, producer_version=7, expect_version=3, source=_source(ABSENT)
    )
    nack = ctx.nack(ctx.request(other), other, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    ctx.check(
        "3" in nack.detail and "7" in nack.detail, "the refusal does not name both versions", sent=other, got=nack
    )
    for command in (
        ctx.cmd(TransferIn, "absent-in", request_id=REQUEST, producer_version=0, source=_source(ABSENT)),
        ctx.cmd(TransferOut, "absent-out", request_id=REQUEST, names=(ABSENT,)),
    ):
        refused = ctx.nack(ctx.request(command), command, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
        ctx.check(ABSENT in refused.detail, "the refusal does not name the tensor", sent=command, got=refused)
    ctx.executed_or_runner_error(*ctx.execute())  # serving on
    stale = ctx.cmd(TransferRelease, "stale", request_id=REQUEST, epoch=ctx.worker.epoch - 1)
    ctx.nack(ctx.request(stale), stale, NackReason.STALE_EPOCH)
