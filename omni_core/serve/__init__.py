"""`omni-core serve`: the HTTP control plane over an `Engine` (README, "Serving over HTTP").

Needs the `serve` extra (fastapi, uvicorn, prometheus-client): `pip install 'omni-core[serve]'`.
Imported lazily, so `omni-core --help` and the client verbs work without that extra.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app", "serve", "serve_in_thread"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from omni_core.serve.app import create_app

        return create_app
    if name in ("serve", "serve_in_thread"):
        from omni_core.serve import server

        return getattr(server, name)
    raise AttributeError(f"module 'omni_core.serve' has no attribute {name!r}")
