"""The orchestrator and the embedded Python API."""

from omni_core.engine.api import AsyncEngine, Engine
from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    OmniCoreError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    TaskAbandonedError,
)
from omni_core.engine.launch import LocalLauncher, RankHandle, RankLauncher
from omni_core.engine.report import LifecycleReport, RankReport
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
