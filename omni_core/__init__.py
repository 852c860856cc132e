"""omni-core: checked sleep/wake lifecycles for GPU inference stages.

Layers, inside out: `protocol` (wire types, no IO) and `fsm` (lifecycles, no IO); then
`workers` (rank processes, memory backends), `transport` (sockets), `engine`
(orchestrator and Python API), `conformance` and `formal` (checking).

`Engine`, `AsyncEngine` and `StageSpec` are imported lazily so that `import omni_core.protocol`
stays free of torch and sockets.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["AsyncEngine", "Engine", "StageSpec"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from omni_core import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'omni_core' has no attribute {name!r}")
