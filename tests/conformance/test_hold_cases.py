"""The P-23 cases on a worker whose runner really freezes its requests (the reference worker's
cannot: there a hold beside a request has it answered first), so the frozen branch of
`hold_beside_a_request_answers_it_once` is met: the request frozen, updated under, released,
its Result at the new version with its spans. The mutant that names the old version
(`held_result_start_version`, in test_mutants.py) shows that branch decides the verdict."""

from __future__ import annotations

from omni_core.conformance import SuiteOptions, cases_hold, run_suite

from .hold_runner import HOLD_PAYLOAD, hold_worker


def test_a_worker_that_freezes_its_requests_passes_p23(monkeypatch):
    frozen = []
    spans_tell = cases_hold._spans_tell

    def seen(ctx, result, started, released, sent):
        frozen.append((started, released, [(s.weights_version, s.start_token) for s in result.version_spans]))
        spans_tell(ctx, result, started, released, sent)

    monkeypatch.setattr(cases_hold, "_spans_tell", seen)
    report = run_suite(hold_worker, only=["P-23"], options=SuiteOptions(execute_payload=HOLD_PAYLOAD))
    assert not report.failed, report.render()
    assert {r.case.name for r in report.results if r.case.req == "P-23" and r.outcome == "pass"} == {
        "hold_of_nothing_is_acked_then_already_until_released",
        "hold_refused_outside_active",
        "hold_beside_a_request_answers_it_once",
    }, report.render()
    # Frozen at token 0 under version v, released under v + 1 (the update between).
    assert len(frozen) == 1 and frozen[0][1] == frozen[0][0] + 1, frozen
    assert frozen[0][2] == [(frozen[0][0], 0), (frozen[0][1], 0)], frozen
