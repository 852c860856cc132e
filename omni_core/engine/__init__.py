"""The orchestrator and the embedded Python API."""

from omni_core.engine.api import AsyncEngine, Engine
from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    NoMemoryError,
    OmniCoreError,
    ProfileRefusedError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    SwapFailedError,
    TaskAbandonedError,
)
from omni_core.engine.launch import LocalLauncher, RankHandle, RankLauncher
from omni_core.engine.report import LifecycleReport, ProfileReport, RankReport, SwapReport
from omni_core.engine.spec import AdmissionPolicy, RayPlacement, StageSpec

__all__ = [
    "AdmissionPolicy",
    "AsyncEngine",
    "Engine",
    "EngineClosedError",
    "InvalidArgumentError",
    "NoMemoryError",
    "LifecycleReport",
    "LocalLauncher",
    "OmniCoreError",
    "ProfileRefusedError",
    "ProfileReport",
    "RankHandle",
    "RankLauncher",
    "RankReport",
    "RayPlacement",
    "RequestFailedError",
    "RequestRejectedError",
    "StageFailedError",
    "StageSpec",
    "SwapFailedError",
    "SwapReport",
    "TaskAbandonedError",
]
