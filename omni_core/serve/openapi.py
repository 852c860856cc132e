"""The committed OpenAPI schema (specs/openapi.json), generated from the app's routes.

Generated without an engine, from a fixed one-stage config, so the file depends only on
the code; tests/serve/test_openapi.py fails when it is stale.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_core.config import parse_config

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "specs" / "openapi.json"


def openapi_schema() -> dict[str, Any]:
    from omni_core.serve.app import create_app

    config = parse_config({"stages": [{"name": "stage"}]}, "<openapi>")
    return create_app(None, config).openapi()


def render() -> str:
    return json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n"


def write_openapi(path: str | Path = DEFAULT_PATH) -> Path:
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(render(), encoding="utf-8")
    return target
