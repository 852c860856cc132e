"""Every mutant worker is caught by the suite with the requirement it breaks, over the wire;
the unmutated workers (this project's, and the JavaScript one over `cmd:`) pass everything.

The runs go concurrently (each is mostly waiting on its worker). A mutant runs against the
requirement expected to catch it (with the run-wide stray check, which runs under any
subset), so the corpus stays fast; the assertion names the case and the problem too, so a
mutant "caught" by a timeout of a loaded machine would not pass. The silent mutant runs the
whole suite, to show the fail-fast: one failure, every later case not run.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from omni_core.conformance import SuiteOptions, SuiteReport, run_suite

from . import mutants

HAVE_NODE = shutil.which("node") is not None
needs_node = pytest.mark.skipif(not HAVE_NODE, reason="node is not on PATH (scripts/test.sh installs Debian's nodejs)")
SILENT = "silent_sleep_already"
FULL_RUNS = {SILENT}  # mutants run against the whole suite

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
    "ack_from_plan": (
        "P-12/status_while_asleep_shows_release",
        "the Sleep was acknowledged before its memory was released",
    ),
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
    "wake_ignores_free_memory": ("P-16/no_memory_rolls_back", "refused with BACKEND_ERROR, not NO_MEMORY"),
    "swap_refuses_wait": ("P-16/waiting_wake_acked_and_cached", "Wake was not acknowledged"),
    "no_memory_left_restoring": ("P-16/no_memory_rolls_back", "the refusal says state RESTORING, not SLEEPING"),
    "no_memory_not_cached": ("P-16/no_memory_rolls_back", "a copy of the refused Wake"),
    "no_memory_keeps_mapped": ("P-16/no_memory_rolls_back", "the wake did not unmap what it mapped"),
    "reload_refused_zeroes": (
        "P-13/reload_refused_in_active_no_effect",
        "Execute's output changed across the refused reload",
    ),
    "hello_other_pid": ("P-14/hello_proof", "the Hello names pid"),
    "profile_wakes": ("P-15/profile_start_while_asleep", "Profile ended in state ACTIVE"),
    "no_memory_early": ("P-16/no_memory_rolls_back", "refused NO_MEMORY after"),
    "epoch_window_5000": ("P-13/epoch_far_ahead_refused", "expected a refusal (EPOCH_AHEAD), got an Ack"),
    "stale_version_accepted": ("P-17/stale_version_refused", "not STALE_VERSION"),
    "update_refused_partial": ("P-17/update_in_partial_weights_awake", "UpdateWeights was not acknowledged"),
    "update_refused_needs_reload": ("P-17/update_in_needs_reload", "UpdateWeights was not acknowledged"),
    # It writes into weights that are asleep and dies (SIGSEGV): reported at once, not waited out.
    "update_weights_asleep": ("P-17/update_refused_weights_asleep", "died with exit code -11 instead of replying"),
    "reload_keeps_version": ("P-17/reload_resets_version", "it must name 0, the version held"),
    "stale_host_copy": ("P-17/wake_after_update_restores_it", "the wake restored other weights"),
    "result_version_zero": ("P-17/replies_name_the_version", "the Result names weights version 0"),
    "nack_version_zero": ("P-17/replies_name_the_version", "the Nack names weights version 0"),
    "hello_claims_version": ("P-17/hello_names_no_version", "names weights version 7"),
    "update_unchecked_names": ("P-17/update_checked_before_writing", "with UPDATE_FAILED, not INVALID_ARGUMENT"),
    "share_while_asleep": ("P-17/share_needs_weights_awake", "instead of replying"),
    "links_without_multi_path": ("P-18/links_refused_without_multi_path", "a refusal (UNSUPPORTED), got an Ack"),
    "reset_refused_partial": ("P-19/reset_prefix_cache_in_partial", "ResetPrefixCache was not acknowledged"),
    "adapter_ignored": ("P-20/adapter_requests_refused_naming_it", "a refusal (ADAPTER_UNAVAILABLE), got a Result"),
    "adapter_any_base": ("P-20/adapter_for_other_weights_refused", "does not name the version it was made for"),
    "adapter_tensors_unchecked": ("P-20/adapter_tensors_refused_unless_whole", "expected a refusal (INVALID_ARGUMENT)"),
    "hold_anywhere": ("P-23/hold_refused_outside_active", "expected a refusal (INVALID_STATE), got an Ack"),
    "hold_never_already": (
        "P-23/hold_of_nothing_is_acked_then_already_until_released",
        "HoldRequests was acknowledged with status OK, not ALREADY",
    ),
    # On the runner that freezes (tests/conformance/hold_runner.py): released under version 1.
    "held_result_start_version": (
        "P-23/hold_beside_a_request_answers_it_once",
        "released under weights version 1 names version 0",
    ),
    # The same runner, its loop stepping the held request to its end: answered before the release.
    "held_requests_stepped": (
        "P-23/hold_beside_a_request_answers_it_once",
        "the request was answered while it was held",
    ),
    "node_tiny_reply_cache": ("P-2/duplicate_after_64_newer", "the reply cache keeps fewer than the 64 latest"),
    "node_wake_unknown_tag_already": ("P-11/wake_unknown_tag_refused", "expected a refusal (UNKNOWN_TAG), got an Ack"),
    "node_crash_on_shutdown_asleep": ("P-11/shutdown_while_asleep", "Shutdown in SLEEPING: worker rank 0"),
}
# Requirements a mutant also fails, besides its own (and why that is right).
ALSO_FAILS = {
    # Its '-' refusal of a task it could name answers no task the suite sent: a stray too.
    "bad_message_no_task_id": {"P-1"},
}
# rank0_only waits reply_timeout_s=5 for rank 1; each mutant runs on its own memory-pressure hook (P-16)
PARALLEL_RUNS = 6
CLEAN = {"reference": "synthetic", "node_clean": mutants.node_target()}


@pytest.fixture(scope="module")
def reports() -> dict[str, tuple[SuiteReport, float]]:
    def one(name: str) -> tuple[str, tuple[SuiteReport, float]]:
        started = time.monotonic()
        if name in CLEAN:
            failing = mutants.node_target(fail_start=True) if name == "node_clean" else None
            report = run_suite(CLEAN[name], options=SuiteOptions(reply_timeout_s=5.0, failing_worker=failing))
        else:
            only = None if name in mutants.VARIANTS or name in FULL_RUNS else [mutants.MUTANTS[name][0]]
            report = run_suite(mutants.target(name), only=only, options=mutants.options(name, reply_timeout_s=5.0))
        return name, (report, time.monotonic() - started)

    names = [
        n
        for n in [*mutants.MUTANTS, *mutants.VARIANTS, *CLEAN]
        if HAVE_NODE or not (n in mutants.NODE_MUTANTS or n == "node_clean")
    ]
    started = time.monotonic()
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        out = dict(pool.map(one, names))
    print(f"\nmutant corpus: {len(names)} suite runs in {time.monotonic() - started:.1f} s")
    return out


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(mutants.MUTANTS)
    assert {case.split("/")[0] for case, _ in EXPECTED.values()} == {req for req, _ in mutants.MUTANTS.values()}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=needs_node) if n in mutants.NODE_MUTANTS else n for n in sorted(mutants.MUTANTS)]
)
def test_mutant_is_caught_by_the_expected_requirement(reports, name):
    report = reports[name][0]
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


@pytest.mark.parametrize("name", ["reference", pytest.param("node_clean", marks=needs_node)])
def test_the_unmutated_workers_pass_every_case(reports, name):
    report = reports[name][0]
    assert not report.failed, report.render()
    skipped = {r.case.name for r in report.results if r.outcome == "skip"}
    expected = {"level2_refused_without_capability"}  # both declare level2
    expected |= {"links_leave_what_the_command_leaves"}  # neither declares 'multi_path' (no relay on a CPU)
    if name == "node_clean":  # the JavaScript worker has no profiler: it does not declare 'profile' (P-15)
        expected |= {r.case.name for r in report.results if r.case.req == "P-15"}
        # nor 'swap' (P-16): its refusal of a waiting Wake and the v1 frame are checked, nothing else
        expected |= {"waiting_wake_acked_and_cached", "outgoing_sleep_hint", "no_memory_rolls_back"}
        # nor 'weight_update' (P-17): only its refusal of UpdateWeights is checked (an unknown type to it)
        expected |= {r.case.name for r in report.results if r.case.req == "P-17"} - {
            "update_refused_without_weight_update",
            "hello_names_no_version",  # every worker's Hello names version 0 at start
        }
        # nor 'adapters' (P-20): the JavaScript worker has no LoRA
        expected |= {r.case.name for r in report.results if r.case.req == "P-20"}
        # nor 'save_weights' (P-21): only its refusal of SaveWeights is checked (an unknown type to it);
        # and no worker of its kind greeting NEEDS_RELOAD is named (P-17 rule 11)
        expected |= {r.case.name for r in report.results if r.case.req == "P-21"} - {
            "save_refused_without_save_weights"
        }
        expected |= {"greeted_needs_reload_serves_nothing_until_weights_come"}
        # nor 'transfer' (P-22): the JavaScript worker exports and lands nothing
        expected |= {r.case.name for r in report.results if r.case.req == "P-22"}
        assert {r.case.name for r in report.results if r.case.req == "P-16" and r.outcome == "pass"} == {
            "v1_wake_frame",
            "waiting_wake_refused_without_swap",
        }, report.render()
    else:
        expected |= {"waiting_wake_refused_without_swap"}  # it declares 'swap'
        expected |= {"update_refused_without_weight_update"}  # and 'weight_update'
        expected |= {"update_refused_sleeping"}  # and 'host_refit': a sleeping worker takes the update
        expected |= {"save_refused_without_save_weights"}  # and 'save_weights'
        assert {r.case.name for r in report.results if r.case.req == "P-16" and r.outcome == "pass"} == {
            "v1_wake_frame",
            "waiting_wake_acked_and_cached",
            "outgoing_sleep_hint",
            "no_memory_rolls_back",
        }, report.render()
        assert {r.case.name for r in report.results if r.case.req == "P-15" and r.outcome == "pass"} == {
            "profile_start_stop_lists_traces",
            "profile_keeps_sleep",
            "profile_start_while_asleep",
            "profile_bad_prefix_refused",
            "profile_stale_epoch_refused",
        }, report.render()
    assert skipped == expected, report.render()
    assert {r.case.name for r in report.results if r.outcome == "pass"} >= {
        "shutdown_from_failed",
        "shutdown_while_asleep",
        "duplicate_after_64_newer",
        "cpu_figure_not_nvml",
    }


def test_a_silent_worker_fails_once_and_fast(reports):
    """One dropped reply: one failure naming the command, every later case not run (and so
    one deadline waited out, not one per case)."""
    report, _ = reports[SILENT]
    failed = [r for r in report.results if r.outcome == "fail"]
    assert [r.case.id for r in failed] == ["P-4/sleep_already"], report.render()
    after = report.results[report.results.index(failed[0]) + 1 :]
    not_run = [
        r
        for r in after
        if r.reason.startswith("not run: the worker went silent in P-4/sleep_already (no reply from worker rank 0")
    ]
    assert len(not_run) == len(after) - 1 and after[-1].case.name == "no_stray_replies", report.render()


def test_a_worker_without_capabilities_passes_with_reported_skips(reports):
    report = reports["no_capabilities"][0]
    rendered = report.render()
    assert not report.failed, rendered
    skipped = {r.case.name: r.reason for r in report.results if r.outcome == "skip"}
    assert skipped == {
        "execute_refused_partial": "worker does not declare capability 'partial_wake'",
        "level2_wake_needs_reload": "worker does not declare capability 'level2'",
        "reload_report": "worker does not declare capability 'level2'",
        "unusable_reload_source_refused": "worker does not declare capability 'level2'",
        "waiting_wake_acked_and_cached": "worker does not declare capability 'swap'",
        "outgoing_sleep_hint": "worker does not declare capability 'swap'",
        "no_memory_rolls_back": "worker does not declare capability 'swap'",  # started on its simulated device
        "update_refused_without_weight_update": "worker declares capability 'weight_update'; this case is for "
        "workers without it",  # every runner updates from disk
        "update_in_partial_weights_awake": "worker does not declare capability 'partial_wake'",
        "update_refused_weights_asleep": "worker does not declare capability 'partial_wake'",
        "share_needs_weights_awake": "worker does not declare capability 'partial_wake'",
        "update_in_needs_reload": "worker does not declare capability 'level2'",
        "reload_resets_version": "worker does not declare capability 'level2'",
        "reset_prefix_cache_in_partial": "worker does not declare capability 'partial_wake'",
        "reset_prefix_cache_refused_needs_reload": "worker does not declare capability 'level2'",
        "links_leave_what_the_command_leaves": "worker does not declare capability 'multi_path'",
        "shutdown_from_failed": "no failing worker to start: name one whose start-up fails (it greets in FAILED) "
        "with --failing-worker TARGET or SuiteOptions(failing_worker=...)",
        "save_refused_without_save_weights": "worker declares capability 'save_weights'; this case is for "
        "workers without it",  # its runner saves: the capability is the runner's, not the backend's
        "save_reloads_bit_for_bit": "worker does not declare capability 'level2'",
        "save_reload_names_the_saved_version": "worker does not declare capability 'level2'",
        "greeted_needs_reload_serves_nothing_until_weights_come": "no worker to start in NEEDS_RELOAD: name one "
        "that greets so with --needs-reload-worker TARGET or SuiteOptions(needs_reload_worker=...)",
        "update_refused_after_level2_sleep": "worker does not declare capability 'level2'",
        # its runner writes into the host copy: the refusal is for workers without host_refit
        "update_refused_sleeping": "worker declares capability 'host_refit'; this case is for workers without it",
    }, rendered
    passed = {r.case.name for r in report.results if r.outcome == "pass"}
    assert {"level2_refused_without_capability", "waiting_wake_refused_without_swap"} <= passed
    line = "P-8   PASS  level-2 reload rule (1 case, 1 skipped: worker does not declare capability 'level2')"
    assert line in rendered.splitlines(), rendered
