"""The committed JSON Schema is generated from the wire types, never edited by hand."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from omni_core.protocol import MESSAGE_TYPES, PROTOCOL_VERSION
from omni_core.protocol.schema import render_schema

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "specs" / "messages.schema.json"
STALE = "specs/messages.schema.json is stale: run `omni-core schema`"


def test_committed_schema_is_fresh() -> None:
    assert SCHEMA_PATH.exists(), STALE
    committed = SCHEMA_PATH.read_text()
    if committed != render_schema():
        raise AssertionError(STALE)


def test_schema_describes_every_message_type_by_its_tag() -> None:
    schema = json.loads(render_schema())
    refs = [alt["$ref"].rsplit("/", 1)[-1] for alt in schema["anyOf"]]
    assert sorted(refs) == sorted(cls.__name__ for cls in MESSAGE_TYPES)
    assert schema["discriminator"]["propertyName"] == "type"
    assert f"v{PROTOCOL_VERSION}" in schema["title"]
    for cls in MESSAGE_TYPES:
        definition = schema["$defs"][cls.__name__]
        assert definition["properties"]["type"] == {"enum": [cls.__name__]}
        assert definition["additionalProperties"] is False  # unknown fields are refused
        assert {"type", "task_id", "epoch"} <= set(definition["required"])
        fields = {f.encode_name for f in msgspec.structs.fields(cls)}
        assert set(definition["properties"]) == fields | {"type"}
