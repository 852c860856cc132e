"""Starting workers: every factory return form, and workers that never come up properly.
The suite must report each with its cause, quickly, and leave no process behind."""

from __future__ import annotations

import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest

from omni_core.conformance import SuiteOptions, run_suite
from omni_core.conformance.targets import TargetError, command_factory, resolve_target
from omni_core.workers.config import WorkerConfig

from ._util import HERE

FAKE = HERE / "fake_worker.py"
FAST = SuiteOptions(start_timeout_s=5.0, reply_timeout_s=0.5)


def fake(mode: str, started: list | None = None):
    """A factory for the fake worker in `mode`; with `started`, it starts the process itself."""

    def factory(address: str, rank: int, epoch: int):
        argv = [sys.executable, str(FAKE), mode, address, str(rank), str(epoch)]
        if started is None:
            return argv
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started.append(proc)
        return proc

    return factory


def failures(report) -> dict[str, str]:
    return {r.case.name: r.reason for r in report.results if r.outcome == "fail"}


def test_a_worker_that_exits_before_hello_is_reported_once_with_its_output():
    started = time.monotonic()
    report = run_suite(fake("exit"), only="P-3,P-4", options=FAST)
    assert time.monotonic() - started < 10  # started once; later cases reuse the start error
    reasons = failures(report)
    assert set(reasons) == {
        "greeting",
        "reply_envelope",
        "unsupported_version",
        "sleep_already",
        "wake_already",
        "second_shutdown",
    }
    assert all("exited with code 3 before its Hello" in r for r in reasons.values()), reasons
    greeting = next(r for r in report.results if r.case.name == "greeting")
    assert "fake worker: giving up" in greeting.details()


def test_a_silent_worker_hits_the_start_deadline_and_is_killed():
    started: list[subprocess.Popen] = []
    report = run_suite(fake("silent", started), only="P-3", options=SuiteOptions(start_timeout_s=1.0))
    reasons = failures(report)
    assert reasons["greeting"].startswith("the worker did not start: no Hello from rank(s) [0] within 1 s")
    assert started and all(p.poll() is not None for p in started)  # adopted, then killed


def test_a_first_message_that_is_not_hello_fails_the_start():
    report = run_suite(fake("ack-first"), only="P-3", options=FAST)
    assert "was not a Hello for a rank being started ([0]): Ack(" in failures(report)["greeting"]


def test_wrong_rank_in_hello_and_no_replies_fail_with_deadlines():
    report = run_suite(fake("wrong-rank"), only="P-3", options=FAST)
    reasons = failures(report)
    assert reasons["greeting"] == "Hello names rank 5, started as 0"
    assert reasons["reply_envelope"].startswith("no reply from worker rank 0 (pid ")
    assert "within 0.5 s to Status 'reply_envelope-status-" in reasons["reply_envelope"], reasons
    assert reasons["reply_envelope"].endswith("; the process is still running")
    # Silent while alive: the run stops there instead of waiting out the deadline again.
    assert next(r for r in report.results if r.case.name == "unsupported_version").reason.startswith(
        "not run: the worker went silent in P-3/reply_envelope (no reply from worker rank 0"
    )


def test_undecodable_replies_are_reported_as_such():
    report = run_suite(fake("garbage-replies"), only="P-3", options=FAST)
    assert failures(report)["reply_envelope"] == "the worker sent bytes that are not a valid protocol message"


@pytest.mark.parametrize("mode", ["bad-utf8-detail", "exit-control"])
def test_any_bytes_from_a_worker_end_in_a_report_and_a_valid_junit_file(tmp_path, mode):
    """Invalid UTF-8 in a reply, control bytes in the worker's output: a failure each, and a
    JUnit file an XML parser reads."""
    report = run_suite(fake(mode), only="P-3,P-6", options=FAST)
    assert report.failed and len(report.results) == 6  # P-3, P-6 and the run-wide stray check
    reasons = failures(report)
    if mode == "bad-utf8-detail":
        assert reasons["reply_envelope"] == "the worker sent bytes that are not a valid protocol message"
    else:
        assert "exited with code 3 before its Hello" in reasons["greeting"]
    path = tmp_path / "junit.xml"
    report.write_junit(str(path))
    suite = ET.parse(path).getroot()
    assert suite.get("failures") == str(sum(r.outcome == "fail" for r in report.results))
    text = path.read_text()
    assert "\x00" not in text and "\x1b" not in text
    if mode == "exit-control":
        assert r"fake worker: \x00\x1b[31m" in text


def test_a_case_that_meets_an_unforeseen_answer_fails_alone():
    """A worker whose Hello lists no tags breaks cases that index its tags: each such case
    fails saying so, and the run goes on to its report."""
    report = run_suite(fake("no-tags"), only="P-3,P-4", options=FAST)
    reasons = failures(report)
    assert reasons["greeting"] == "Hello lists no memory tags"
    assert reasons["wake_already"].startswith("the suite could not finish this case: IndexError"), reasons


def test_factory_errors_are_failures_not_crashes():
    def broken(address, rank, epoch):
        raise RuntimeError("no GPU here")

    report = run_suite(broken, only="P-6", options=FAST)
    assert set(failures(report).values()) == {
        "the worker did not start: the worker factory failed for rank 0: RuntimeError: no GPU here"
    }
    report = run_suite(lambda a, r, e: 42, only="P-6", options=FAST)
    assert "the factory returned 42; return an argv list" in next(iter(failures(report).values()))


def test_a_factory_may_return_a_worker_config():
    def config(address, rank, epoch):
        return WorkerConfig(
            address=address,
            rank=rank,
            epoch=epoch,
            backend="portable",
            runner_args={"weights_bytes": 1 << 16, "tensor_count": 2, "kv_bytes": 1 << 14, "hidden": 16},
        )

    report = run_suite(config, only="P-6")
    assert not report.failed, report.render()


def test_target_strings():
    assert resolve_target("synthetic")[1] is resolve_target("reference")[1]
    start = command_factory("""w --config '{"address": "{address}", "rank": {rank}}' --epoch {epoch}""")
    expected = """w --config '{"address": "ipc:///tmp/a/b.sock", "rank": 1}' --epoch 4"""
    assert start("ipc:///tmp/a/b.sock", 1, 4) == expected
    for bad in ("", "  ", "cmd:w --rank {rank}", "nomodule", "json:"):
        with pytest.raises(TargetError):
            resolve_target(bad)


def test_the_suite_imports_nothing_of_the_worker(tmp_path):
    """Black box: running the suite (CLI, plugin, runner) loads no worker code, no torch."""
    script = f"""
import sys
import omni_core.cli, omni_core.conformance.plugin
from omni_core.conformance import SuiteOptions, run_suite
def fake(address, rank, epoch):
    return [sys.executable, {str(FAKE)!r}, "wrong-rank", address, str(rank), str(epoch)]
report = run_suite(fake, only="P-3", options=SuiteOptions(reply_timeout_s=0.3))
assert report.failed
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith(("omni_core.workers",
                "omni_core.fsm", "omni_core.engine")))
print("loaded:", loaded)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "loaded: []" in out.stdout, out.stdout
