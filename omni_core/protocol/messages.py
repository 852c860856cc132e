"""Wire types: one tagged union of msgspec Structs.

Every message carries the protocol version `v`, the caller-supplied idempotency key
`task_id` and the stage `epoch` used for fencing; replies also carry the `rank` that sent
them. The `type` tag is the class name. Structs are frozen so a cached reply can be
re-sent as-is, and unknown fields are refused so that a typo never passes silently.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Union, get_args

import msgspec

from omni_core.protocol.enums import AckStatus, Capability, NackReason, WorkerState
from omni_core.protocol.version import PROTOCOL_VERSION
from omni_core.protocol.weights import (
    MAX_BUCKET_BYTES,
    MAX_HOST_CHARS,
    AdapterTensors,
    DiskSource,
    IpcSource,
    NewWeightsVersion,
    ShmSource,
    WeightSource,
    WeightsVersion,
    source_bytes,
)

MAX_TASK_ID_CHARS = 128
MAX_TAGS = 16
MAX_DETAIL_CHARS = 4096
MAX_PREFIX_WIRE_CHARS = 1024  # Profile.prefix on the wire; the worker accepts far less
MAX_TRACE_PATHS = 16  # Ack.trace_paths: a stop lists one trace (two after an automatic cut)
MAX_PATH_CHARS = 4096
MAX_MEMORY_WAIT_S = 3600.0  # Wake.memory_wait_s: a swap's wait for another stage to leave
# Fields renamed on the wire, old name -> new: a peer still sending the old name is refused
# (BAD_MESSAGE) with the new one named, instead of with a bare "unknown field".
RENAMED_FIELDS: dict[str, str] = {"wait_for_memory_s": "memory_wait_s"}
MAX_LINKS = 8  # a link plan's paths: the own link and up to seven peers of one node
MAX_DEVICE_INDEX = 63
MAX_LINK_SHARE = 1000.0

TaskId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TASK_ID_CHARS)]
Epoch = Annotated[int, msgspec.Meta(ge=0)]
Rank = Annotated[int, msgspec.Meta(ge=0)]
Tag = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Tags = Annotated[tuple[Tag, ...], msgspec.Meta(min_length=1, max_length=MAX_TAGS)]
ElapsedSeconds = Annotated[float, msgspec.Meta(ge=0)]  # a measured duration; configured ones are bounded where set
Bytes = Annotated[int, msgspec.Meta(ge=0)]
MAX_WIRE_INT = 2**63 - 1  # msgpack carries up to 2**64-1; every peer's int64 holds this much
# A Hello's pool bytes per tag: one entry per tag it declares, each a byte count an int64 holds.
PoolBytes = Annotated[dict[Tag, Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]], msgspec.Meta(max_length=MAX_TAGS)]
MAX_RUNNER_COUNTERS = 16
# A counter's or a connector's name: a Python identifier in lower case.
IDENTIFIER_PATTERN = r"^[a-z][a-z0-9_]*$"
CounterName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=IDENTIFIER_PATTERN)]
# A runner's own counters (a cache's hits, misses): a closed set of names per runner, declared
# by the rank's Hello; integers 0..2**63-1.
MAX_DERIVED_CACHES = 8  # Ack.caches_dropped: a runner's weight-derived caches (ModelRunner.derived_caches)
CacheNames = Annotated[tuple[CounterName, ...], msgspec.Meta(max_length=MAX_DERIVED_CACHES)]
RunnerCounters = Annotated[
    dict[CounterName, Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]],
    msgspec.Meta(max_length=MAX_RUNNER_COUNTERS),
]
# A Hello's loaded weights: the names the runner read from its checkpoint at load (vLLM's
# `load_weights` set), `component/name` in a diffusers pipeline. A MoE of 256 experts over 61
# layers has 47k; a runner with more sends none (its Hello says nothing, never a part).
MAX_LOADED_WEIGHTS = 65_536
MAX_WEIGHT_NAME_CHARS = 256
WeightName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_WEIGHT_NAME_CHARS)]
LoadedWeights = Annotated[tuple[WeightName, ...], msgspec.Meta(max_length=MAX_LOADED_WEIGHTS)]


class Message(msgspec.Struct, tag_field="type", tag=True, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Fields every message has."""

    v: int = PROTOCOL_VERSION
    task_id: TaskId
    epoch: Epoch


