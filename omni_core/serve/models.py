"""Request and response bodies of the HTTP API (pydantic, so the OpenAPI schema names them).

Request bodies forbid unknown fields: a client or router that misspells or adds a field
(production-stack #953 dropped `level`) gets a 422 naming it instead of a silent default; and
they are strict: a value of the wrong JSON type is refused (422), never converted.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from omni_core.protocol.messages import DEFAULT_SAVE_FILE_BYTES, MIN_SAVE_FILE_BYTES
from omni_core.protocol.weights import MAX_BUCKET_BYTES, MAX_WEIGHTS_VERSION, MIN_NEW_WEIGHTS_VERSION


class _Strict(BaseModel):
    # strict: no silent conversion ("1" is not the level 1, true is not the stage id 1); no
    # NaN or Infinity (Python's JSON reader takes them; no deadline or wait means them)
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SleepBody(_Strict):
    level: int = Field(1, description="1: offload weights to host, discard the rest; 2: discard everything")
    tags: list[str] | None = Field(None, description="tags to put to sleep; null: every tag of the stage")
    timeout_s: float | None = Field(None, description="deadline of this command; null: the stage's deadline_s")
    abort_in_flight: bool = Field(False, description="fail in-flight requests now instead of draining them")


class WakeBody(_Strict):
    tags: list[str] | None = Field(None, description="tags to wake; null: every tag asleep")
    timeout_s: float | None = None


class ReloadBody(_Strict):
    source: str | None = Field(
        None,
        description="checkpoint to reload from; must lie under the config's "
        "allowed_reload_sources. null: the runner's own weights",
    )
    timeout_s: float | None = None


class SaveWeightsBody(_Strict):
    """POST /v1/stages/{name}/save_weights: the stage's weights, at its version, to disk."""

    directory: str = Field(
        ...,
        min_length=1,
        max_length=4096,
        description="where the ranks write: must lie under the config's allowed_reload_sources; a "
        "stage of several ranks writes one rank-<r> directory each inside it",
    )
    overwrite: bool = Field(False, description="replace a directory that exists (else refused: 400)")
    max_file_bytes: int = Field(
        DEFAULT_SAVE_FILE_BYTES, ge=MIN_SAVE_FILE_BYTES, le=MAX_BUCKET_BYTES, description="at most this per file"
    )
    timeout_s: float | None = None


class UpdateWeightsBody(_Strict):
    """POST /v1/stages/{name}/update_weights: new weights as `version` (P-17)."""

    version: int = Field(
        ...,
        ge=MIN_NEW_WEIGHTS_VERSION,
        le=MAX_WEIGHTS_VERSION,
        description="the new weights version: above the stage's `weights_version`",
    )
    source: str | dict[str, Any] = Field(
        ...,
        description="a checkpoint path (under allowed_reload_sources), or a "
        'typed source: {"type": "disk", "path"}, or the '
        "shm, ipc or collective source a WeightSender made "
        "(msgspec.to_builtins of it), decoded strictly",
    )
    timeout_s: float | None = None


FLUSH_CACHE_DOC = (
    "flush_cache true (the default) drops every cache the weights produced (prefix KV blocks) before "
    "the update is acknowledged; false keeps the caches keyed by weights version and is refused "
    "(400, nothing written) where the runner holds one keyed by prompt alone."
)


class SglangUpdateFromDiskBody(_Strict):
    """SGLang's POST /update_weights_from_disk (UpdateWeightFromDiskReqInput)."""

    model_path: str = Field(..., description="the checkpoint; must lie under allowed_reload_sources")
    load_format: str | None = Field(None, description="only null or 'safetensors' (what the ranks read)")
    flush_cache: bool = Field(True, description=FLUSH_CACHE_DOC)
    abort_all_requests: bool = Field(
        False, description="true: in-flight requests are aborted (409) and the update runs at once; false: they finish"
    )
    weight_version: str | None = Field(
        None,
        description="the new version's label (opaque, 1 to 256 characters); null: the next version. "
        "omni-core's integer version is the label's value when it is a decimal integer above "
        "the stage's, else the next one",
    )


