"""The worker's transition table: its states, triggers and rows as data.

`WORKER_TRANSITIONS` is the one source the worker core, the docs and the generated TLA+
read; `REFUSED` names the row a refused command returns by; `WORKER_CALLS` holds the commands
the worker takes by its one generic template.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from omni_core.fsm.settle import REFIT_ASLEEP, REFUSAL_REASON, refused_rows, refused_trigger
from omni_core.fsm.table import Transition
from omni_core.protocol import (
    Capability,
    Command,
    NackReason,
    ReloadWeights,
    ResetPrefixCache,
    SaveWeights,
    TransferIn,
    TransferOut,
    TransferRelease,
    UpdateWeights,
    Wake,
)
from omni_core.protocol import WorkerState as W

ALIVE = (W.LOADING, W.ACTIVE, W.OFFLOADING, W.SLEEPING, W.RESTORING, W.PARTIAL, W.NEEDS_RELOAD, W.RELOADING)
IDLE = (W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)  # may accept a lifecycle command

WORKER_TRANSITIONS: tuple[Transition[W], ...] = (
    Transition("loaded", (W.LOADING,), W.ACTIVE, "runner loaded weights and caches"),
    Transition(
        "loaded_needs_reload",
        (W.LOADING,),
        W.NEEDS_RELOAD,
        "runner loaded, its weights not to be served: they are older than the stage's version (an update follows)",
    ),
    Transition("sleep", IDLE, W.OFFLOADING, "Sleep for tags not yet asleep"),
    Transition(
        "sleep_already",
        (W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD),
        None,
        "Sleep whose tags are all asleep: ALREADY, no effect (P-4)",
    ),
    Transition("offloaded", (W.OFFLOADING,), W.SLEEPING, "backend released the tags"),
    Transition("wake", (W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD), W.RESTORING, "Wake for tags that are asleep"),
    Transition("wake_already", IDLE, None, "Wake whose tags are all resident: ALREADY (P-4)"),
    Transition("restored_active", (W.RESTORING,), W.ACTIVE, "all resident, weights valid"),
    Transition("restored_partial", (W.RESTORING,), W.PARTIAL, "some tags still asleep"),
    Transition(
        "restored_needs_reload", (W.RESTORING,), W.NEEDS_RELOAD, "weights mapped but discarded by a level-2 sleep"
    ),
    Transition("reload", (W.NEEDS_RELOAD, W.ACTIVE), W.RELOADING, "ReloadWeights"),
    Transition("reloaded_active", (W.RELOADING,), W.ACTIVE, "weights valid, all resident"),
    Transition("reloaded_partial", (W.RELOADING,), W.PARTIAL, "weights valid, tags asleep"),
    *refused_rows(
        ReloadWeights,
        W.RELOADING,
        (W.NEEDS_RELOAD, W.ACTIVE),
        "the runner refused the source before writing (INVALID_ARGUMENT)",
    ),
    *refused_rows(
        Wake,
        W.RESTORING,
        (W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD),
        "too little free device memory in time (NO_MEMORY): what the wake mapped is unmapped again",
    ),
    Transition(
        "update",
        (W.ACTIVE, W.PARTIAL, W.NEEDS_RELOAD),
        W.RELOADING,
        "UpdateWeights above the current version, weights resident (P-17); settles as a reload does",
    ),
    *refused_rows(
        UpdateWeights,
        W.RELOADING,
        (W.ACTIVE, W.PARTIAL, W.NEEDS_RELOAD),
        "a name, shape, dtype or handle refused before writing (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        "update_failed",
        (W.RELOADING,),
        W.NEEDS_RELOAD,
        "the update failed once writing began (UPDATE_FAILED): weights invalid, version as before",
    ),
    Transition(
        "update_asleep",
        (W.SLEEPING,),
        W.RELOADING,
        "UpdateWeights with the weights asleep at level 1 (host_refit): written into the host copy, device untouched",
    ),
    *refused_rows(
        UpdateWeights,
        W.RELOADING,
        (W.SLEEPING,),
        "a name, shape, dtype or handle refused before the host copy was written (INVALID_ARGUMENT): version unchanged",
    ),
    Transition(
        REFIT_ASLEEP.after_update,
        (W.RELOADING,),
        REFIT_ASLEEP.rank_state,
        "the host copy holds the new version: still asleep, the next wake brings it",
    ),
    Transition(
        REFIT_ASLEEP.after_failure,
        (W.RELOADING,),
        REFIT_ASLEEP.rank_state,
        "writing the host copy failed midway (UPDATE_FAILED): it stands for no version, weights invalid "
        "(a wake lands NEEDS_RELOAD), version as before",
    ),
    Transition("weight_group", IDLE, None, "InitWeightGroup: join the trainer's group; the state never changes"),
    Transition("weight_group_already", IDLE, None, "InitWeightGroup for the group already joined: ALREADY"),
    Transition(
        "share",
        (W.ACTIVE, W.PARTIAL),
        None,
        "ShareWeights with valid weights awake: copied into shared buckets; the state never changes",
    ),
    Transition(
        "reset_prefix_cache",
        (W.ACTIVE, W.PARTIAL),
        None,
        "ResetPrefixCache: the runner drops its cross-request caches; no memory moves, the state never changes",
    ),
    Transition(
        "save_weights",
        (W.ACTIVE, W.PARTIAL),
        None,
        "SaveWeights with valid weights awake: written to disk beside the target, renamed in; the state never changes",
    ),
    Transition(
        "add_adapter",
        (W.ACTIVE, W.PARTIAL),
        None,
        "AddAdapter with valid weights awake (P-20): loaded into the adapters' pool, LRU evicted at max_loras",
    ),
    Transition(
        "remove_adapter",
        (W.ACTIVE, W.PARTIAL),
        None,
        "RemoveAdapter of an adapter held (P-20): unloaded; the state never changes",
    ),
    Transition("pin_adapter", (W.ACTIVE, W.PARTIAL), None, "PinAdapter (P-20): never evicted while pinned"),
    Transition("list_adapters", IDLE, None, "ListAdapters (P-20): every adapter, gone and stale ones named"),
    Transition(
        "adapter_already",
        (W.ACTIVE, W.PARTIAL),
        None,
        "AddAdapter already loaded, RemoveAdapter of one not held, PinAdapter already so: ALREADY (P-20)",
    ),
    Transition(
        "transfer_out",
        (W.ACTIVE,),
        None,
        "TransferOut (P-22): the runner exports a request's tensors into buckets held until TransferRelease",
    ),
    Transition(
        "transfer_in",
        (W.ACTIVE,),
        None,
        "TransferIn (P-22): the producer's buckets opened, checked and copied for the request; nothing else moves",
    ),
    Transition(
        "transfer_release",
        IDLE,
        None,
        "TransferRelease (P-22): what the rank holds for the request is dropped (nothing held: the same Ack)",
    ),
    Transition(
        "execute",
        (W.ACTIVE,),
        None,
        "Execute is legal only in ACTIVE (P-7); up to max_in_flight run as one batch, nothing else beside them",
    ),
    Transition(
        "hold_requests",
        (W.ACTIVE,),
        None,
        "HoldRequests (pause mode keep): the batch frozen where it is, only an update beside it, or released",
    ),
    Transition("status", tuple(W), None, "Status is legal everywhere and changes nothing"),
    Transition(
        "profile", IDLE, None, "Profile start (none running) or stop (one running): the profiler only, never the state"
    ),
    Transition(
        "profile_already", IDLE, None, "Profile start while one runs, stop while none does: ALREADY, no effect (P-15)"
    ),
    Transition("fail", ALIVE, W.FAILED, "backend or runner raised"),
    Transition(
        "shutdown",
        (W.LOADING, *IDLE, W.FAILED),
        W.STOPPED,
        "Shutdown (in a transient state the effect in progress answers first: BUSY)",
    ),
    Transition("shutdown_already", (W.STOPPED,), None, "second Shutdown: ALREADY"),
)

# Pause mode keep (the hold_requests row): what may run beside a held batch besides the
# HoldRequests that releases it. Only an update of the weights under it (the in-flight refit):
# it moves no request's memory, and the spans name the version each token came from.
BESIDE_HELD: tuple[type[Command], ...] = (UpdateWeights,)

# A refused reload, wake or update returns to where it came from: (command, state before) ->
# trigger, for every refused row of the table.
REFUSED: dict[tuple[type, W], str] = {
    (kind, t.dest): t.trigger
    for kind in REFUSAL_REASON
    for t in WORKER_TRANSITIONS
    if t.dest is not None and t.trigger == refused_trigger(kind, t.dest)
}


@dataclass(frozen=True)
class WorkerCall:
    """How the worker takes a command that never changes its state, by one template: legal
    where `trigger`'s row of WORKER_TRANSITIONS allows it (else NACK INVALID_STATE, `why`
    appended), performed whole by the shell (`CommandEffect`), answered by an Ack with the
    memory figures. Performing it moves no pool memory, so a raise is that command's NACK
    (`error`) and the rank keeps its state."""

    trigger: str
    why: str
    error: NackReason
    capability: Capability | None = None  # refused UNSUPPORTED by a worker that lacks it
    weights_awake: bool = False  # legal only with valid weights resident (else INVALID_STATE)
    shares: bool = False  # what the shell returns are buckets it holds: the Ack's `shared`


WORKER_CALLS: Mapping[type[Command], WorkerCall] = MappingProxyType(
    {
        ResetPrefixCache: WorkerCall(
            "reset_prefix_cache",
            "ResetPrefixCache needs the weights and caches resident: ACTIVE or PARTIAL",
            NackReason.EXECUTE_ERROR,
        ),
        SaveWeights: WorkerCall(
            "save_weights",
            "SaveWeights needs valid weights awake: ACTIVE, or PARTIAL with 'weights' awake",
            NackReason.INVALID_ARGUMENT,
            capability=Capability.SAVE_WEIGHTS,
            weights_awake=True,
        ),
        TransferOut: WorkerCall(
            "transfer_out",
            "TransferOut runs the model's export: ACTIVE only",
            NackReason.INVALID_ARGUMENT,
            Capability.TRANSFER,
            shares=True,
        ),
        TransferIn: WorkerCall(
            "transfer_in",
            "TransferIn is taken only where its request can run: ACTIVE",
            NackReason.INVALID_ARGUMENT,
            Capability.TRANSFER,
        ),
        TransferRelease: WorkerCall(
            "transfer_release",
            "TransferRelease is taken in ACTIVE, SLEEPING, PARTIAL and NEEDS_RELOAD",
            NackReason.INVALID_ARGUMENT,
            Capability.TRANSFER,
        ),
    }
)
