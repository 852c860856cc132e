"""Every mutant worker is caught by the suite with the requirement it breaks, over the wire.

The mutants run concurrently (each suite run is mostly waiting on its worker), each
restricted to the requirement expected to catch it; the assertion names the case and the
problem too, so a mutant "caught" by a timeout of a loaded machine would not pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_core.conformance import SuiteOptions, SuiteReport, run_suite

from . import mutants

# mutant -> (case that must fail, words of its problem)
EXPECTED = {
    "no_reply_cache": ("P-2/duplicate_answered_from_cache", "a copy of an answered Sleep got a different reply"),
    "ack_before_release": ("P-12/sleep_wake_reports", "acknowledged before the memory was released"),
    "rank0_only": ("P-1/one_reply_per_rank", "no reply from worker rank 1"),
    "crash_on_second_sleep": ("P-4/sleep_already", "died with exit code 134"),
    "execute_while_sleeping": ("P-7/execute_refused_sleeping", "refused with EXECUTE_ERROR, not INVALID_STATE"),
    "garbage_kills_loop": ("P-10/garbage_then_service", "died with exit code"),
    "stale_epoch_accepted": ("P-6/stale_epoch_refused", "expected a refusal (STALE_EPOCH), got an Ack"),
    "level2_wakes_active": ("P-8/level2_wake_needs_reload", "Wake after a level-2 sleep ended in ACTIVE"),
    "wrong_version_accepted": ("P-3/unsupported_version", "expected a refusal (UNSUPPORTED_VERSION), got an Ack"),
    "double_reply": ("P-1/one_reply_per_rank", "sent more than one reply per task"),
    "unknown_tag_half_applied": ("P-11/unknown_tag_no_effect", "the refusal says state SLEEPING, not ACTIVE"),
    "ack_from_plan": ("P-12/status_while_asleep_shows_release", "the Sleep was acknowledged before its memory was "
                      "released"),
    "nvml_on_cpu": ("P-12/cpu_figure_not_nvml", "labels its process figure 'nvml'"),
    "status_clears_cache": ("P-2/status_keeps_reply_cache", "the Status emptied or changed the reply cache"),
    "tiny_reply_cache": ("P-2/duplicate_after_64_newer", "the reply cache keeps fewer than the 64 latest answers"),
    "crash_on_shutdown_asleep": ("P-11/shutdown_while_asleep", "Shutdown in SLEEPING: worker rank 0"),
    "wake_unknown_tag_already": ("P-11/wake_unknown_tag_refused", "expected a refusal (UNKNOWN_TAG), got an Ack"),
    # Blamed on the Status (not on the command before it) wherever a case asks for one.
    "status_wakes": ("P-11/status_no_effect", "a Status must change nothing, so either this Status changed"),
    "invalid_utf8_detail": ("P-10/garbage_then_service", "bytes that are not a valid protocol message"),
    "silent_sleep_already": ("P-4/sleep_already", "within 5 s to Sleep 'sleep_already-again-"),
    "execute_in_partial": ("P-7/execute_refused_partial", "not INVALID_STATE"),
    "newer_epoch_not_adopted": ("P-6/newer_epoch_adopted", "the reply carries epoch 3"),
    "no_epoch_window": ("P-13/epoch_far_ahead_refused", "expected a refusal (EPOCH_AHEAD), got an Ack"),
    "bad_source_fails": ("P-13/unusable_reload_source_refused", "refused with BACKEND_ERROR, not INVALID_ARGUMENT"),
    "task_id_reuse_served": ("P-2/task_id_reused", "expected a refusal (TASK_ID_REUSED), got a Result"),
    "no_hello_proof": ("P-14/hello_proof", "the Hello carries no proof"),
    "bad_message_no_task_id": ("P-10/garbage_then_service", "the refusal carries task_id '-', not 'conf-bad-level'"),
    "shutdown_exits_nonzero": ("P-4/second_shutdown", "the process exited with code 1 after Shutdown"),
    "status_without_memory": ("P-12/sleep_wake_reports", "the Ack of Status carries no memory report"),
    "version_detail_one_version": ("P-3/unsupported_version", "the detail does not name both versions"),
}
# Requirements a mutant also fails, besides its own (and why that is right).
ALSO_FAILS = {
    # Its '-' refusal of a task it could name answers no task the suite sent: a stray too.
    "bad_message_no_task_id": {"P-1"},
}
OPTIONS = SuiteOptions(reply_timeout_s=5.0)  # rank0_only waits this long for rank 1
PARALLEL_RUNS = 6


@pytest.fixture(scope="module")
def reports() -> dict[str, SuiteReport]:
    def one(name: str) -> tuple[str, SuiteReport]:
        only = None if name in mutants.VARIANTS else [mutants.MUTANTS[name][0]]
        return name, run_suite(mutants.factory(name), only=only, options=OPTIONS)

    names = [*mutants.MUTANTS, *mutants.VARIANTS]
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        return dict(pool.map(one, names))


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(mutants.MUTANTS)
    assert {case.split("/")[0] for case, _ in EXPECTED.values()} == {req for req, _ in mutants.MUTANTS.values()}


@pytest.mark.parametrize("name", sorted(mutants.MUTANTS))
def test_mutant_is_caught_by_the_expected_requirement(reports, name):
    report = reports[name]
    requirement = mutants.MUTANTS[name][0]
    case_id, words = EXPECTED[name]
    rendered = report.render()
    assert report.failed_requirements() == {requirement} | ALSO_FAILS.get(name, set()), rendered
    failures = {r.case.id: r for r in report.results if r.outcome == "fail"}
    assert case_id in failures, rendered
    assert words in failures[case_id].reason, rendered
    # The failure quotes the requirement and says what was sent.
    details = failures[case_id].details()
    assert f"requirement {requirement} (" in details and "MUST" in details and "sent:" in details
    assert f"{requirement:<5} FAIL" in rendered and "summary: FAILED" in rendered


def test_a_worker_without_capabilities_passes_with_reported_skips(reports):
    report = reports["no_capabilities"]
    rendered = report.render()
    assert not report.failed, rendered
    skipped = {r.case.name: r.reason for r in report.results if r.outcome == "skip"}
    assert skipped == {
        "execute_refused_partial": "worker does not declare capability 'partial_wake'",
        "level2_wake_needs_reload": "worker does not declare capability 'level2'",
        "reload_report": "worker does not declare capability 'level2'",
        "unusable_reload_source_refused": "worker does not declare capability 'level2'",
    }, rendered
    passed = {r.case.name for r in report.results if r.outcome == "pass"}
    assert "level2_refused_without_capability" in passed
    line = "P-8   PASS  level-2 reload rule (1 case, 1 skipped: worker does not declare capability 'level2')"
    assert line in rendered.splitlines(), rendered