class VllmInitInfo(_Strict):
    master_address: str = Field(..., description="the trainer's rendezvous host (it is group rank 0)")
    master_port: int = Field(..., description="the trainer's rendezvous port")
    rank_offset: int = Field(1, description="group rank of the stage's rank 0")
    world_size: int = Field(..., description="the trainer plus every rank of the stage")
    packed: bool = Field(False, description="false only: the ranks take each tensor broadcast whole (vLLM >= 0.28)")


class VllmInitWeightTransferBody(_Strict):
    """vLLM's POST /init_weight_transfer_engine (its NCCL backend's init_info)."""

    init_info: VllmInitInfo


class VllmUpdateInfo(_Strict):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    packed: bool = Field(False, description="false only: each tensor broadcast whole, in this order")
    packed_buffer_size_bytes: int | None = Field(
        None, description="vLLM's packed-broadcast buffer size: taken with packed false, where it has no effect"
    )
    packed_num_buffers: int | None = Field(
        None, description="vLLM's packed-broadcast buffer count: taken with packed false, where it has no effect"
    )


class VllmUpdateWeightsBody(_Strict):
    """vLLM's POST /update_weights (its NCCL backend's update_info), plus omni-core's version."""

    update_info: VllmUpdateInfo
    version: int | None = Field(
        None,
        ge=1,
        le=(1 << 63) - 1,
        description="omni-core's addition: the new weights version, above the stage's; null (vLLM's "
        "clients send none): the next one",
    )


class SglangInitGroupBody(_Strict):
    """SGLang's POST /init_weights_update_group (InitWeightsUpdateGroupReqInput)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


class SglangUpdateFromDistributedBody(_Strict):
    """SGLang's POST /update_weights_from_distributed (UpdateWeightsFromDistributedReqInput)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = Field(True, description=FLUSH_CACHE_DOC)
    abort_all_requests: bool = Field(
        False, description="true: in-flight requests are aborted (409) and the update runs at once; false: they finish"
    )
    weight_version: str | None = Field(
        None, description="the new version's label (opaque); null: the next version (see update_weights_from_disk)"
    )


class SwapBody(_Strict):
    """POST /v1/swap: `out` sleeps while `in` wakes, both at once (P-16)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True, allow_inf_nan=False)
    out: str = Field(..., description="the stage to put to sleep")
    in_: str = Field(..., alias="in", description="the stage to wake (every tag asleep)")
    level: int = Field(1, description="the outgoing stage's sleep level: 1 offloads weights to host, 2 discards all")
    tags: list[str] | None = Field(None, description="the outgoing stage's tags to put to sleep; null: every tag")
    memory_wait_s: float | None = Field(
        None, description="how long each incoming rank may wait for free device memory; null: half the deadline"
    )
    timeout_s: float | None = Field(
        None, description="deadline of both halves; null: the longer of the two stages' deadline_s"
    )


class ExecuteBody(_Strict):
    payload: Any = Field(None, description='the runner\'s request, e.g. {"seed": 1, "batch": 2} for synthetic')
    timeout_s: float | None = Field(
        None, description="deadline of this request, queueing included; null: the stage's request_timeout_s"
    )
    adapter: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9_.:/-]+$",
        description="the LoRA adapter to run it with (P-20); refused naming it when a rank does not hold it loaded",
    )


class AdmissionBody(_Strict):
    policy: str = Field(..., description="queue, reject or wake")


class VllmSleepBody(_Strict):
    """vLLM's POST /sleep, as a JSON body; the same fields as its query string."""

    level: int | None = Field(None, description="1 or 2; null: the query's level, else 1")
    mode: str | None = Field(
        None,
        description="abort (fail in-flight requests), wait (drain them) or keep (as wait: see "
        "docs/http_routes.md); null: the query's, else abort",
    )
    tags: list[str] | None = Field(None, description="tags to put to sleep; null: every tag of the stage")


