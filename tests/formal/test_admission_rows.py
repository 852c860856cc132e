"""A changed admission row breaks an invariant of OmniAdmission, not only a state count.

The spec takes the Admission and QueueRules rows from the generated module, so a row changed
in omni_core/fsm/admission.py changes the spec with it; what catches the change is the rule
written by hand in OmniAdmission.tla (`Adm_JoinsQueueOnlyWhereItMayRun`). Each test renders
OmniTransitions from a mutated table into a copy of tla/ and runs the `admission` model there.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from omni_core.formal import gen_transitions
from omni_core.formal.manifest import tla_dir
from omni_core.formal.tlc import run_tlc
from omni_core.fsm import admission as adm
from omni_core.protocol import StageState as S
from tests.formal.test_trace_validation import needs_tlc

pytestmark = needs_tlc

PROPERTY = "Adm_JoinsQueueOnlyWhereItMayRun"


def _split(rows, state: S, policy: adm.AdmissionPolicy, decision: adm.Admit) -> tuple[adm.AdmissionRow, ...]:
    """The table with (state, policy) moved to a row of its own that decides `decision`."""
    out = []
    for row in rows:
        if state in row.states and policy in row.policies:
            rest_states = tuple(s for s in row.states if s != state)
            rest_policies = tuple(p for p in row.policies if p != policy)
            if rest_states:
                out.append(dataclasses.replace(row, states=rest_states))
            if rest_policies:
                out.append(dataclasses.replace(row, states=(state,), policies=rest_policies))
            out.append(adm.AdmissionRow((state,), (policy,), decision, "mutant"))
        else:
            out.append(row)
    return tuple(out)


def _admission_model(tmp_path: Path, monkeypatch, rows) -> tuple[str, str]:
    root = tmp_path / "tla"
    shutil.copytree(tla_dir(), root)
    monkeypatch.setattr(gen_transitions, "ADMISSION", rows)
    (root / f"{gen_transitions.MODULE}.tla").write_text(gen_transitions.render())
    result = run_tlc(root / "OmniAdmission.tla", root / "models/admission.cfg", workers=2, timeout_s=600)
    return result.outcome, result.violated or result.error


def test_the_split_helper_keeps_the_table_total():
    rows = _split(adm.ADMISSION, S.NEEDS_RELOAD, adm.AdmissionPolicy.QUEUE, adm.Admit.QUEUE)
    for state in S:
        for policy in adm.AdmissionPolicy:
            found = [r for r in rows if state in r.states and policy in r.policies]
            assert len(found) == 1, (state, policy)
    assert [r.decision for r in rows if S.NEEDS_RELOAD in r.states and adm.AdmissionPolicy.QUEUE in r.policies] == [
        adm.Admit.QUEUE
    ]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("state", "policy"),
    [
        # refused at once -> queued, then refused by the pump a step later
        (S.NEEDS_RELOAD, adm.AdmissionPolicy.QUEUE),
        (S.NEEDS_RELOAD, adm.AdmissionPolicy.WAKE),
    ],
)
def test_a_request_queued_where_the_table_refuses_breaks_the_rule(tmp_path, monkeypatch, state, policy):
    outcome, violated = _admission_model(tmp_path, monkeypatch, _split(adm.ADMISSION, state, policy, adm.Admit.QUEUE))
    assert (outcome, violated) == ("action_property", PROPERTY)
