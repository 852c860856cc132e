"""Bodies and answers of the routes the RL frameworks poll and call (`rl_routes.py`), in the
shapes of the anchors' own: SGLang's `io_struct` request types and vLLM's dev-mode routes.
Strict as every body here: an unknown or mistyped field is a 422 naming it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from omni_core.serve.models import LifecycleReportModel, _Strict


class SglangAbortBody(_Strict):
    """SGLang's POST /abort_request (AbortReq)."""

    rid: str = Field("", description="a request id: refused unless empty (omni-core's requests carry none)")
    abort_all: bool = Field(False, description="true: abort every request in flight")


class VllmAbortBody(_Strict):
    """vLLM's POST /abort_requests."""

    request_ids: list[str] | None = Field(None, description="refused unless empty or absent: that aborts every one")


class SglangPauseBody(_Strict):
    """SGLang's POST /pause_generation (PauseGenerationReqInput)."""

    mode: Literal["abort", "retract", "in_place"] = Field(
        "abort", description="abort: in-flight requests fail now; retract, in_place: they finish first"
    )


class ProfileBody(_Strict):
    """SGLang's POST /start_profile (ProfileReqInput); vLLM's sends no body. Traces go to each
    stage's `profile_dir` from the config, and a profile runs until /stop_profile."""

    output_dir: str | None = Field(None, description="null only: the config's profile_dir is where traces go")
    start_step: int | None = Field(None, description="null only: the profile starts now")
    num_steps: int | None = Field(None, description="null only: the profile runs until POST /stop_profile")
    activities: list[str] | None = Field(None, description="null only: the ranks' profiler records what it records")
    with_stack: bool | None = Field(None, description="null only")
    record_shapes: bool | None = Field(None, description="null only")
    profile_by_stage: bool = Field(False, description="false only")
    merge_profiles: bool = Field(False, description="false only: one trace per rank")


class UpdateWeightVersionBody(_Strict):
    """SGLang's and vLLM's POST /update_weight_version: a new label, the weights unchanged."""

    new_version: str = Field(..., description="the label; 1 to 256 printable characters")
    abort_all_requests: bool = Field(False, description="SGLang's: abort the requests in flight first")


class StartWeightUpdateBody(_Strict):
    """vLLM's POST /start_weight_update."""

    is_checkpoint_format: bool = Field(True, description="true only: the ranks take the checkpoint's names")


class FinishWeightUpdateBody(_Strict):
    """vLLM's POST /finish_weight_update."""

    weight_version: str | None = Field(None, description="the label of the version the update committed")


class DestroyGroupBody(_Strict):
    """SGLang's POST /destroy_weights_update_group."""

    group_name: str = "weight_update_group"


class HealthGenerateModel(BaseModel):
    status: str = Field(description="ok when every stage the anchors' routes act on is RUNNING")
    stages: dict[str, str]
    error: dict[str, Any] | None = Field(None, description="on a 503: the first stage that cannot run a request")


class WorldSizeModel(BaseModel):
    world_size: int = Field(description="the ranks that join a weight group: every rank of the stages acted on")


class WeightVersionModel(BaseModel):
    weight_version: str = Field(description="the label of the version the stage holds (its integer when none)")
    weights_version: int = Field(description="omni-core's integer version the label names (P-17)")
    stages: dict[str, str] = Field(description="each stage's label")


class ModelInfoModel(BaseModel):
    model_path: str
    tokenizer_path: str | None
    is_generation: bool | None = Field(description="null: omni-core does not know what its runner computes")
    preferred_sampling_params: None
    weight_version: str


class ServerInfoModel(BaseModel):
    version: str = Field(description="omni-core's version")
    model_path: str
    tp_size: int = Field(description="the ranks of the first stage acted on")
    dp_size: int = Field(description="1: a stage is one replica")
    weight_version: str
    default_stage: str | None
    stages: dict[str, dict[str, Any]]
    internal_states: list[dict[str, Any]]


class AbortModel(BaseModel):
    status: str = Field(description="aborted")
    aborted: int = Field(description="the requests in flight when the call came; each caller heard 409 aborted")
    success: bool = True
    stages: dict[str, int] = Field(description="per stage, the requests aborted")


class GenerationModel(BaseModel):
    message: str
    status: str = Field(description="ok")
    stages: dict[str, LifecycleReportModel]


class ProfileModel(BaseModel):
    message: str
    success: bool = True
    stages: dict[str, dict[str, Any]] = Field(description="each stage's profile report: status, state, traces")


class WeightLabelModel(BaseModel):
    success: bool = True
    message: str
    new_version: str | None = None
    weight_version: str | None = None
    stages: dict[str, Any] = Field(default_factory=dict)