class VllmWakeBody(_Strict):
    """vLLM's POST /wake_up, as a JSON body; the same field as its query string."""

    tags: list[str] | None = Field(None, description="tags to wake; null: every tag asleep")


class OmniSleepBody(_Strict):
    """vLLM-Omni's POST /v1/omni/sleep (its OmniSleepRequest: stage_ids required and not
    empty, level 2 unless given)."""

    stage_ids: list[int | str] = Field(
        ..., min_length=1, description="stage indices (config order) or names; at least one"
    )
    level: int = Field(2, description="1: offload weights to host, discard the rest; 2: discard everything")
    tags: list[str] | None = Field(None, description="omni-core's addition: tags to put to sleep; null: every tag")


class OmniWakeBody(_Strict):
    """vLLM-Omni's POST /v1/omni/wakeup (its OmniWakeupRequest: stage_ids required and not empty)."""

    stage_ids: list[int | str] = Field(
        ..., min_length=1, description="stage indices (config order) or names; at least one"
    )
    tags: list[str] | None = Field(None, description="omni-core's addition: tags to wake; null: every tag asleep")


class SglangMemoryBody(_Strict):
    """SGLang's POST /release_memory_occupation and /resume_memory_occupation."""

    tags: list[str] | None = Field(None, description="tags to release or resume; null: every tag")


class SglangReleaseBody(SglangMemoryBody):
    level: int = Field(
        1,
        description="omni-core's addition: 1 keeps the weights in host memory (SGLang's "
        "--enable-weights-cpu-backup), 2 discards them (SGLang's default)",
    )


class CollectiveRpcBody(BaseModel):
    """vLLM's POST /collective_rpc; only `reload_weights` is served."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


class AdapterModel(BaseModel):
    name: str
    adapter_id: int
    version: int
    base_version: int = Field(description="the base weights version it is bound to")
    rank: int
    target_modules: list[str]
    pinned: bool
    status: str = Field(description="loaded; gone (a level-2 sleep discarded it); stale (other base weights now)")


class LoadLoraBody(BaseModel):
    """vLLM's and SGLang's body of a LoRA load (`lora_name`, `lora_path`); SGLang's `pinned`."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$")
    lora_path: str = Field(min_length=1, max_length=4096, description="a PEFT directory under allowed_reload_sources")
    pinned: bool = False
    load_inplace: bool = Field(False, description="vLLM's: replace an adapter of that name (omni-core always does)")


class LoadLoraTensorsBody(BaseModel):
    """SGLang's body of a LoRA load from tensors (`LoadLoRAAdapterFromTensorsReqInput`), with
    omni-core's typed `source` in place of its pickled `serialized_tensors`, and `version`."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$")
    config_dict: dict[str, Any] = Field(
        default_factory=dict,
        description="PEFT's LoRA config: r, lora_alpha and target_modules are read (absent: the "
        "tensors' names and shapes say the rank and modules, alpha is the adapter's held one or r)",
    )
    source: dict[str, Any] | None = Field(
        None,
        description="the adapter's tensors by PEFT's names: msgspec.to_builtins of what WeightSender.share "
        'returns ({"type": "shm"|"ipc", "buckets": [...]}), or {"type": "collective", "tensors": [...]} '
        "broadcast over the weight group",
    )
    serialized_tensors: str | list[str] | None = Field(
        None, description="refused unless empty: SGLang's are pickles; send `source`"
    )
    pinned: bool = False
    version: int | None = Field(
        None, ge=1, le=2**63 - 1, description="omni-core's: the adapter's new version (null: one above the held one)"
    )
    lora_id: str | None = Field(None, max_length=128, description="SGLang's internal id: not used")
    load_format: str | None = Field(None, description="refused unless null: the tensors come whole, by name")
    added_tokens_config: dict[str, Any] | None = Field(None, description="refused unless null")


class AddAdapterBody(_Strict):
    """POST /v1/stages/{name}/adapters: the protocol's AddAdapter from a directory (P-20)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$", description="the adapter's name")
    source: str = Field(min_length=1, max_length=4096, description="a PEFT directory under allowed_reload_sources")
    rank: int | None = Field(None, ge=1, le=1024, description="null: adapter_config.json's r")
    target_modules: list[str] | None = Field(None, max_length=32, description="null: adapter_config.json's")
    version: int = Field(1, ge=0, le=2**63 - 1, description="the adapter's own version")
    base_version: int | None = Field(None, ge=0, le=2**63 - 1, description="null: the weights the stage holds")
    pinned: bool = False
    rebind: bool = Field(False, description="serve it on the weights held, whatever base_version says")
    timeout_s: float | None = None


