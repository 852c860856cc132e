"""Sans-IO lifecycles: worker and stage transition tables and the cores that run them.

Imports no sockets and no torch. The tables `WORKER_TRANSITIONS` and `STAGE_TRANSITIONS`
are the single source of truth: docs diagrams, the TLA+ transition module and the
conformance suite derive from them.
"""

from typing import Any

from omni_core.fsm import effects
from omni_core.fsm.effects import *  # noqa: F403 - every effect, listed once in effects.__all__
from omni_core.fsm.reply_cache import BoundedCache
from omni_core.fsm.stage import (
    Outbound,
    StageBusyError,
    StageCommandError,
    StageCore,
    StageStep,
    TaskOutcome,
)
from omni_core.fsm.stage_step import StageSnapshot
from omni_core.fsm.stage_table import STAGE_TRANSITIONS
from omni_core.fsm.table import Lifecycle, Transition, table_as_dict, table_as_mermaid
from omni_core.fsm.tags import DEFAULT_TAGS, KV_CACHE_TAG, WEIGHTS_TAG, Residency
from omni_core.fsm.worker import InvariantViolation, WorkerCore, WorkerStep
from omni_core.fsm.worker_step import WorkerSnapshot
from omni_core.fsm.worker_table import WORKER_TRANSITIONS
from omni_core.protocol import StageState, WorkerState


def export_tables() -> dict[str, dict[str, Any]]:
    """Both tables as plain data: `{lifecycle: {"initial": ..., "transitions": {...}}}`."""
    return {
        "worker": {"initial": WorkerState.LOADING.value, "transitions": table_as_dict(WORKER_TRANSITIONS)},
        "stage": {"initial": StageState.STARTING.value, "transitions": table_as_dict(STAGE_TRANSITIONS)},
    }


def export_mermaid() -> dict[str, str]:
    return {
        "worker": table_as_mermaid(WORKER_TRANSITIONS, WorkerState.LOADING),
        "stage": table_as_mermaid(STAGE_TRANSITIONS, StageState.STARTING),
    }


__all__ = [
    "DEFAULT_TAGS",
    "KV_CACHE_TAG",
    "STAGE_TRANSITIONS",
    "WEIGHTS_TAG",
    "WORKER_TRANSITIONS",
    "BoundedCache",
    "InvariantViolation",
    "Lifecycle",
    "Outbound",
    "Residency",
    "StageBusyError",
    "StageCommandError",
    "StageCore",
    "StageSnapshot",
    "StageStep",
    "TaskOutcome",
    "Transition",
    "WorkerCore",
    "WorkerSnapshot",
    "WorkerStep",
    "export_mermaid",
    "export_tables",
    "table_as_dict",
    "table_as_mermaid",
    *effects.__all__,
]
