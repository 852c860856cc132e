"""The P-20 cases (LoRA adapters): the rules a worker keeps whatever its runner loads. They
load nothing, so they hold for any model: a request naming an adapter not held is refused
naming it, an adapter made for other weights is refused naming both versions, a source that
does not exist is refused with nothing loaded, and the commands are refused asleep, from an
older epoch and copied from the reply cache like every command."""

from __future__ import annotations

from omni_core.conformance.cases import Ctx, case
from omni_core.protocol import (
    AckStatus,
    AddAdapter,
    Execute,
    ListAdapters,
    NackReason,
    PinAdapter,
    RemoveAdapter,
    WorkerState,
)

ADAPTERS = "adapters"  # the capability a worker declares when it answers the adapter commands
NAME = "conformance-absent"
MISSING_SOURCE = "/nonexistent/omni-core-conformance/adapter"
VERSION_AHEAD = 1000  # a base version no rank of the suite's reaches


def _add(ctx: Ctx, what: str, **fields: object) -> AddAdapter:
    args: dict[str, object] = {
        "name": NAME,
        "adapter_id": 4242,
        "source": MISSING_SOURCE,
        "rank": 1,
        "target_modules": ("q_proj",),
    }
    return ctx.cmd(AddAdapter, what, peer=None, **(args | fields))  # peer named: no field is a Peer


def _listed(ctx: Ctx, state: WorkerState, what: str) -> tuple[str, ...]:
    command = ctx.cmd(ListAdapters, what)
    ack = ctx.ack(ctx.request(command), command, state=state, status=AckStatus.OK)
    return tuple(a.name for a in ack.adapters)


@case(
    "P-20",
    "adapter_requests_refused_naming_it",
    "an Execute naming an adapter the worker does not hold: Nack ADAPTER_UNAVAILABLE naming the adapter, "
    "still ACTIVE; ListAdapters lists no such adapter; RemoveAdapter of it is ALREADY, and a copy gets "
    "the same Ack; PinAdapter of it is INVALID_ARGUMENT naming it",
    needs=(ADAPTERS,),
)
def adapter_requests_refused_naming_it(ctx: Ctx) -> None:
    command = ctx.cmd(Execute, "with-adapter", payload=ctx.options.execute_payload, adapter=NAME)
    nack = ctx.nack(ctx.request(command), command, NackReason.ADAPTER_UNAVAILABLE, state=WorkerState.ACTIVE)
    ctx.check(NAME in nack.detail, "the refusal does not name the adapter", sent=command, got=nack)
    ctx.check(NAME not in _listed(ctx, WorkerState.ACTIVE, "list"), "ListAdapters lists an adapter never added")
    remove = ctx.cmd(RemoveAdapter, "remove", name=NAME)
    removed = ctx.ack(ctx.request(remove), remove, state=WorkerState.ACTIVE, status=AckStatus.ALREADY)
    copy = ctx.request(remove)
    ctx.check(copy == removed, "a copy of the answered RemoveAdapter got another answer", sent=remove, got=copy)
    pin = ctx.cmd(PinAdapter, "pin", name=NAME)
    refused = ctx.nack(ctx.request(pin), pin, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    ctx.check(NAME in refused.detail, "the refusal does not name the adapter", sent=pin, got=refused)


@case(
    "P-20",
    "adapter_for_other_weights_refused",
    "AddAdapter made for a base weights version the worker does not hold, without rebind: Nack "
    "INVALID_ARGUMENT naming that version, nothing loaded; a source that does not exist: Nack "
    "INVALID_ARGUMENT, nothing loaded, still ACTIVE; from an older epoch: STALE_EPOCH",
    needs=(ADAPTERS,),
)
def adapter_for_other_weights_refused(ctx: Ctx) -> None:
    held = ctx.status().weights_version
    ahead = held + VERSION_AHEAD
    command = _add(ctx, "other-base", base_version=ahead)
    nack = ctx.nack(ctx.request(command), command, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    ctx.check(
        str(ahead) in nack.detail,
        "the refusal of an adapter made for other weights does not name the version it was made for",
        sent=command,
        got=nack,
        expected=f"a detail naming base version {ahead}",
    )
    missing = _add(ctx, "missing")
    ctx.nack(ctx.request(missing), missing, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
    ctx.check(NAME not in _listed(ctx, WorkerState.ACTIVE, "list"), "a refused AddAdapter left the adapter listed")
    ctx.executed_or_runner_error(*ctx.execute())  # serving on
    stale = _add(ctx, "stale", epoch=ctx.worker.epoch - 1)
    ctx.nack(ctx.request(stale), stale, NackReason.STALE_EPOCH)


@case(
    "P-20",
    "adapters_move_only_awake",
    "after a level-1 sleep (SLEEPING): AddAdapter is refused INVALID_STATE naming the state; ListAdapters "
    "is acknowledged OK in SLEEPING",
    needs=(ADAPTERS,),
)
def adapters_move_only_awake(ctx: Ctx) -> None:
    _, slept = ctx.sleep(1)
    command = _add(ctx, "asleep")
    ctx.nack(ctx.request(command), command, NackReason.INVALID_STATE, state=slept.state, names_state=True)
    _listed(ctx, slept.state, "list-asleep")
    ctx.back_to_active()