class PinAdapterBody(_Strict):
    pinned: bool = Field(True, description="false unpins")
    timeout_s: float | None = None


class TimeoutBody(_Strict):
    timeout_s: float | None = None


class UnloadLoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$")
    lora_int_id: int | None = Field(None, description="vLLM's; the name alone is what omni-core unloads by")


class SglangLoraModel(BaseModel):
    success: bool
    error_message: str = ""
    loaded_adapters: dict[str, str] = Field(description="every adapter loaded through this server: name -> path")
    stages: dict[str, LifecycleReportModel] = Field(default_factory=dict)


class RankReportModel(BaseModel):
    rank: int
    state: str
    status: str
    duration_s: float
    pool_bytes_before: dict[str, int]
    pool_bytes_after: dict[str, int]
    process_bytes_before: int | None
    process_bytes_after: int | None
    process_bytes_source: str
    freed_bytes: int = Field(description="pool bytes released, over the pools that shrank; never negative")
    restored_bytes: int = Field(0, description="pool bytes mapped back (a wake), over the pools that grew")
    adapters: list[AdapterModel] = Field(
        default_factory=list, description="an adapter command's (P-20): every adapter the rank holds after it"
    )
    adapters_evicted: list[str] = Field(default_factory=list, description="adapters an AddAdapter evicted (LRU)")


class LifecycleReportModel(BaseModel):
    stage: str
    task_id: str
    command: str
    status: str = Field(description="OK, or ALREADY when nothing had to be done")
    state: str
    duration_s: float
    ranks: dict[str, RankReportModel]
    weights_version: int = Field(0, description="the stage's weights version after the task (P-17)")


class SwapHalfModel(BaseModel):
    stage: str
    report: LifecycleReportModel | None = Field(None, description="the half's report, when it completed")
    error: dict[str, Any] | None = Field(None, description="the half's error (an ErrorDetail), when it did not")


class ErrorDetail(BaseModel):
    code: int
    type: str = Field(description="the engine's exception type, or the HTTP layer's (e.g. BodyTooLarge)")
    message: str = Field(description="the same text the Python API raises")
    stage: str | None = None
    fields: list[str] | None = Field(
        None, description="the request fields refused (a 422, a 400 on source), each named in the message too"
    )
    failures: dict[str, str] | None = Field(None, description="rank -> why, for StageFailedError")
    refusals: dict[str, str] | None = Field(
        None,
        description="rank -> its NO_MEMORY detail (bytes needed and free, who holds the device), for NoMemoryError",
    )
    outgoing: SwapHalfModel | None = Field(None, description="a swap's sleeping half, for SwapFailedError")
    incoming: SwapHalfModel | None = Field(None, description="a swap's waking half, for SwapFailedError")
    state: str | None = Field(None, description="NEEDS_RELOAD, for WeightUpdateFailedError")
    weights_version: int | None = Field(
        None, description="the version the stage still holds, for WeightUpdateFailedError"
    )


class ErrorModel(BaseModel):
    error: ErrorDetail


class RankModel(BaseModel):
    pid: int | None
    alive: bool
    state: str
    pool_bytes: dict[str, int]
    process_bytes: int | None
    process_bytes_source: str
    rss_bytes: int | None
    host_offloaded_bytes: int
    weights_version: int = Field(0, description="the weights version the rank reported last (P-17)")
    runner_counters: dict[str, int] = Field(
        default_factory=dict, description="the runner's own counters (names its Hello declared), as last reported"
    )