ENVELOPE_FIELDS = frozenset(("v", "task_id", "epoch"))


def arguments(message: Message) -> dict[str, Any]:
    """A message's own fields, every one but the envelope's (`v`, `task_id`, `epoch`), in the
    order its struct declares them: what a command asks for, what a reply says."""
    # The class's own tuple of names: msgspec.structs.fields evaluates every annotation on each
    # call (a third of a stateless command's cost in the stage core).
    names = type(message).__struct_fields__
    return {name: getattr(message, name) for name in names if name not in ENVELOPE_FIELDS}


# ---------------------------------------------------------------- commands (orchestrator -> worker)


class WrittenWeights(NamedTuple):
    """Weights a command wrote: `durable` where a later start can read them again (a directory,
    a checkpoint), at `path` (None: the runner's own checkpoint, or memory only)."""

    durable: bool
    path: str | None


class Command(Message, kw_only=True, frozen=True):
    """A message the orchestrator sends to a worker; each gets exactly one terminal reply."""

    # The NACK reason that is this command's refusal (the rank is where it was, nothing written
    # or kept mapped) rather than its failure, and the verb that names the refusal's triggers
    # ("{verb}_refused_{state}"); None: no NACK of it is a refusal of that kind.
    refusal_reason: ClassVar[NackReason | None] = None
    refusal_verb: ClassVar[str] = ""

    @property
    def installs_version(self) -> int:
        """The weights version this command makes the rank's once ACKed (P-17); 0: it names none."""
        return 0

    @property
    def writes_weights(self) -> WrittenWeights | None:
        """Where the weights this command writes live once ACKed; None: it writes none."""
        return None


