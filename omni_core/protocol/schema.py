"""JSON Schema of every wire message, for peers written in other languages.

`python -m omni_core.protocol.schema [PATH]` writes `specs/messages.schema.json`;
a test fails when the committed file differs from what this produces.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec

from omni_core.protocol.messages import AnyMessage
from omni_core.protocol.version import PROTOCOL_VERSION

DEFAULT_SCHEMA_PATH = Path("specs/messages.schema.json")


def message_schema() -> dict:
    """The schema document: a `oneOf` over the tagged message types."""
    schema = msgspec.json.schema(AnyMessage)
    schema["title"] = f"omni-core wire protocol v{PROTOCOL_VERSION} (msgpack; this is its JSON view)"
    return schema


def render_schema() -> str:
    return json.dumps(message_schema(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DEFAULT_SCHEMA_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_schema())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