class StageModel(BaseModel):
    stage_id: int
    name: str
    state: str
    epoch: int
    task_id: str | None
    admission: str
    failure: str | None
    queued: int
    in_flight: int
    counters: dict[str, int]
    last_sleep_level: int | None
    asleep_tags: list[str] = Field(description="the stage's tags not resident on its ranks")
    weights_valid: bool = Field(description="false after a level-2 sleep until the weights are reloaded")
    weights_version: int = Field(
        0,
        description="the weights version the stage committed last (P-17; 0: as "
        "loaded at start); requests run only on it",
    )
    weights_source: str = Field(
        "checkpoint", description="where that version lives: checkpoint, disk (a directory), or memory only"
    )
    version_floor: int = Field(
        0,
        description="above 0 after a restart lost a version that lived in memory only: NEEDS_RELOAD, and "
        "nothing runs until an update at or above it",
    )
    version_reset_from: int | None = Field(
        None, description="the version the last restart with from_checkpoint dropped (null: none)"
    )
    tags: list[str]
    runner: str
    device: str
    backend: str
    host_offloaded_bytes: int
    runner_counters: dict[str, int] = Field(
        default_factory=dict, description="the runner's own counters, each summed over the ranks"
    )
    ranks: dict[str, RankModel]


class SwapReportModel(BaseModel):
    task_id: str = Field(description="the swap's id; its halves ran as {task_id}/out and {task_id}/in")
    duration_s: float = Field(description="from issuing both halves to the later one's end")
    outgoing: LifecycleReportModel
    incoming: LifecycleReportModel


class StagesModel(BaseModel):
    stages: list[StageModel]


class ExecuteModel(BaseModel):
    stage: str
    output: Any = Field(description="rank 0's output; bytes are base64 strings")
    weights_version: int = Field(0, description="the weights version every rank computed the output with (P-17)")
    adapter: str | None = Field(None, description="the LoRA adapter it ran with (P-20)")
    adapter_version: int = Field(0, description="that adapter's version (P-20)")


class RestartBody(_Strict):
    from_checkpoint: bool = Field(
        False,
        description="start over from the checkpoint at weights version 0, whatever version the stage "
        "held (said in the answer's version_reset_from, the log and status); false: come back at the "
        "version held, or NEEDS_RELOAD under a version floor when it lived in memory only",
    )


class RestartModel(BaseModel):
    stage: str
    state: str = Field(description="RUNNING, or NEEDS_RELOAD under a version floor")
    epoch: int
    weights_version: int = Field(description="the version the stage holds now")
    version_floor: int = Field(
        0,
        description="above 0: the version held lived in memory only; nothing runs until an update at or above it",
    )
    version_reset_from: int | None = Field(None, description="the version a from_checkpoint restart dropped")
    weights_source: str = Field("checkpoint", description="checkpoint, disk, or memory (lost: see version_floor)")
    detail: str = Field("", description="what became of the version, in words")


class VllmSleepModel(BaseModel):
    status: str = Field(description="sleeping; paused for level 0 (a pause: nothing released)")
    level: int
    mode: str = Field(description="abort, wait or keep: what happened to in-flight requests")
    stages: dict[str, LifecycleReportModel]


class VllmWakeModel(BaseModel):
    status: str = Field(
        description="awake once every tag of every stage is back and the weights are valid; else sleeping"
    )
    tags_woken: list[str]
    stages: dict[str, LifecycleReportModel]


class IsSleepingModel(BaseModel):
    is_sleeping: bool = Field(
        description="true until every tag of every stage vLLM's routes act on is back and "
        "its weights are valid (PARTIAL and NEEDS_RELOAD are asleep)"
    )


class IsPausedModel(BaseModel):
    is_paused: bool = Field(description="true while a stage's admission is closed by a pause or a sleep")


