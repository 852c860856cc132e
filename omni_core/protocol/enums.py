"""Enumerations that travel on the wire.

They live in the sans-IO protocol package (not in `fsm`) because replies carry them: a peer
written in another language needs them from the schema alone.
"""

from __future__ import annotations

import enum


class WorkerState(str, enum.Enum):
    """Lifecycle state of one worker (rank) process; see `omni_core.fsm.worker`."""

    LOADING = "LOADING"
    ACTIVE = "ACTIVE"
    OFFLOADING = "OFFLOADING"
    SLEEPING = "SLEEPING"
    RESTORING = "RESTORING"
    PARTIAL = "PARTIAL"
    NEEDS_RELOAD = "NEEDS_RELOAD"
    RELOADING = "RELOADING"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


class StageState(str, enum.Enum):
    """Lifecycle state of one stage in the orchestrator; see `omni_core.fsm.stage`."""

    STARTING = "STARTING"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"  # admission closed, nothing released, nothing in flight (vLLM's pause)
    DRAINING = "DRAINING"
    TRANSITIONING = "TRANSITIONING"
    SLEEPING = "SLEEPING"
    WAKING = "WAKING"
    PARTIAL = "PARTIAL"
    NEEDS_RELOAD = "NEEDS_RELOAD"
    FAILED = "FAILED"
    STOPPED = "STOPPED"


class AckStatus(str, enum.Enum):
    """OK: the command took effect now. ALREADY: it was already true; nothing was done (P-4)."""

    OK = "OK"
    ALREADY = "ALREADY"


class NackReason(str, enum.Enum):
    """Why a command was refused. A NACK never follows a partial effect."""

    BAD_MESSAGE = "BAD_MESSAGE"  # undecodable or schema-violating bytes (P-10)
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"  # protocol version other than ours
    STALE_EPOCH = "STALE_EPOCH"  # command from an epoch older than the worker's (P-6)
    INVALID_STATE = "INVALID_STATE"  # the current state does not allow this command
    UNKNOWN_TAG = "UNKNOWN_TAG"  # a tag this worker does not have
    UNSUPPORTED = "UNSUPPORTED"  # the worker lacks the capability (e.g. level 2)
    TASK_ID_REUSED = "TASK_ID_REUSED"  # same task_id, different command
    BUSY = "BUSY"  # another task is in progress on this worker
    EXECUTE_ERROR = "EXECUTE_ERROR"  # the runner raised on this request; worker stays ACTIVE
    BACKEND_ERROR = "BACKEND_ERROR"  # the memory backend or runner raised; worker is FAILED
    FAILED = "FAILED"  # the worker is FAILED; only Shutdown or a restart leaves it
    INVALID_ARGUMENT = "INVALID_ARGUMENT"  # the runner cannot use the command's arguments; no effect
    EPOCH_AHEAD = "EPOCH_AHEAD"  # epoch further ahead of the worker's than MAX_EPOCH_AHEAD allows
    REPLY_NOT_KEPT = "REPLY_NOT_KEPT"  # duplicate of an answered task whose reply was too large to keep
    PROFILE_ERROR = "PROFILE_ERROR"  # the profiler raised (start, export); the lifecycle state is unchanged
    NO_MEMORY = "NO_MEMORY"  # a Wake found too little free device memory in time; rolled back, state unchanged
    STALE_VERSION = "STALE_VERSION"  # UpdateWeights.version not above the rank's; nothing written (P-17)
    UPDATE_FAILED = "UPDATE_FAILED"  # an update failed after writing began; NEEDS_RELOAD at the old version (P-17)
    ADAPTER_UNAVAILABLE = "ADAPTER_UNAVAILABLE"  # a request's adapter is not loaded (absent, gone, stale; P-20)


class Capability(str, enum.Enum):
    """What a worker declares in Hello; the conformance suite skips cases a worker opts out of."""

    LEVEL2 = "level2"  # supports Sleep(level=2) + ReloadWeights
    PARTIAL_WAKE = "partial_wake"  # supports Wake(tags) for a subset of tags
    STABLE_ADDRESSES = "stable_addresses"  # tensors keep their device addresses across sleep
    CUDA_GRAPHS = "cuda_graphs"  # captured graphs stay valid across sleep
    PROFILE = "profile"  # answers Profile (start/stop of a profiler, P-15)
    SWAP = "swap"  # a Wake waits for free device memory (Wake.memory_wait_s) and refuses with NO_MEMORY (P-16)
    MULTI_PATH = "multi_path"  # Sleep/Wake take a link plan (`links`) and relay through peer GPUs (P-18)
    WEIGHT_UPDATE = "weight_update"  # answers UpdateWeights and InitWeightGroup (P-17)
    ADAPTERS = "adapters"  # answers AddAdapter, RemoveAdapter, PinAdapter, ListAdapters (P-20)
    STEP_MODE = "step_mode"  # the runner takes step-wise requests (start, step, finish, cancel) in Execute payloads
    # UpdateWeights with the weights asleep at level 1: written into the backend's host copy, the
    # device untouched; the rank stays SLEEPING at the new version and its next wake brings it
    HOST_REFIT = "host_refit"
    SAVE_WEIGHTS = "save_weights"  # answers SaveWeights: its runner writes what its reload reads
    TRANSFER = "transfer"  # answers TransferOut, TransferIn and TransferRelease (P-22)
