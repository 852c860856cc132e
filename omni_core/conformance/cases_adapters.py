"""The P-20 cases (LoRA adapters): the rules a worker keeps whatever its runner loads. They
load nothing, so they hold for any model: a request naming an adapter not held is refused
naming it, an adapter made for other weights is refused naming both versions, a source that
does not exist is refused with nothing loaded, and the commands are refused asleep, from an
older epoch and copied from the reply cache like every command. An adapter's tensors sent
without one the adapter has (an adapter-only refit from tensors, rule 7) are refused with
nothing written, on a module the worker's own shared weights name."""

from __future__ import annotations

from omni_core.conformance.cases import Ctx, case
from omni_core.conformance.cases_weights import WEIGHT_UPDATE, share_weights
from omni_core.conformance.weight_copies import zero_buckets
from omni_core.protocol import (
    AckStatus,
    AddAdapter,
    Execute,
    ListAdapters,
    NackReason,
    PinAdapter,
    RemoveAdapter,
    ShmSource,
    TensorSpec,
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


def _module_weight(ctx: Ctx) -> TensorSpec:
    """A 2-D weight of the worker's model, from its own shared weights: an adapter on its module
    is one the model has, whatever the model."""
    own = share_weights(ctx, WorkerState.ACTIVE).shared
    if not isinstance(own, ShmSource):
        ctx.skip(f"the worker shared its weights as {type(own).__name__}, not host buckets (shm)")
    assert isinstance(own, ShmSource)
    weight = next((t for b in own.buckets for t in b.tensors if len(t.shape) == 2 and t.name.endswith(".weight")), None)
    weight = weight or next((t for b in own.buckets for t in b.tensors if len(t.shape) == 2), None)
    if weight is None:
        ctx.skip("the worker's shared weights hold no 2-D tensor an adapter could target")
    assert weight is not None
    return weight


@case(
    "P-20",
    "adapter_tensors_refused_unless_whole",
    "'weight_update' declared: AddAdapter with `tensors` (host buckets the suite wrote) holding the lora_A "
    "but not the lora_B of an adapter on a module of the worker's own weights: Nack INVALID_ARGUMENT, nothing "
    "listed, still ACTIVE and serving; a copy gets the same Nack; sent again under a new task id it is refused "
    "again, never ALREADY (rule 7)",
    needs=(ADAPTERS, WEIGHT_UPDATE),
)
def adapter_tensors_refused_unless_whole(ctx: Ctx) -> None:
    weight = _module_weight(ctx)
    owner = weight.name.removesuffix(".weight")
    module = owner.rsplit(".", 1)[-1]
    half = TensorSpec(name=f"base_model.model.{owner}.lora_A.weight", dtype=weight.dtype, shape=(1, weight.shape[1]))
    with zero_buckets((half,)) as tensors:
        for what in ("half", "half-again"):
            add = _add(ctx, what, source="tensors:shm", target_modules=(module,), tensors=tensors)
            nack = ctx.nack(ctx.request(add), add, NackReason.INVALID_ARGUMENT, state=WorkerState.ACTIVE)
            if what == "half":
                copy = ctx.request(add)
                ctx.check(copy == nack, "a copy of the refused AddAdapter got another answer", sent=add, got=copy)
    ctx.check(
        NAME not in _listed(ctx, WorkerState.ACTIVE, "list-after-tensors"),
        "an AddAdapter whose tensors lack the adapter's lora_B left the adapter listed",
    )
    ctx.executed_or_runner_error(*ctx.execute())  # serving on
