"""What a worker process is started with. The engine builds one per rank and hands it to
`omni_core.workers.process.run_worker` (spawned) or, for a command-line start, passes it
as JSON through `--config`. Kept as plain data so it crosses process boundaries."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from omni_core.fsm.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from omni_core.fsm.reply_cache import DEFAULT_REPLY_CACHE_BYTES, MIN_REPLY_CACHE_ENTRIES
from omni_core.fsm.tags import DEFAULT_TAGS
from omni_core.fsm.worker_step import MAX_IN_FLIGHT_PER_RANK
from omni_core.protocol import DEFAULT_MAX_FRAME_BYTES, MAX_ADAPTER_RANK, MAX_ADAPTERS
from omni_core.workers.simulated_device import SimulatedDevice


def device_problem(name: str) -> str | None:
    """What stops a process on this machine from using the torch device `name`, or None: no
    such device type, a CPU-only torch, fewer GPUs than the index. Said without the caller's
    parameter name, which the caller adds (`--device`, the TOML key `device`)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        return f"{name!r} is not a torch device ({exc})"
    if device.type != "cuda":
        return None
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        return (
            f"{name!r} needs a CUDA GPU, and torch {torch.__version__} ({build}) sees none "
            "(torch.cuda.is_available() is False)"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        return f"{name!r} names GPU {device.index}, and torch sees {count} (CUDA_VISIBLE_DEVICES selects them)"
    return None


# Bounds a rank's config shares with the StageSpec it comes from (engine/spec.py uses these).
MIN_FRAME_BYTES = 64 << 10  # room for every lifecycle message and its error details
MAX_FRAME_BYTES = 1 << 31
MAX_DEADLINE_S = 24 * 3600.0
FrameBytes = Annotated[int, Meta(ge=MIN_FRAME_BYTES, le=MAX_FRAME_BYTES)]
Seconds = Annotated[float, Meta(gt=0, le=MAX_DEADLINE_S)]
GpuFraction = Annotated[float, Meta(gt=0, le=1)]


class WorkerConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    address: str  # orchestrator ROUTER address, e.g. ipc:///tmp/omni-xyz.sock or tcp://127.0.0.1:5555
    rank: int
    epoch: int = 0
    stage: str = "stage"
    runner: str = "synthetic"  # a name registered in omni_core.plugins or an import path "package.module:Class"
    runner_args: dict[str, Any] = {}
    backend: str = "auto"  # a name registered in omni_core.plugins or an import path "package.module:Class"
    device: str = "cpu"  # torch device inside the process ("cpu", "cuda" = the visible GPU)
    tags: Annotated[tuple[str, ...], Meta(min_length=1)] = DEFAULT_TAGS
    gpu_memory_fraction: GpuFraction | None = None  # this process's share of the GPU (KV sizing, start-up check)
    verify_clean_sleep: bool = False  # check read-only tags against their host copy at each sleep (debug)
    # CPU runs of a swap: the device capacity the memory gate waits on (shared per-process
    # files). None: on CUDA the real free memory, on CPU no gate.
    simulated_device: SimulatedDevice | None = None
    trace_path: str | None = None  # append one JSON line per processed message when set
    profile_dir: str | None = None  # Profile traces; None: omni_core.workers.profiler.default_profile_dir()
    profile_max_s: Seconds = 600.0  # a profile running longer is cut and written (its events grow in memory)
    # Requests this rank runs together as one batch (StageSpec.batch_max_requests); 1: one at a time.
    batch_max_requests: Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT_PER_RANK)] = 1
    reply_cache_entries: int = 1024  # at least MIN_REPLY_CACHE_ENTRIES (P-2)
    max_loras: Annotated[int, Meta(ge=1, le=MAX_ADAPTERS)] = DEFAULT_MAX_LORAS  # LoRA adapters loaded at once (P-20)
    max_lora_rank: Annotated[int, Meta(ge=1, le=MAX_ADAPTER_RANK)] = DEFAULT_MAX_LORA_RANK
    reply_cache_bytes: int = DEFAULT_REPLY_CACHE_BYTES
    max_frame_bytes: FrameBytes = DEFAULT_MAX_FRAME_BYTES  # larger frames are refused (BAD_MESSAGE) unread
    # The engine ROUTER's CURVE public key (Z85) when the transport leaves the host: the rank
    # then encrypts and checks the server. Its own key pair comes through the environment.
    curve_server_key: str | None = None
    recv_queue_limit: int = 1024  # ZMQ receive high-water mark
    # Leave (releasing pools) when the process that started this worker is gone, so a
    # crashed orchestrator or test run does not strand workers holding GPU memory. Turn
    # off for a worker started by a shell that exits (nohup, a process supervisor).
    exit_with_parent: bool = True
    parent_check_interval_s: float = 1.0
    parent_pid: int | None = None  # the process to outlive not; default: the parent at start
    # What a restart's rank starts from (omni_core.fsm.stage_versions.StartWeights): its
    # checkpoint, then `start_source` (a directory holding `start_version`) when given; with
    # `start_needs_reload`, NEEDS_RELOAD at version 0: the stage's version lived in memory only.
    start_source: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    start_version: Annotated[int, Meta(ge=0)] = 0
    start_needs_reload: bool = False

    def __post_init__(self) -> None:
        if self.reply_cache_entries < MIN_REPLY_CACHE_ENTRIES:
            raise ValueError(
                f"reply_cache_entries={self.reply_cache_entries} is below {MIN_REPLY_CACHE_ENTRIES}: "
                f"a worker must hold its {MIN_REPLY_CACHE_ENTRIES} latest answers for retries (P-2); "
                "raise it"
            )
