"""`omni-core conformance`: usage errors (in-process, no worker) and a failing worker named by
import path, through the installed console script, with JUnit output."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from omni_core.cli import main

from ._util import HERE, finish, start


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--worker", "no_such_module_xyz:start"], "cannot import 'no_such_module_xyz'"),
        (["--worker", "json:no_such_factory"], "has no attribute 'no_such_factory'"),
        (["--worker", "json:__doc__"], "not a callable factory"),
        (["--worker", "cmd:my-worker --rank {rank}"], "lacks the {address} placeholder"),
        (["--worker", "not-a-target"], "is not 'synthetic', 'cmd:<command>' or 'package.module:factory'"),
        (["--worker", "synthetic", "--only", "P-99"], "unknown requirement 'P-99'"),
        (["--worker", "synthetic", "--payload", "{not json"], "Expecting property name"),
        (["--worker", "synthetic", "--epoch", "0"], "epoch must be >= 1"),
        (["--worker", "synthetic", "--reply-timeout", "0"], "reply_timeout_s must be > 0"),
        (
            ["--worker", "synthetic", "--memory-pressure", "no_such_module_xyz:hook"],
            "cannot import 'no_such_module_xyz'",
        ),
    ],
)
def test_usage_errors_exit_2_without_starting_anything(capsys, args, words):
    assert main(["conformance", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and err.startswith("omni-core conformance: ")


def test_a_failing_worker_exits_1_names_the_requirement_and_writes_junit(tmp_path):
    junit = tmp_path / "out.xml"
    proc = start(
        [
            "omni-core",
            "conformance",
            "--worker",
            "conformance.mutants:no_reply_cache",
            "--only",
            "p2,P-3",
            "--junit",
            str(junit),
            "--reply-timeout",
            "8",
            "-v",
        ],
        HERE.parent,
    )
    code, out = finish(proc)
    assert code == 1, out
    lines = out.splitlines()
    assert lines[0] == "omni-core conformance (protocol v1) against: conformance.mutants:no_reply_cache"
    # The run-wide stray check (P-1) runs under any --only: a stray can follow any command.
    assert lines[1] == "P-1   PASS  one terminal reply (1 case)", out
    p2 = next(x for x in lines if x.startswith("P-2 "))
    assert p2.startswith(
        "P-2   FAIL  idempotent duplicates: duplicate_answered_from_cache: a copy of an "
        "answered Sleep got a different reply (+3 more failing case(s))"
    ), out
    assert "P-3   PASS  envelope (3 cases)" in lines, out
    assert not any(x.startswith(("P-4 ", "P-12")) for x in lines), out  # --only
    assert "        FAIL  task_id_reused: expected a refusal (TASK_ID_REUSED), got an Ack" in out  # -v
    assert 'requirement P-2 (Idempotent duplicates):\n      "A command whose `task_id`' in out
    assert lines[-2].startswith(
        "summary: FAILED: 3 requirements checked: 2 passed, 1 failed, 0 skipped "
        "(0 not applicable to a worker); 8 cases: 4 passed, 4 failed, 0 skipped;"
    )
    assert lines[-1] == f"wrote {junit}"
    suite = ET.parse(junit).getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("8", "4", "0")
    failed = {c.get("name"): c.find("failure") for c in suite.iter("testcase") if c.find("failure") is not None}
    assert set(failed) == {
        "duplicate_answered_from_cache",
        "task_id_reused",
        "status_keeps_reply_cache",
        "duplicate_after_64_newer",
    }
    assert failed["task_id_reused"].get("message").startswith("P-2: expected a refusal (TASK_ID_REUSED)")
    assert "sent:     Sleep(v=1, task_id='task_id_reused-execute-" in failed["task_id_reused"].text


def test_json_report_of_a_failing_worker(tmp_path):
    proc = start(
        [
            "omni-core",
            "conformance",
            "--worker",
            "conformance.mutants:no_reply_cache",
            "--only",
            "P-2",
            "--json",
            "--reply-timeout",
            "8",
        ],
        HERE.parent,
    )
    code, out = finish(proc)
    assert code == 1, out
    report = json.loads(out)
    assert report["target"] == "conformance.mutants:no_reply_cache" and report["passed"] is False
    verdicts = {r["id"]: r for r in report["requirements"]}
    assert verdicts["P-2"]["verdict"] == "FAIL" and verdicts["P-1"]["verdict"] == "PASS"
    failed = {c["name"]: c for c in verdicts["P-2"]["cases"] if c["outcome"] == "fail"}
    assert "task_id_reused" in failed
    assert failed["task_id_reused"]["details"].startswith("P-2")
    assert "requirement P-2 (Idempotent duplicates)" in failed["task_id_reused"]["details"]