class LinkShare(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One path of a command's link plan (P-18): `peer` is the CUDA device index, as the rank
    sees it, of a GPU whose host link carries `share` of the bytes, relayed over NVLink/P2P;
    None is the rank's own link. Shares are relative (1:1 splits the bytes in halves)."""

    peer: Annotated[int, msgspec.Meta(ge=0, le=MAX_DEVICE_INDEX)] | None = None
    share: Annotated[float, msgspec.Meta(gt=0, le=MAX_LINK_SHARE)] = 1.0


# A Sleep's or Wake's link plan; empty: the own link alone (every worker's behaviour).
Links = Annotated[tuple[LinkShare, ...], msgspec.Meta(max_length=MAX_LINKS)]


class Sleep(Command, kw_only=True, frozen=True):
    """Release GPU memory. Level 1 offloads `weights` to host and discards the rest; level 2
    discards everything except the runner's small buffers. `tags=None` means every tag.
    `links` (sent only to a worker that declares Capability.MULTI_PATH, left off the wire
    when empty) spreads the offload's copies over the planned host links.

    `incoming_bytes` (a swap's outgoing half; sent only to a worker that declares
    Capability.SWAP, left off the wire at 0): what another stage's wake maps on this rank's
    device while this sleep runs. A rank whose device has that much free memory may keep
    its allocations until its last copy has landed and release them all then, so that no
    release slows the incoming stage's copies; otherwise it releases each as its copy lands
    (the incoming stage waits for that memory). A performance hint: the reply, the state
    and the memory released by the end are the same either way, and a worker may ignore it."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("links", "incoming_bytes")

    level: Literal[1, 2] = 1
    tags: Tags | None = None
    links: Links = ()
    incoming_bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)] = 0


class Wake(Command, kw_only=True, frozen=True):
    """Map the tags back (and restore what level 1 offloaded). `tags=None` means every tag.

    Before each allocation the rank checks that the device has that much free memory
    (P-16). `memory_wait_s` is how long it may wait for memory another stage is
    releasing (a swap); when the memory is not there in time it unmaps what this wake
    mapped and answers NACK NO_MEMORY naming who holds the device, its state unchanged.
    `memory_wait_s` is left off the wire at 0, so a Wake without waiting is the frame
    every earlier worker knows (a worker lists Capability.SWAP before an engine asks it to
    wait); see `codec.encode`."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("memory_wait_s", "links")
    refusal_reason = NackReason.NO_MEMORY
    refusal_verb = "wake"

    tags: Tags | None = None
    memory_wait_s: Annotated[float, msgspec.Meta(ge=0, le=MAX_MEMORY_WAIT_S)] = 0.0
    links: Links = ()  # as for Sleep: the restore's copies over the planned host links


class ReloadWeights(Command, kw_only=True, frozen=True):
    """Refill the weights after a level-2 sleep (or to swap weights in place while ACTIVE).
    `source` is runner-specific (a path, a seed); None means the runner's own source."""

    refusal_reason = NackReason.INVALID_ARGUMENT
    refusal_verb = "reload"

    source: str | None = None

    @property
    def writes_weights(self) -> WrittenWeights:
        return WrittenWeights(durable=True, path=self.source)


class UpdateWeights(Command, kw_only=True, frozen=True):
    """Replace the weights in place with those of `source`, as weights version `version` (P-17).

    `version` is the caller's and must be above the rank's current one (else NACK
    STALE_VERSION naming both). Legal where the weights are resident: ACTIVE, PARTIAL with
    `weights` awake, NEEDS_RELOAD (where it replaces the reload). The rank checks every name,
    shape and dtype and opens every handle before it writes anything (a refusal: NACK
    INVALID_ARGUMENT, state and version unchanged); every bucket written, it drops the runner's
    weight-derived caches, commits the new version and ACKs it, naming them in
    `caches_dropped`. A failure once writing began leaves it NEEDS_RELOAD at the version it
    was at (NACK UPDATE_FAILED).

    `flush_cache` (SGLang's field): True drops every derived cache; False keeps the caches
    whose entries are keyed by the weights they came from, and is refused before writing
    (INVALID_ARGUMENT) when the runner holds a cache that is not keyed so."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("flush_cache",)
    refusal_reason = NackReason.INVALID_ARGUMENT
    refusal_verb = "update"

    version: NewWeightsVersion
    source: WeightSource
    flush_cache: bool = True

    @property
    def installs_version(self) -> int:
        return self.version

    @property
    def writes_weights(self) -> WrittenWeights:
        # Only a directory outlives the process; shm, IPC and collective sources are memory.
        if isinstance(self.source, DiskSource):
            return WrittenWeights(durable=True, path=self.source.path)
        return WrittenWeights(durable=False, path=None)


class InitWeightGroup(Command, kw_only=True, frozen=True):
    """Join the process group a trainer broadcasts updates from (`CollectiveSource`). The
    trainer is group rank 0 and serves the rendezvous at `address:port`; this rank is
    `rank_offset + rank` of `world_size`. Never changes the lifecycle state. Joining the same
    group again is ALREADY; another group while one is joined is INVALID_ARGUMENT.
    `timeout_s` bounds each broadcast of the group; `join_timeout_s` (None: `timeout_s`) bounds
    the rendezvous, within the stage's deadline for the command, so a trainer that never
    answers is a refusal (NACK INVALID_ARGUMENT, no group joined), not a rank gone silent."""

    group: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    address: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_CHARS)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    world_size: Annotated[int, msgspec.Meta(ge=2, le=65536)]
    rank_offset: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    backend: Literal["gloo", "nccl"] = "gloo"
    timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] = 300.0
    join_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] | None = None

    def __post_init__(self) -> None:
        if self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} must be below world_size {self.world_size}: "
                "group rank 0 is the trainer, the stage's ranks follow it"
            )


class ShareWeights(Command, kw_only=True, frozen=True):
    """Share this rank's weights with another stage on the same node (a trainer stage's half of
    `Engine.transfer_weights`): the rank copies them into buckets of at most `bucket_bytes`
    (host shared memory, or CUDA IPC on a GPU) and lists them in its Ack's `shared`, which the
    engine sends on as an `UpdateWeights` source. The buckets live until the next ShareWeights
    or Shutdown. Legal in ACTIVE and PARTIAL with valid weights awake; never changes the state."""

    bucket_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BUCKET_BYTES)] = 256 << 20


MAX_TRANSFER_BYTES = 1 << 36  # one request's intermediate (hidden states, embeddings, KV): 64 GiB
MAX_TRANSFER_NAMES = 16  # the tensors one transfer carries, named by the runners' connectors
DEFAULT_TRANSFER_BYTES = 1 << 30
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TASK_ID_CHARS, pattern=r"^[A-Za-z0-9_.:/-]+$")]
ConnectorName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=IDENTIFIER_PATTERN)]
TransferBytes = Annotated[int, msgspec.Meta(ge=1, le=MAX_TRANSFER_BYTES)]


class TransferOut(Command, kw_only=True, frozen=True):
    """The producer's half of a stage-to-stage transfer (P-22): run the runner's export of
    `names` for `payload` (a text stage's prompt embeddings, hidden states) and copy the tensors
    into buckets of at most `bucket_bytes` (host shared memory, or CUDA IPC on a GPU: the planes
    of ShareWeights), held for `request_id` until its TransferRelease or Shutdown. The Ack lists
    them in `shared` and names the weights that computed them in `weights_version`. Refused
    (INVALID_ARGUMENT, nothing held) when a name is not exported or the tensors exceed
    `max_bytes`. Legal in ACTIVE; never changes the state."""

    request_id: RequestId
    names: Annotated[tuple[ConnectorName, ...], msgspec.Meta(min_length=1, max_length=MAX_TRANSFER_NAMES)]
    payload: Any = None
    max_bytes: TransferBytes = DEFAULT_TRANSFER_BYTES
    bucket_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_BUCKET_BYTES)] = 256 << 20


class TransferIn(Command, kw_only=True, frozen=True):
    """The consumer's half (P-22): open the producer's buckets `source` (as an update opens
    them: authenticated, read-only, every name, shape and dtype checked against the runner's
    imports before anything is kept) and hold a copy for `request_id`, which the consumer's
    request then names (`{"transfer": request_id}` in its payload). `producer_version` is the
    producer's weights version its Ack named; `expect_version`, the version the request was
    declared for (None: any, the result names it): a mismatch is refused (INVALID_ARGUMENT),
    nothing kept. Legal in ACTIVE; never changes the state."""

    request_id: RequestId
    producer_version: WeightsVersion
    source: ShmSource | IpcSource
    expect_version: WeightsVersion | None = None
    max_bytes: TransferBytes = DEFAULT_TRANSFER_BYTES

    def __post_init__(self) -> None:
        carried = source_bytes(self.source)
        if carried > self.max_bytes:
            raise ValueError(
                f"the transfer carries {carried} bytes, over its max_bytes {self.max_bytes}; "
                "raise max_bytes or export fewer tensors"
            )


class TransferRelease(Command, kw_only=True, frozen=True):
    """Drop what this rank holds for `request_id` (P-22): a producer's buckets, a consumer's
    imported copy. Nothing held is ALREADY-free: answered Ack all the same. Legal in every
    settled state; never changes the state."""

    request_id: RequestId


MAX_ADAPTERS = 64  # a rank's adapters at once (an Ack lists them all); max_loras is at most this
MAX_ADAPTER_RANK = 1024
MAX_LORA_ALPHA = 1e6
MAX_TARGET_MODULES = 32
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9_.:/-]+$"
MAX_ADAPTER_NAME_CHARS = 128
AdapterName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_ADAPTER_NAME_CHARS, pattern=ADAPTER_NAME_PATTERN)
]
MODULE_NAME_PATTERN = r"^[A-Za-z0-9_.]+$"
ModuleName = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=MODULE_NAME_PATTERN)]
AdapterVersion = Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]


class Execute(Command, kw_only=True, frozen=True):
    """Run one request on the model. Legal only in ACTIVE (P-7). `adapter` names the LoRA
    adapter to run it with (P-20; left off the wire when None): one the rank holds `loaded`,
    else NACK ADAPTER_UNAVAILABLE naming it."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("adapter",)

    payload: Any = None
    adapter: AdapterName | None = None


class HoldRequests(Command, kw_only=True, frozen=True):
    """Pause mode `keep` (vLLM's pause_generation(mode="keep")): `hold=True` freezes the
    requests running on the rank where they are, their state and KV kept by the runner, so
    an UpdateWeights may run beside them; `hold=False` lets them go on, each recording the
    token where it resumed and the version it resumed under (`Result.version_spans`).
    `clear_cache` (with `hold=True`) drops their KV instead: each restarts generation from
    its prompt at the release, and its Result says how many tokens it discarded. Legal in
    ACTIVE; never changes the lifecycle state. A runner that cannot freeze its requests
    finishes them before the hold is answered (as mode `wait`)."""

    hold: bool
    clear_cache: bool = False


class Status(Command, kw_only=True, frozen=True):
    """Report state and memory; never changes anything and is never cached."""


class Shutdown(Command, kw_only=True, frozen=True):
    """Release pools and exit cleanly. Legal from every state, FAILED included."""


class Profile(Command, kw_only=True, frozen=True):
    """Start (`start=True`) or stop the rank's profiler. Never changes the lifecycle state, so a
    profile may span sleeps and wakes. `prefix` becomes part of the trace's file name: the
    worker refuses anything but 1-64 of [A-Za-z0-9_.-] without '..' (NACK INVALID_ARGUMENT,
    `omni_core.protocol.profile`); the wire bound below only keeps the frame small. The stop's
    Ack lists the trace files in `trace_paths`."""

    start: bool
    prefix: Annotated[str, msgspec.Meta(max_length=MAX_PREFIX_WIRE_CHARS)] | None = None


class ResetPrefixCache(Command, kw_only=True, frozen=True):
    """Drop what the rank's runner caches across requests (vLLM's prefix KV blocks, a diffusion
    runner's prompt embeddings) without releasing or remapping any memory: the next requests
    compute afresh, e.g. after a weight update. Legal in ACTIVE and PARTIAL; never changes the
    state."""


MAX_SAVE_RANKS = 65536
MIN_SAVE_FILE_BYTES = 1 << 20
DEFAULT_SAVE_FILE_BYTES = 5 << 30  # vLLM's save_sharded_state max_size


class SaveWeights(Command, kw_only=True, frozen=True):
    """Write the weights the rank holds now, at its weights version, to `directory` on its disk
    (vLLM's save_sharded_state): safetensors files of at most `max_file_bytes` each (one tensor
    larger than that gets a file of its own), and an index naming the weights version and the
    checkpoint it derives from. A stage of one rank writes `directory` itself; of `ranks`
    ranks, each writes `directory/rank-<r>` (its own shard). The rank writes a temporary
    directory beside the target and renames it into place last, so a write that fails leaves
    nothing that looks complete; a target that exists is refused unless `overwrite`, and a
    symlink on the way is refused. `ReloadWeights` and a restart accept what it wrote. Legal
    where valid weights are awake: ACTIVE, PARTIAL with `weights` awake; never changes the
    state. A rank whose runner cannot save (capability `save_weights` not declared) refuses
    UNSUPPORTED; a write that fails is NACK INVALID_ARGUMENT naming why, nothing left behind."""

    directory: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    ranks: Annotated[int, msgspec.Meta(ge=1, le=MAX_SAVE_RANKS)] = 1
    max_file_bytes: Annotated[int, msgspec.Meta(ge=MIN_SAVE_FILE_BYTES, le=MAX_BUCKET_BYTES)] = DEFAULT_SAVE_FILE_BYTES
    overwrite: bool = False


class AddAdapter(Command, kw_only=True, frozen=True):
    """Load the LoRA adapter `name` (P-20) from `source`, a PEFT directory on the rank's disk
    (held to the operator's allowed reload paths), as adapter version `version`, made for base
    weights version `base_version` (None: the version the rank holds now). `adapter_id` is the
    caller's integer id (vLLM's `lora_int_id`), unique among the rank's adapters; `rank` and
    `target_modules` are what the caller expects the directory to hold, checked before anything
    is loaded.

    Refused (INVALID_ARGUMENT, nothing loaded) when `base_version` is not the rank's weights
    version, unless `rebind` (the caller vouches the adapter fits the weights held now); when
    `rank` is above the rank's `max_lora_rank`; when the rank holds `max_loras` adapters, all
    pinned. At `max_loras` otherwise the least recently used unpinned adapter is evicted and
    named in the Ack's `adapters_evicted`. The same name, version, source and base version
    already loaded is ALREADY; another version of the name replaces it, another source under the
    version held is refused (a Result's adapter_version names one content). Legal where the weights
    are valid and awake: ACTIVE, PARTIAL with `weights` awake. Never changes the state.

    `tensors` (adapter-only refit): the adapter's tensors come through a weight-update plane
    (shm buckets, typed CUDA IPC handles, the weight group's broadcast) instead of `source`,
    which then only labels them (SGLang's "__tensor__"). Every tensor of an adapter of `rank`
    on `target_modules` is sent, by PEFT's names, and checked (name, shape, dtype, every bucket
    opened) before anything is written. An adapter of the name held `loaded` is refit in place
    (no copy of the base weights) and `version` must be above the one held; `lora_alpha`
    (None: the held adapter's, else `rank`) scales it."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("tensors", "lora_alpha")

    name: AdapterName
    adapter_id: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    source: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS)]
    rank: Annotated[int, msgspec.Meta(ge=1, le=MAX_ADAPTER_RANK)]
    target_modules: Annotated[tuple[ModuleName, ...], msgspec.Meta(min_length=1, max_length=MAX_TARGET_MODULES)]
    version: AdapterVersion = 1
    base_version: WeightsVersion | None = None
    pinned: bool = False
    rebind: bool = False
    tensors: AdapterTensors | None = None
    lora_alpha: Annotated[float, msgspec.Meta(gt=0, le=MAX_LORA_ALPHA)] | None = None


class RemoveAdapter(Command, kw_only=True, frozen=True):
    """Unload the adapter `name` (P-20); a name the rank does not hold is ALREADY. Legal where
    AddAdapter is, and in NEEDS_RELOAD and SLEEPING for an adapter a level-2 sleep discarded
    (nothing is left to unload). Never changes the state."""

    name: AdapterName


class PinAdapter(Command, kw_only=True, frozen=True):
    """Pin (`pinned`) or unpin the adapter `name` (P-20): a pinned adapter is never evicted.
    Already so: ALREADY; a name the rank does not hold: INVALID_ARGUMENT. Legal where AddAdapter
    is. Never changes the state."""

    name: AdapterName
    pinned: bool = True


class ListAdapters(Command, kw_only=True, frozen=True):
    """List the rank's adapters in the Ack's `adapters` (P-20), those a level-2 sleep discarded
    (`gone`) and those a base update left behind (`stale`) among them. Legal in ACTIVE,
    SLEEPING, PARTIAL and NEEDS_RELOAD; never changes anything."""


class AdapterInfo(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One adapter as a rank holds it (P-20). `status`: `loaded` (served), `gone` (a level-2
    sleep discarded it: add it again), `stale` (made for base weights `base_version`, and the
    rank's weights are another version now: add it again for them, or with `rebind`)."""

    name: AdapterName
    adapter_id: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
    version: AdapterVersion
    base_version: WeightsVersion
    rank: Annotated[int, msgspec.Meta(ge=1, le=MAX_ADAPTER_RANK)]
    target_modules: Annotated[tuple[ModuleName, ...], msgspec.Meta(max_length=MAX_TARGET_MODULES)]
    pinned: bool = False
    status: Literal["loaded", "gone", "stale"] = "loaded"


Adapters = Annotated[tuple[AdapterInfo, ...], msgspec.Meta(max_length=MAX_ADAPTERS)]
AdapterNames = Annotated[tuple[AdapterName, ...], msgspec.Meta(max_length=MAX_ADAPTERS)]


# ---------------------------------------------------------------- replies (worker -> orchestrator)


class MemoryReport(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Per-process memory figures around one command (never device-wide deltas).

    `pool_bytes_*` are the backend's own bytes per tag; `process_bytes_*` are this process's
    GPU memory as seen by `process_bytes_source` ("nvml", "torch", "none" ...).
    """

    pool_bytes_before: dict[str, Bytes]
    pool_bytes_after: dict[str, Bytes]
    process_bytes_before: Bytes | None = None
    process_bytes_after: Bytes | None = None
    process_bytes_source: str = "none"

    def freed_bytes(self) -> dict[str, int]:
        """Bytes released per tag (negative when a tag grew, e.g. on wake)."""
        tags = self.pool_bytes_before.keys() | self.pool_bytes_after.keys()
        return {tag: self.pool_bytes_before.get(tag, 0) - self.pool_bytes_after.get(tag, 0) for tag in sorted(tags)}


class Reply(Message, kw_only=True, frozen=True):
    """A message a worker sends; `rank` names the sender."""

    rank: Rank


class Ack(Reply, kw_only=True, frozen=True):
    """The command completed. `state` is the worker's state after it; `asleep_tags` the tags
    not resident now. `status` is ALREADY when nothing needed doing. `weights_version` is the
    version of the weights the rank holds (0: its own source, never updated; P-17); left off
    the wire at 0, so an Ack without updates is the frame every earlier peer knows."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = (
        "weights_version",
        "shared",
        "runner_counters",
        "caches_dropped",
        "adapters",
        "adapters_evicted",
    )

    command: str
    state: WorkerState
    status: AckStatus = AckStatus.OK
    asleep_tags: tuple[str, ...] = ()
    memory: MemoryReport | None = None
    duration_s: ElapsedSeconds = 0.0
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)] = ""  # FAILED: why
    # Profile stop: the gzip Chrome traces this rank writes. A path exists once its
    # compression has finished (written under a temporary name, then renamed).
    trace_paths: Annotated[
        tuple[Annotated[str, msgspec.Meta(max_length=MAX_PATH_CHARS)], ...], msgspec.Meta(max_length=MAX_TRACE_PATHS)
    ] = ()
    weights_version: WeightsVersion = 0
    shared: ShmSource | IpcSource | None = None  # ShareWeights, TransferOut: the buckets it holds
    runner_counters: RunnerCounters = {}  # the runner's counters now: names its Hello declared
    # ReloadWeights, UpdateWeights: the runner's weight-derived caches dropped before this Ack
    # (ModelRunner.derived_caches), so no later request reuses what older weights computed.
    caches_dropped: CacheNames = ()
    # The adapter commands (P-20): every adapter the rank holds after the command, and those an
    # AddAdapter evicted (least recently used, unpinned) to make room.
    adapters: Adapters = ()
    adapters_evicted: AdapterNames = ()


