"""A stage's fields are declared once, in StageSpec, with their bounds (msgspec.Meta): a TOML
table is decoded into it by msgspec.convert, and a Python caller's arguments are checked
against the same declarations, so both refuse the same value naming the same field."""

from __future__ import annotations

from typing import Any

import pytest

from omni_core.config import ConfigError, parse_config
from omni_core.engine import StageSpec
from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.fields import FieldError
from omni_core.engine.spec import MAX_IN_FLIGHT_LIMIT, RayPlacement
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.workers.config import MIN_FRAME_BYTES

# One row per kind of mistake: the table's fields besides `name`, the field the error names,
# and what it must say (the bound, the choices, the type).
KINDS = [
    ("type", {"ranks": "2"}, "ranks", "expected an integer, got '2'"),
    ("bool is no integer", {"ranks": True}, "ranks", "expected an integer, got True"),
    ("lower bound", {"ranks": 0}, "ranks", "expected an integer >= 1, got 0"),
    ("upper bound", {"ranks": 65}, "ranks", "expected an integer <= 64, got 65"),
    ("open bound", {"deadline_s": 0}, "deadline_s", "expected a number > 0.0, got 0"),
    ("named bound", {"max_in_flight": 10**6}, "max_in_flight", f"expected an integer <= {MAX_IN_FLIGHT_LIMIT}"),
    ("bound of a large field", {"max_frame_bytes": 1}, "max_frame_bytes", f">= {MIN_FRAME_BYTES}, got 1"),
    ("optional with a bound", {"gpu_memory_fraction": 1.5, "device": "cuda"}, "gpu_memory_fraction", "<= 1.0"),
    ("enum", {"admission": "sometimes"}, "admission", "must be one of ['queue', 'reject', 'wake'], got 'sometimes'"),
    ("element type", {"tags": ["weights", 3]}, "tags[1]", "expected a string, got"),
    ("length", {"tags": []}, "tags", "expected a list of length >= 1, got []"),
    ("nested bound", {"placement": {"num_gpus": -1}}, "placement.num_gpus", "expected a number >= 0.0, got -1"),
    ("nested choice", {"placement": {"strategy": "CLOSE"}}, "placement.strategy", "must be one of ['PACK', "),
    ("across fields", {"ranks": 2, "devices": ["0"]}, "devices", "1 devices for 2 ranks; give one"),
    ("registry", {"backend": "magic"}, "backend", "backend 'magic' is not one of"),
    ("distinct", {"tags": ["weights", "weights"]}, "tags", "must be distinct"),
]


def _python(fields: dict[str, Any]) -> StageSpec:
    fields = dict(fields)
    if isinstance(fields.get("placement"), dict):
        fields["placement"] = RayPlacement(**fields["placement"])
    return StageSpec("a", **fields)


@pytest.mark.parametrize(("kind", "fields", "field", "words"), KINDS, ids=[k[0] for k in KINDS])
def test_a_toml_mistake_names_the_key_and_the_bound(kind: str, fields: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"stages": [{"name": "a", **fields}]}, "stages.toml")
    assert info.value.field == field
    assert str(info.value).startswith(f"stages.toml: stage 'a' (stages[0]): field {field!r}: "), str(info.value)
    assert words in str(info.value)


@pytest.mark.parametrize(("kind", "fields", "field", "words"), KINDS, ids=[k[0] for k in KINDS])
def test_python_arguments_meet_the_same_declarations(kind: str, fields: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(FieldError) as info:
        _python(fields)
    assert isinstance(info.value, InvalidArgumentError)
    # A nested struct built on its own names its field from inside it.
    assert field.endswith(info.value.field or "?"), (field, info.value.field)
    assert words.split(", got")[0] in str(info.value)


@pytest.mark.parametrize(
    ("table", "field", "words"),
    [
        ({"name": "a", "rnaks": 2}, "rnaks", "unknown field; known fields: ['admission', 'backend', "),
        ({"name": "a", "placement": {"num_gpu": 1}}, "placement.num_gpu", "known fields: ['bundle_indices', "),
        ({"ranks": 1}, "name", "missing, and it has no default: give it"),
        ({"name": "a", "placement": {"placement_group": "pg"}}, "placement.placement_group", "placement_group_name"),
        ({"name": "a b"}, "name", "expected a string matching regex '^[A-Za-z0-9_.-]{1,64}$', got 'a b'"),
    ],
)
def test_unknown_and_missing_keys_are_named(table: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"stages": [table]})
    assert info.value.field == field and words in str(info.value), str(info.value)


def test_python_values_are_converted_to_the_declared_types() -> None:
    spec = StageSpec("a", ranks=2, devices=["0", "1"], tags=["weights"], admission="wake", deadline_s=3)
    assert spec.devices == ("0", "1") and spec.tags == ("weights",)
    assert spec.admission is AdmissionPolicy.WAKE
    assert spec.deadline_s == 3.0 and isinstance(spec.deadline_s, float)
    placement = RayPlacement(num_gpus=0.5, placement_group_name="pg", bundle_indices=[3, 3])
    assert placement.bundle_indices == (3, 3)


def test_a_file_and_python_build_equal_specs() -> None:
    table = {"name": "a", "ranks": 2, "devices": ["0", "1"], "admission": "reject", "placement": {"num_gpus": 0.5}}
    (from_file,) = parse_config({"stages": [table]}).stages
    assert from_file == StageSpec(
        "a", ranks=2, devices=("0", "1"), admission=AdmissionPolicy.REJECT, placement=RayPlacement(num_gpus=0.5)
    )


def test_the_engine_table_takes_only_engine_keywords() -> None:
    import inspect

    from omni_core.config import EngineTable
    from omni_core.engine import Engine

    keywords = {p.name for p in inspect.signature(Engine.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY}
    assert set(EngineTable.__struct_fields__) == keywords
    given = parse_config({"engine": {"launcher": "ray"}, "stages": [{"name": "a"}]}).engine
    assert given == {"launcher": "ray"}  # what the file leaves out keeps Engine's own default


def test_a_rank_config_meets_the_bounds_of_the_spec_it_comes_from() -> None:
    import msgspec

    from omni_core.workers.config import WorkerConfig

    # `python -m omni_core.workers --config JSON` decodes a WorkerConfig without a StageSpec.
    for field, value, words in [
        ("gpu_memory_fraction", 2, "<= 1"),
        ("max_frame_bytes", 1, f">= {MIN_FRAME_BYTES}"),
        ("profile_max_s", 0, "> 0"),
        ("tags", [], "length >= 1"),
    ]:
        with pytest.raises(msgspec.ValidationError, match=words):
            msgspec.convert({"address": "ipc:///x", "rank": 0, field: value}, WorkerConfig)
        with pytest.raises(FieldError, match=words):
            StageSpec("a", device="cuda", **{field: value})
