"""The orchestrator and the embedded Python API."""

from omni_core.engine.api import AsyncEngine, Engine
from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    InvalidPayloadError,
    NoMemoryError,
    OmniCoreError,
    PayloadTooLargeError,
    ProfileRefusedError,
    RequestFailedError,
    RequestRejectedError,
    RestartInProgressError,
    StageFailedError,
    SwapFailedError,
    TaskAbandonedError,
)
from omni_core.engine.launch import LocalLauncher, RankHandle, RankLauncher
from omni_core.engine.pipeline import PipelineError, PipelineResult, PipelineRoute, PipelineStage
from omni_core.engine.report import (
    ExecuteResult,
    LifecycleReport,
    ProfileReport,
    RankReport,
    RestartReport,
    SwapReport,
)
from omni_core.engine.spec import RayPlacement, StageSpec
from omni_core.fsm.admission import AdmissionPolicy

__all__ = [
    "AdmissionPolicy",
    "AsyncEngine",
    "Engine",
    "EngineClosedError",
    "ExecuteResult",
    "InvalidArgumentError",
    "InvalidPayloadError",
    "NoMemoryError",
    "LifecycleReport",
    "LocalLauncher",
    "PipelineError",
    "PipelineResult",
    "PipelineRoute",
    "PipelineStage",
    "OmniCoreError",
    "PayloadTooLargeError",
    "ProfileRefusedError",
    "ProfileReport",
    "RankHandle",
    "RankLauncher",
    "RankReport",
    "RayPlacement",
    "RequestFailedError",
    "RequestRejectedError",
    "RestartInProgressError",
    "RestartReport",
    "StageFailedError",
    "StageSpec",
    "SwapFailedError",
    "SwapReport",
    "TaskAbandonedError",
]