class Nack(Reply, kw_only=True, frozen=True):
    """The command was refused and had no effect; `state` is the worker's state now, and
    `weights_version` the version it holds (or held last, in NEEDS_RELOAD)."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("weights_version",)

    command: str
    reason: NackReason
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)] = ""
    state: WorkerState
    weights_version: WeightsVersion = 0


MAX_VERSION_SPANS = 64  # Result.version_spans: a request held through that many updates at most


class VersionSpan(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where a Result's output changed weights: its tokens from `start_token` (0-based) up to
    the next span's start (the last span: to the end) were computed under `weights_version`."""

    weights_version: WeightsVersion
    start_token: Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)]


class Result(Reply, kw_only=True, frozen=True):
    """Output of an Execute; `weights_version` names the weights that produced it (the last
    ones, for a request held through an update), `adapter` and `adapter_version` the LoRA
    adapter it ran with (P-20; None and 0: none). `version_spans`, for a request held by
    HoldRequests while the weights changed: which tokens each version computed, in order
    (empty: every token under `weights_version`); `discarded_tokens`: the tokens it had
    generated before a hold with clear_cache dropped its KV (it restarted from its prompt)."""

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = (
        "weights_version",
        "runner_counters",
        "adapter",
        "adapter_version",
        "version_spans",
        "discarded_tokens",
    )

    output: Any = None
    duration_s: ElapsedSeconds = 0.0
    weights_version: WeightsVersion = 0
    runner_counters: RunnerCounters = {}  # as on Ack
    adapter: AdapterName | None = None
    adapter_version: AdapterVersion = 0
    version_spans: Annotated[tuple[VersionSpan, ...], msgspec.Meta(max_length=MAX_VERSION_SPANS)] = ()
    discarded_tokens: Annotated[int, msgspec.Meta(ge=0, le=MAX_WIRE_INT)] = 0


