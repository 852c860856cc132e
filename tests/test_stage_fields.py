"""A stage's fields are declared once, in StageSpec: the TOML checker reads what value each
takes from StageSpec's annotations instead of a hand-kept copy."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from omni_core.config import STAGE_FIELDS, _toml_kind
from omni_core.engine import StageSpec


def test_every_stage_field_has_its_toml_value() -> None:
    assert list(STAGE_FIELDS) == [f.name for f in dataclasses.fields(StageSpec)]
    assert STAGE_FIELDS["gpu_memory_fraction"] == "a number"  # float | None: leave it out for None
    assert STAGE_FIELDS["ranks"] == "an integer" and STAGE_FIELDS["verify_clean_sleep"] == "true or false"
    assert STAGE_FIELDS["admission"] == "a string"  # AdmissionPolicy | str
    assert STAGE_FIELDS["devices"] == STAGE_FIELDS["tags"] == "a list of strings"
    assert STAGE_FIELDS["placement"] == STAGE_FIELDS["simulated_device"] == STAGE_FIELDS["runner_args"] == "a table"


@pytest.mark.parametrize(
    ("hint", "kind"),
    [
        (bool, "true or false"),
        (int, "an integer"),
        (float | None, "a number"),
        (str | None, "a string"),
        (tuple[str, ...], "a list of strings"),
        (Mapping[str, Any], "a table"),
        (dict[str, int] | None, "a table"),
    ],
)
def test_toml_values_by_annotation(hint: Any, kind: str) -> None:
    assert _toml_kind(hint) == kind


def test_a_field_toml_cannot_write_is_refused_at_import() -> None:
    with pytest.raises(AssertionError, match="no TOML value"):
        _toml_kind(bytes)
    with pytest.raises(AssertionError, match="pick one"):
        _toml_kind(int | str)
