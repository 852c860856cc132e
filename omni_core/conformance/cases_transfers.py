"""The P-22 cases (stage-to-stage transfers): the rules a worker keeps whatever its runner's
connector exports or imports. They move no tensors, so they hold for any model: an export is
refused asleep naming the state, a release is taken in every settled state and a copy gets the
same answer, a landing declared for another producer version or naming a tensor the connector
does not take is refused with nothing kept, as is an export of a name it lacks, and a landing
whose source carries more than its max_bytes is refused on decode."""

from __future__ import annotations

import os
import re

import msgspec

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
    encode,
)

TRANSFER = "transfer"  # the capability a worker declares when it answers the transfer commands
ABSENT = "conformance_absent"  # a connector name no runner of the suite's declares
REQUEST = "conformance-request"
SOURCE_BYTES = 16  # what _source carries: one float32 tensor of 1 x 4


def _source(name: str) -> ShmSource:
    """Buckets nobody made (the file does not exist): every refusal below comes before a handle opens."""
    spec = TensorSpec(name=name, dtype="float32", shape=(1, 4))
    bucket = Bucket(
        handle=f"/dev/shm/omni-weights-{os.getpid()}-00000000-0",
        nbytes=SOURCE_BYTES,
        sender_pid=os.getpid(),
        tensors=(spec,),
    )
    return ShmSource(buckets=(bucket,))


def _names(detail: str, number: int) -> bool:
    """Whether `detail` names `number` as a number of its own (not a digit of a task id's)."""
    return re.search(rf"(?<!\d){number}(?!\d)", detail) is not None


@case(
    "P-22",
    "transfer_refused_asleep_released_anywhere",
    "after a level-1 sleep (SLEEPING): TransferOut is refused INVALID_STATE naming the state; TransferRelease "
    "of a request nothing is held for is acknowledged in SLEEPING, and a copy sent once ACTIVE again gets that "
    "same Ack",
    needs=(TRANSFER,),
)
def transfer_refused_asleep_released_anywhere(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    out = ctx.cmd(TransferOut, "asleep", request_id=REQUEST, names=(ABSENT,))
    ctx.nack(ctx.request(out), out, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    release = ctx.cmd(TransferRelease, "release-asleep", request_id=REQUEST)
    first = ctx.ack(ctx.request(release), release, state=slept.state)
    ctx.back_to_active()
    # Answered from the reply cache (P-2), so it still says SLEEPING: a release run again says ACTIVE.
    copy = ctx.request(release)
    ctx.check(
        copy == first,
        f"a copy of the TransferRelease answered in {slept.state.value}, sent once ACTIVE again, got another answer",
        sent=release,
        got=copy,
        expected=first,
    )


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
        _names(nack.detail, 3) and _names(nack.detail, 7),
        "the refusal does not name both versions",
        sent=other,
        got=nack,
    )
    for command in (
        ctx.cmd(TransferIn, "absent-in", request_id=REQUEST, producer_version=0, source=_source(ABSENT)),
        ctx.cmd(TransferOut, "absent-out", request_id=REQUEST, names=(ABSENT,)),
    ):
        refused = ctx.nack(ctx.request(command), command, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
        what = f"the refusal of {type(command).__name__} does not name the tensor"
        ctx.check(ABSENT in refused.detail, what, sent=command, got=refused)
    ctx.executed_or_runner_error(*ctx.execute())  # serving on
    stale = ctx.cmd(TransferRelease, "stale", request_id=REQUEST, epoch=ctx.worker.epoch - 1)
    ctx.nack(ctx.request(stale), stale, NackReason.STALE_EPOCH)


@case(
    "P-22",
    "transfer_over_its_bound_refused_on_decode",
    "in ACTIVE: a TransferIn whose source carries more bytes than its max_bytes is refused BAD_MESSAGE naming "
    "the task (refused on decode, P-10); still ACTIVE and serving",
    needs=(TRANSFER,),
)
def transfer_over_its_bound_refused_on_decode(ctx: Ctx) -> None:
    peer = ctx.worker
    landing = ctx.cmd(TransferIn, "over-bound", request_id=REQUEST, producer_version=0, source=_source(ABSENT))
    # Written by hand: the schema refuses to build a TransferIn over its bound, as a worker's decoder must.
    frame = msgspec.msgpack.decode(encode(landing))
    frame["max_bytes"] = SOURCE_BYTES - 1
    data = msgspec.msgpack.encode(frame)
    sent = f"TransferIn {landing.task_id!r} of a {SOURCE_BYTES}-byte source, max_bytes {SOURCE_BYTES - 1}"
    peer.send_raw(data, landing.task_id)
    reply = peer.reply(landing.task_id, sent=sent)
    refusal = ctx.nack(reply, sent, NackReason.BAD_MESSAGE, task_id=landing.task_id, state=WorkerState.ACTIVE)
    ctx.check(bool(refusal.detail.strip()), "the refusal's detail is empty", sent=sent, got=refusal)
    ctx.executed_or_runner_error(*ctx.execute())  # serving on
