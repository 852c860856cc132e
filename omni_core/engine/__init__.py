"""The orchestrator and the embedded Python API."""

from omni_core.engine.api import AsyncEngine, Engine
from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    OmniCoreError,
    ProfileRefusedError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    TaskAbandonedError,
)
from omni_core.engine.launch import LocalLauncher, RankHandle, RankLauncher
from omni_core.engine.report import LifecycleReport, ProfileReport, RankReport
from omni_core.engine.spec import AdmissionPolicy, RayPlacement, StageSpec

__all__ = [
    "AdmissionPolicy",
    "AsyncEngine",
    "Engine",
    "EngineClosedError",
    "InvalidArgumentError",
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
    "TaskAbandonedError",
]
