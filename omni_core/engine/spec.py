"""StageSpec: what a stage is, checked when it is built so mistakes surface before start."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omni_core.engine.errors import InvalidArgumentError
from omni_core.fsm.admission import AdmissionPolicy  # the one definition, beside its tables
from omni_core.fsm.tags import DEFAULT_TAGS
from omni_core.protocol import DEFAULT_MAX_FRAME_BYTES
from omni_core.workers.config import backend_name_problem
from omni_core.workers.simulated_device import SimulatedDevice

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Requests in flight per stage, at most: below the orchestrator's per-rank socket queue
# (10,000), so the queue never overflows before admission says "wait" or "rejected".
MAX_IN_FLIGHT_LIMIT = 4096
MIN_FRAME_BYTES = 64 << 10  # room for every lifecycle message and its error details
# Ray's placement group strategies (ray.util.placement_group), as users of vLLM, verl and
# OpenRLHF already write them.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class RayPlacement:
    """Where a stage's ranks run under `RayLauncher` (the local launcher ignores it).

    One actor per rank, each asking for `num_cpus`, `num_gpus` (fractional: 0.5 lets two
    ranks of colocated stages share a GPU) and `resources`. By default the launcher makes one
    placement group per stage (a bundle per rank, `strategy`) and removes it when the stage's
    ranks go. With `placement_group` (a `ray.util.placement_group.PlacementGroup`) or
    `placement_group_name` (a named one, e.g. from a TOML file) the ranks go into that group's
    bundles instead (rank i into `bundle_indices[i]`, default i) and the group is the user's:
    several stages may share it, and it outlives the engine.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)
    strategy: str = "PACK"
    placement_group: Any = None
    placement_group_name: str | None = None
    bundle_indices: tuple[int, ...] | None = None
    runtime_env: Mapping[str, Any] | None = None  # passed to each rank's actor as given

    def __post_init__(self) -> None:  # TOML gives lists and tables
        object.__setattr__(self, "resources", dict(self.resources))
        if self.bundle_indices is not None:
            object.__setattr__(self, "bundle_indices", tuple(self.bundle_indices))

    def check(self, stage: str, ranks: int) -> None:
        for what in ("num_cpus", "num_gpus"):
            value = getattr(self, what)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1024:
                raise InvalidArgumentError(
                    f"stage {stage!r}: placement {what} must be a number in [0, 1024], got {value!r}"
                )
        for key, value in self.resources.items():
            if not isinstance(key, str) or not isinstance(value, (int, float)) or value <= 0:
                raise InvalidArgumentError(
                    f"stage {stage!r}: placement resources must map names to positive amounts, got {key!r}: {value!r}"
                )
        if self.num_cpus == 0 and self.num_gpus == 0 and not self.resources:
            raise InvalidArgumentError(
                f"stage {stage!r}: a placement bundle must ask for something; give num_cpus, num_gpus or resources"
            )
        if self.strategy not in PLACEMENT_STRATEGIES:
            raise InvalidArgumentError(
                f"stage {stage!r}: placement strategy {self.strategy!r} is not one of {list(PLACEMENT_STRATEGIES)}"
            )
        if self.placement_group is not None and self.placement_group_name is not None:
            raise InvalidArgumentError(f"stage {stage!r}: give placement_group or placement_group_name, not both")
        user_group = self.placement_group is not None or self.placement_group_name is not None
        if self.bundle_indices is not None:
            if not user_group:
                raise InvalidArgumentError(
                    f"stage {stage!r}: bundle_indices index a placement group of yours; "
                    "give placement_group or placement_group_name too"
                )
            if len(self.bundle_indices) != ranks or not all(isinstance(i, int) and i >= 0 for i in self.bundle_indices):
                raise InvalidArgumentError(
                    f"stage {stage!r}: bundle_indices needs one index >= 0 per rank "
                    f"({ranks}), got {self.bundle_indices!r}"
                )