class Hello(Reply, kw_only=True, frozen=True):
    """First message of a worker: who it is, what it can do, and (`proof`) that the engine
    spawned it: an HMAC with the rank's secret, see `omni_core.protocol.auth`."""

    stage: Annotated[str, msgspec.Meta(max_length=64)] = ""
    proof: Annotated[str, msgspec.Meta(max_length=128)] = ""
    pid: Annotated[int, msgspec.Meta(ge=0)]
    device: str
    backend: str
    backend_reason: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)] = ""  # why `auto` chose it
    # CUDA device indices (as this rank sees them) it can relay copies through (P2P works).
    relay_peers: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_DEVICE_INDEX)], ...], msgspec.Meta(max_length=MAX_LINKS)
    ] = ()
    tags: tuple[Tag, ...]
    capabilities: tuple[Capability, ...] = ()
    state: WorkerState = WorkerState.ACTIVE
    detail: Annotated[str, msgspec.Meta(max_length=MAX_DETAIL_CHARS)] = ""  # why, if not ACTIVE
    weights_version: WeightsVersion = 0
    # The bytes each tag's pool holds once loaded, so the stage's memory is known before any
    # lifecycle call; empty: not reported (a worker that predates the field).
    pool_bytes: PoolBytes = {}
    # The runner's counters as loaded: their names are the closed set its replies may carry.
    runner_counters: RunnerCounters = {}
    # The weights the runner read from its checkpoint at load, sorted; empty: none read (a
    # dummy load's random weights) or not reported (a runner that does not say, or more names
    # than MAX_LOADED_WEIGHTS).
    loaded_weights: LoadedWeights = ()

    OPTIONAL_ON_WIRE: ClassVar[tuple[str, ...]] = ("weights_version", "pool_bytes", "runner_counters", "loaded_weights")

    def __post_init__(self) -> None:
        unknown = sorted(set(self.pool_bytes) - set(self.tags))
        if unknown:
            raise ValueError(f"pool_bytes names tags {unknown} that are not among this Hello's tags {list(self.tags)}")


