"""StageSpec: what a stage is, checked when it is built so mistakes surface before start.

Each field is declared once, with its type and bounds (`msgspec.Meta`). A TOML file is
decoded into these Structs by `msgspec.convert` (omni_core.config); a Python caller's
arguments are converted and checked against the same declarations in `__post_init__`, so
both refuse the same values with the same words.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from omni_core.engine.fields import FieldError, conform
from omni_core.fsm.adapters import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS
from omni_core.fsm.admission import AdmissionPolicy  # the one definition, beside its tables
from omni_core.fsm.tags import DEFAULT_TAGS
from omni_core.fsm.worker_step import MAX_IN_FLIGHT_PER_RANK
from omni_core.plugins import BACKENDS, RUNNERS, name_problem
from omni_core.protocol import DEFAULT_MAX_FRAME_BYTES, MAX_ADAPTER_RANK, MAX_ADAPTERS
from omni_core.workers.config import FrameBytes, GpuFraction, Seconds
from omni_core.workers.simulated_device import SimulatedDevice

# Requests in flight per stage (and so per rank: each goes to every rank), at most: below the
# orchestrator's per-rank socket queue (10,000), so the queue never overflows before admission
# says "wait" or "rejected". The worker core holds its batch to the same bound.
MAX_IN_FLIGHT_LIMIT = MAX_IN_FLIGHT_PER_RANK
StageName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
# Ray's placement group strategies (ray.util.placement_group), as users of vLLM, verl and
# OpenRLHF already write them.
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
BundleAmount = Annotated[float, Meta(ge=0, le=1024)]


class RayPlacement(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where a stage's ranks run under `RayLauncher` (the local launcher ignores it).

    One actor per rank, each asking for `num_cpus`, `num_gpus` (fractional: 0.5 lets two
    ranks of colocated stages share a GPU) and `resources`. By default the launcher makes one
    placement group per stage (a bundle per rank, `strategy`) and removes it when the stage's
    ranks go. With `placement_group` (a `ray.util.placement_group.PlacementGroup`) or
    `placement_group_name` (a named one, e.g. from a TOML file) the ranks go into that group's
    bundles instead (rank i into `bundle_indices[i]`, default i) and the group is the user's:
    several stages may share it, and it outlives the engine.
    """

    num_cpus: BundleAmount = 1.0
    num_gpus: BundleAmount = 0.0
    resources: dict[str, Annotated[float, Meta(gt=0)]] = {}
    strategy: PlacementStrategy = "PACK"
    placement_group: Any = None  # a PlacementGroup object: Python only, TOML names one instead
    placement_group_name: str | None = None
    bundle_indices: tuple[Annotated[int, Meta(ge=0)], ...] | None = None
    runtime_env: dict[str, Any] | None = None  # passed to each rank's actor as given

    def __post_init__(self) -> None:
        conform(self, "placement")
        if self.num_cpus == 0 and self.num_gpus == 0 and not self.resources:
            raise FieldError("placement", None, "a bundle must ask for something; give num_cpus, num_gpus or resources")
        if self.placement_group is not None and self.placement_group_name is not None:
            raise FieldError("placement", "placement_group", "give placement_group or placement_group_name, not both")
        if self.bundle_indices is not None and self.placement_group is None and self.placement_group_name is None:
            raise FieldError(
                "placement",
                "bundle_indices",
                "bundle_indices index a placement group of yours; give placement_group or placement_group_name too",
            )

    def check(self, stage: str, ranks: int) -> None:
        """What depends on the stage: one bundle index per rank."""
        if self.bundle_indices is not None and len(self.bundle_indices) != ranks:
            raise FieldError(
                f"stage {stage!r}",
                "placement.bundle_indices",
                f"needs one index >= 0 per rank ({ranks}), got {self.bundle_indices!r}",
            )


class StageSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: StageName
    runner: str = "synthetic"
    runner_args: dict[str, Any] = {}
    ranks: Annotated[int, Meta(ge=1, le=64)] = 1
    devices: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES of each rank; None: inherit
    device: str = "cpu"  # torch device inside each rank: "cpu" or "cuda"
    backend: str = "auto"
    admission: AdmissionPolicy = AdmissionPolicy.QUEUE
    deadline_s: Seconds = 30.0  # default per lifecycle command (sleep, wake, reload)
    start_deadline_s: Seconds = 120.0  # every rank must say Hello by then
    request_timeout_s: Seconds = 60.0  # per request, queueing included
    queue_limit: Annotated[int, Meta(ge=0, le=1_000_000)] = 256
    # Requests sent to the ranks and not yet answered by all of them (socket queues bound it).
    max_in_flight: Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT_LIMIT)] = 1024
    # Of those, how many each rank runs together, handed to its runner as one batch (1: one
    # at a time, as the trace spec models a rank; larger: continuous batching, OmniBatch.tla).
    batch_max_requests: Annotated[int, Meta(ge=1, le=MAX_IN_FLIGHT_PER_RANK)] = 1
    # The largest message either side accepts (payloads, results).
    max_frame_bytes: FrameBytes = DEFAULT_MAX_FRAME_BYTES
    gpu_memory_fraction: GpuFraction | None = None  # each rank's share of its GPU
    # Debug: at each sleep, compare the tags the runner declares read-only with their host copy
    # (fast backend); a runner that wrote them fails the sleep instead of waking stale.
    verify_clean_sleep: bool = False
    tags: Annotated[tuple[str, ...], Meta(min_length=1)] = DEFAULT_TAGS
    # LoRA adapters (P-20): how many each rank holds at once (LRU eviction beyond, pinned ones
    # never), and the highest rank it accepts. They live in the pool of tag `adapters` when
    # `tags` has it, else in the weights'.
    max_loras: Annotated[int, Meta(ge=1, le=MAX_ADAPTERS)] = DEFAULT_MAX_LORAS
    max_lora_rank: Annotated[int, Meta(ge=1, le=MAX_ADAPTER_RANK)] = DEFAULT_MAX_LORA_RANK
    placement: RayPlacement | None = None  # on a Ray cluster (RayLauncher); None: its defaults
    # Profile traces of every rank (engine.profile); None: $TMPDIR/omni-core-profiles.
    profile_dir: Annotated[str, Meta(min_length=1)] | None = None
    profile_max_s: Seconds = 600.0  # a profile running longer is cut and written by its rank
    # CPU runs of a swap: the device capacity every rank's memory gate waits on (stages given
    # the same directory share the "device"). None: on CUDA the real free memory.
    simulated_device: SimulatedDevice | None = None
    # Plan links for this stage's sleeps and wakes: ranks that declare multi_path relay
    # copies through idle peer GPUs they see (list them in `devices`, own GPU first).
    multi_path: bool = True

    @property
    def dummy_weights(self) -> bool:
        """Whether the runner starts from random weights (runner_args load_format "dummy", as
        vLLM's): the stage is NEEDS_RELOAD at version 0 until its first update."""
        return self.runner_args.get("load_format") == "dummy"

    def __post_init__(self) -> None:
        conform(self, f"stage {self.name!r}")
        what = f"stage {self.name!r}"
        if self.devices is not None and len(self.devices) != self.ranks:
            raise FieldError(
                what,
                "devices",
                f"{len(self.devices)} devices for {self.ranks} ranks; give one CUDA_VISIBLE_DEVICES entry per rank",
            )
        for field, group in (("runner", RUNNERS), ("backend", BACKENDS)):
            problem = name_problem(group, getattr(self, field))
            if problem:
                raise FieldError(what, field, problem)
        if len(set(self.tags)) != len(self.tags):
            raise FieldError(what, "tags", f"must be distinct, got {list(self.tags)}")
        if self.gpu_memory_fraction is not None and self.device != "cuda":
            raise FieldError(what, "gpu_memory_fraction", f"applies to device='cuda', not {self.device!r}")
        # A backend of one's own ("module:Class") may report its bytes too; its rank says if not.
        own = ":" in self.backend
        if self.simulated_device is not None and (
            self.device != "cpu" or not (own or self.backend in ("auto", "portable"))
        ):
            raise FieldError(
                what,
                "simulated_device",
                "stands in for a GPU's capacity on device='cpu' with the portable backend, not "
                f"device={self.device!r} backend={self.backend!r}; on a GPU the real free memory is used: "
                "remove simulated_device",
            )
        if self.placement is not None:
            self.placement.check(self.name, self.ranks)
