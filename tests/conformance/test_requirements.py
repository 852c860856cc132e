"""The suite's requirement texts, cases and docs against specs/protocol.md (no workers)."""

from __future__ import annotations

import re

from omni_core.conformance import CASES, REQUIREMENTS
from omni_core.conformance.cases import REQUIREMENT_ORDER, ordered_cases

from ._util import DOC, SPEC
from .mutants import MUTANTS, VARIANTS


def spec_requirements() -> dict[str, tuple[str, str]]:
    text = SPEC.read_text()
    found = {}
    for match in re.finditer(r"^\*\*(P-\d+) (.+?)\.\*\* (.+?)(?:\n\n|\Z)", text, re.M | re.S):
        found[match.group(1)] = (match.group(2), " ".join(match.group(3).split()))
    return found


def test_quoted_texts_are_the_spec_verbatim():
    spec = spec_requirements()
    assert list(spec) == list(REQUIREMENTS) == list(REQUIREMENT_ORDER)
    for req_id, (title, text) in spec.items():
        assert REQUIREMENTS[req_id].title == title
        assert REQUIREMENTS[req_id].text == text, f"{req_id} drifted from specs/protocol.md"


def test_every_worker_requirement_has_cases_and_every_case_a_worker_requirement():
    covered = {c.req for c in CASES}
    for req in REQUIREMENTS.values():
        assert (req.id in covered) == req.worker, req.id
        assert req.worker or req.why_not
    assert len({c.name for c in CASES}) == len(CASES)


def test_order_keeps_the_shutdown_and_the_run_wide_check_last():
    scopes = [c.scope for c in ordered_cases()]
    assert scopes[-3:] == ["consume", "consume", "global"]
    assert scopes == sorted(scopes, key=["shared", "own", "consume", "global"].index)


def test_the_guide_lists_every_case_and_every_mutant():
    doc = DOC.read_text()
    for case in CASES:
        assert f"`{case.name}`" in doc, f"docs/conformance.md does not describe case {case.name}"
    for name, (req, _) in MUTANTS.items():
        assert re.search(rf"^\| `{name}` \| .+ \| {req} \|$", doc, re.M), f"mutant {name} ({req}) not in the guide"
    assert set(VARIANTS) == {"no_capabilities"}