# The commands and replies, each listed once: the unions are what the codec decodes into, the
# tuples what the rest iterates.
AnyCommand = Union[  # noqa: UP007
    Sleep,
    Wake,
    ReloadWeights,
    Execute,
    Status,
    Shutdown,
    Profile,
    UpdateWeights,
    InitWeightGroup,
    ShareWeights,
    ResetPrefixCache,
    SaveWeights,
    AddAdapter,
    RemoveAdapter,
    PinAdapter,
    ListAdapters,
    HoldRequests,
    TransferOut,
    TransferIn,
    TransferRelease,
]
AnyReply = Union[Ack, Nack, Result, Hello]  # noqa: UP007
AnyMessage = Union[AnyCommand, AnyReply]  # noqa: UP007
COMMAND_TYPES: tuple[type[Command], ...] = get_args(AnyCommand)
REPLY_TYPES: tuple[type[Reply], ...] = get_args(AnyReply)
MESSAGE_TYPES: tuple[type[Message], ...] = COMMAND_TYPES + REPLY_TYPES

# What `omni_core.protocol` exports of this module (it star-imports it): a new message is
# exported by its line here, beside its struct.
__all__ = [
    "COMMAND_TYPES",
    "WrittenWeights",
    "MAX_ADAPTERS",
    "MAX_ADAPTER_RANK",
    "MAX_DETAIL_CHARS",
    "MAX_LINKS",
    "MAX_LOADED_WEIGHTS",
    "MAX_MEMORY_WAIT_S",
    "MAX_VERSION_SPANS",
    "MAX_TRANSFER_BYTES",
    "MESSAGE_TYPES",
    "REPLY_TYPES",
    "Ack",
    "AdapterInfo",
    "AddAdapter",
    "AnyCommand",
    "AnyMessage",
    "AnyReply",
    "Command",
    "Execute",
    "Hello",
    "HoldRequests",
    "InitWeightGroup",
    "LinkShare",
    "ListAdapters",
    "MemoryReport",
    "Message",
    "Nack",
    "PinAdapter",
    "Profile",
    "ReloadWeights",
    "RemoveAdapter",
    "Reply",
    "ResetPrefixCache",
    "Result",
    "SaveWeights",
    "ShareWeights",
    "Shutdown",
    "Sleep",
    "Status",
    "TransferIn",
    "TransferOut",
    "TransferRelease",
    "UpdateWeights",
    "VersionSpan",
    "Wake",
    "arguments",
]
