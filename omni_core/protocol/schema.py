"""JSON Schema of every wire message, for peers written in other languages.

`omni-core schema [PATH]` writes it to `specs/messages.schema.json` (this module only renders);
a test fails when the committed file differs from what this produces.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from omni_core.protocol.messages import AnyMessage
from omni_core.protocol.version import PROTOCOL_VERSION


def message_schema() -> dict[str, Any]:
    """The schema document: a `oneOf` over the tagged message types."""
    schema = msgspec.json.schema(AnyMessage)
    schema["title"] = f"omni-core wire protocol v{PROTOCOL_VERSION} (msgpack; this is its JSON view)"
    return schema


def render_schema() -> str:
    return json.dumps(message_schema(), indent=2, sort_keys=True) + "\n"