@dataclass(frozen=True)
class StageSpec:
    name: str
    runner: str = "synthetic"
    runner_args: Mapping[str, Any] = field(default_factory=dict)
    ranks: int = 1
    devices: tuple[str, ...] | None = None  # CUDA_VISIBLE_DEVICES of each rank; None: inherit
    device: str = "cpu"  # torch device inside each rank: "cpu" or "cuda"
    backend: str = "auto"
    admission: AdmissionPolicy | str = AdmissionPolicy.QUEUE
    deadline_s: float = 30.0  # default per lifecycle command (sleep, wake, reload)
    start_deadline_s: float = 120.0  # every rank must say Hello by then
    request_timeout_s: float = 60.0  # per request, queueing included
    queue_limit: int = 256
    max_in_flight: int = 1024  # requests sent to the ranks and not yet answered by all of them
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES  # largest message either side accepts (payloads, results)
    gpu_memory_fraction: float | None = None  # each rank's share of its GPU (own use only)
    # Debug: at each sleep, compare the tags the runner declares read-only with their host copy
    # (fast backend); a runner that wrote them fails the sleep instead of waking stale.
    verify_clean_sleep: bool = False
    tags: tuple[str, ...] = DEFAULT_TAGS
    placement: RayPlacement | None = None  # on a Ray cluster (RayLauncher); None: its defaults
    # Profile traces of every rank (engine.profile); None: $TMPDIR/omni-core-profiles.
    profile_dir: str | None = None
    profile_max_s: float = 600.0  # a profile running longer is cut and written by its rank
    # CPU runs of a swap: the device capacity every rank's memory gate waits on (stages given
    # the same directory share the "device"). None: on CUDA the real free memory.
    simulated_device: SimulatedDevice | None = None
    # Plan links for this stage's sleeps and wakes (P-18): ranks that declare multi_path relay
    # copies through idle peer GPUs they see (list them in `devices`, own GPU first).
    multi_path: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise InvalidArgumentError(f"stage name {self.name!r} must be 1-64 of [A-Za-z0-9_.-]")
        if not isinstance(self.ranks, int) or not 1 <= self.ranks <= 64:
            raise InvalidArgumentError(f"stage {self.name!r}: ranks must be 1..64, got {self.ranks!r}")
        if self.devices is not None:
            object.__setattr__(self, "devices", tuple(str(d) for d in self.devices))
            if len(self.devices) != self.ranks:
                raise InvalidArgumentError(
                    f"stage {self.name!r}: {len(self.devices)} devices for {self.ranks} ranks; "
                    "give one CUDA_VISIBLE_DEVICES entry per rank"
                )
        problem = backend_name_problem(self.backend)
        if problem:
            raise InvalidArgumentError(f"stage {self.name!r}: {problem}")
        try:
            object.__setattr__(self, "admission", AdmissionPolicy(self.admission))
        except ValueError:
            raise InvalidArgumentError(
                f"stage {self.name!r}: admission {self.admission!r} is not one of {[p.value for p in AdmissionPolicy]}"
            ) from None
        if self.profile_dir is not None and (not isinstance(self.profile_dir, str) or not self.profile_dir):
            raise InvalidArgumentError(
                f"stage {self.name!r}: profile_dir must be a non-empty path or None, got {self.profile_dir!r}"
            )
        for what in ("deadline_s", "start_deadline_s", "request_timeout_s", "profile_max_s"):
            value = getattr(self, what)
            if not isinstance(value, (int, float)) or not 0 < value <= 24 * 3600:
                raise InvalidArgumentError(f"stage {self.name!r}: {what} must be in (0, 86400] s, got {value!r}")
        if not isinstance(self.queue_limit, int) or not 0 <= self.queue_limit <= 1_000_000:
            raise InvalidArgumentError(f"stage {self.name!r}: queue_limit must be 0..1e6")
        if not isinstance(self.max_in_flight, int) or not 1 <= self.max_in_flight <= MAX_IN_FLIGHT_LIMIT:
            raise InvalidArgumentError(
                f"stage {self.name!r}: max_in_flight must be 1..{MAX_IN_FLIGHT_LIMIT} "
                f"(socket queues bound it), got {self.max_in_flight!r}"
            )
        if not isinstance(self.max_frame_bytes, int) or not MIN_FRAME_BYTES <= self.max_frame_bytes <= 1 << 31:
            raise InvalidArgumentError(
                f"stage {self.name!r}: max_frame_bytes must be {MIN_FRAME_BYTES}..2**31, got {self.max_frame_bytes!r}"
            )
        if not self.tags or len(set(self.tags)) != len(self.tags):
            raise InvalidArgumentError(f"stage {self.name!r}: tags must be distinct and non-empty")
        if self.gpu_memory_fraction is not None:
            if not isinstance(self.gpu_memory_fraction, (int, float)) or not 0 < self.gpu_memory_fraction <= 1:
                raise InvalidArgumentError(
                    f"stage {self.name!r}: gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction!r}"
                )
            if self.device != "cuda":
                raise InvalidArgumentError(
                    f"stage {self.name!r}: gpu_memory_fraction applies to device='cuda', not {self.device!r}"
                )
        if self.simulated_device is not None:
            if not isinstance(self.simulated_device, SimulatedDevice):
                raise InvalidArgumentError(
                    f"stage {self.name!r}: simulated_device must be a SimulatedDevice "
                    f"(directory, capacity_bytes), got {type(self.simulated_device).__name__}"
                )
            if self.device != "cpu" or self.backend not in ("auto", "portable"):
                raise InvalidArgumentError(
                    f"stage {self.name!r}: simulated_device stands in for a GPU's capacity on "
                    f"device='cpu' with the portable backend, not device={self.device!r} "
                    f"backend={self.backend!r}; on a GPU the real free memory is used: "
                    "remove simulated_device"
                )
        object.__setattr__(self, "runner_args", dict(self.runner_args))
        if self.placement is not None:
            if not isinstance(self.placement, RayPlacement):
                raise InvalidArgumentError(
                    f"stage {self.name!r}: placement must be a RayPlacement, got {type(self.placement).__name__}"
                )
            self.placement.check(self.name, self.ranks)