class CollectiveRpcModel(BaseModel):
    results: list[LifecycleReportModel]


class OmniAckModel(BaseModel):
    """One rank's answer, in the fields of vLLM-Omni's OmniACK."""

    task_id: str
    status: str = Field(description="OK, or ALREADY when nothing had to be done")
    stage_id: int
    rank: int | None = Field(description="null when the stage had nothing to do and asked no rank (ALREADY)")
    freed_bytes: int = Field(description="pool bytes released; never negative")
    restored_bytes: int = Field(0, description="omni-core's addition: pool bytes mapped back (a wake)")
    metadata: dict[str, Any] = Field(description="stage (its name) and state (the rank's state)")


class OmniLifecycleModel(BaseModel):
    status: str = Field(description="SUCCESS; SKIPPED for a wake-up of stages none of which sleeps")
    acks: list[OmniAckModel] = Field(description="one per rank of every stage acted on; empty when SKIPPED")
    message: str | None = Field(None, description="why nothing was done, when SKIPPED")
    stages: dict[str, LifecycleReportModel] = Field(description="omni-core's report per stage")


class SglangMemoryModel(BaseModel):
    success: bool
    message: str
    stages: dict[str, LifecycleReportModel]


class SglangUpdateModel(BaseModel):
    success: bool
    message: str
    num_paused_requests: int = Field(0, description="always 0: requests are drained or aborted, never paused")
    weight_version: str | None = Field(None, description="an update's: the label of the version it committed")
    stages: dict[str, LifecycleReportModel]


class SglangResultModel(BaseModel):
    success: bool
    message: str
    weight_version: str | None = Field(None, description="an update's: the label of the version it committed")
    stages: dict[str, LifecycleReportModel]


class CacheResetModel(BaseModel):
    success: bool
    message: str
    released: dict[str, LifecycleReportModel] = Field(description="empty: a reset releases no memory")
    stages: dict[str, LifecycleReportModel] = Field(description="each stage's ResetPrefixCache: its state unchanged")


class VllmMessageModel(BaseModel):
    message: str
    weights_version: dict[str, int] | None = Field(None, description="an update's: each stage's new version")
    stages: dict[str, LifecycleReportModel]


class HealthModel(BaseModel):
    status: str = Field(
        description="ok while no stage is FAILED or STOPPED (a sleeping stage is healthy); "
        "else failed, with the answer 503"
    )
    stages: dict[str, str]
    failed: list[str] = Field(default_factory=list, description="the stages FAILED or STOPPED")
    error: ErrorDetail | None = Field(None, description="on a 503: the first failed stage and what to do")


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorModel, "description": what}
    for code, what in {
        400: "bad argument, or a body that is not JSON",
        401: "missing or wrong API key",
        403: "a foreign Host or Origin, or a reload source outside allowed_reload_sources",
        404: "unknown stage",
        409: "state conflict, or Idempotency-Key reused for another request",
        413: "body above max_body_bytes, or a request over the stage's max_frame_bytes",
        415: "a state-changing request with a body that is not application/json",
        422: "a field of the wrong type, unknown, missing or not carried by the wire (the message names it)",
        429: "queue full",
        503: "stage failed, engine closed, or too little free device memory (NoMemoryError)",
        504: "deadline passed",
    }.items()
}
# What any route may answer, whatever it takes: the Host/Origin guard's 403, the 415 of a
# state-changing request with a non-JSON body, the 422 of an unknown query parameter.
EVERY_ROUTE_ERRORS: dict[int | str, dict[str, Any]] = {code: ERROR_RESPONSES[code] for code in (403, 415, 422)}
# An anchor's route whose effect omni-core has no lifecycle for: a 501 that says why, never a
# 200 that did nothing.
NOT_SERVED_RESPONSES: dict[int | str, dict[str, Any]] = {
    501: {"model": ErrorModel, "description": "not served by omni-core: the message says why and what to use"},
    401: ERROR_RESPONSES[401],
}
