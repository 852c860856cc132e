"""Worker process: memory backends, process-scoped GPU accounting; it runs a model through
`omni_core.runners`.

Importing this package is cheap; torch and zmq load with the submodules that need them.
"""

from omni_core.workers.config import WorkerConfig

__all__ = ["WorkerConfig"]
