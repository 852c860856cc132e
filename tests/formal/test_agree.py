"""The Python cores agree with the spec's actions beyond the tables (formal/agree.py), and the
two drifts of issue 17 (BUSY before the reply cache; a reload that always expects ACTIVE)
make the agreement check, and so `omni-core check`, fail naming the first case."""

from __future__ import annotations

import argparse

import pytest

from omni_core.formal import agree, check
from omni_core.formal.tlc import TlcNotFoundError
from omni_core.fsm.settle import Settled, settle_row
from omni_core.fsm.stage import StageCore
from omni_core.fsm.worker import WorkerCore
from omni_core.protocol import Execute, NackReason, Status


@pytest.fixture(scope="module")
def table() -> agree.SpecTable:
    try:
        return agree.spec_table(check.tla_dir())
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))


def busy_before_cache(self, command):
    """The skeleton's order: BUSY answered before the reply cache is consulted."""
    pending = self._pending
    if (command.epoch >= self.epoch and pending is not None and not isinstance(command, Status)
            and pending.command.task_id != command.task_id):  # fmt: skip
        step = self._refuse(command, NackReason.BUSY, "busy")
        if isinstance(command, Execute):
            self._remember(command, step.replies[0])  # as worker.py records it
        return step
    return ORIGINAL_ON_COMMAND(self, command)


ORIGINAL_ON_COMMAND = WorkerCore._on_command
ORIGINAL_RELOAD = StageCore.reload


def reload_expects_active(self, task_id, source, now, deadline_s):
    step = ORIGINAL_RELOAD(self, task_id, source, now, deadline_s)
    row = settle_row(Settled.ACTIVE)
    self._task.expect_state, self._task.commit_trigger = row.rank_state, row.stage_commit
    return step


def test_parse_lines_reads_wrapped_values():
    out = 'noise\n<< "AGREE",\n   "recv",\n   <<"ACTIVE", {"kv_cache", "weights"}, TRUE, -1>>,\n   {} >>\nmore'
    assert agree.parse_lines(out) == [("recv", ("ACTIVE", frozenset({"kv_cache", "weights"}), True, -1), frozenset())]
    with pytest.raises(agree.AgreeParseError):
        agree.parse_lines('<<"AGREE", [a |-> 1]>>')


def test_the_cores_agree_with_the_spec_in_every_case(table):
    assert len(set(table.worker_cases)) > 3000 and len(table.done) > 50 and len(set(table.stage_cases)) > 100
    # every kind of answer occurs, so the comparison is not vacuous
    infos = {v[7] for v in table.recv.values()}
    assert {"STALE_EPOCH", "BUSY", "INVALID_STATE", "FAILED", "ALREADY", "CACHED", "-"} <= infos
    assert {v[0] for v in table.issue.values()} >= {"TRANSITIONING", "WAKING", "SLEEPING", "RUNNING"}
    assert agree.compare(table) == []


def test_busy_before_the_reply_cache_is_caught(table, monkeypatch):
    monkeypatch.setattr(WorkerCore, "_on_command", busy_before_cache)
    found = agree.compare(table)
    assert found, "moving BUSY before the reply cache went unnoticed"
    first = found[0]
    (_, _, _, pending_task, _, _, _, cached), (_, _, _, task, epoch) = first.case
    assert first.what == "OnCommand" and cached and task == 2 and epoch == 1 and pending_task == 1
    assert first.spec[7] == "CACHED" and first.code[7] == "BUSY"
    assert "OnCommand in" in str(first) and "BUSY" in str(first)
    assert {d.what for d in found} == {"OnCommand"}


def test_reload_always_expecting_active_is_caught(table, monkeypatch):
    monkeypatch.setattr(StageCore, "reload", reload_expects_active)
    found = agree.compare(table)
    assert found, "a reload that always expects ACTIVE went unnoticed"
    first = found[0]
    (state, asleep, _), (call, _, _) = first.case
    assert first.what == "stage call" and call == "ReloadWeights" and state == "NEEDS_RELOAD" and asleep
    assert first.spec[3][0] == "PARTIAL" and first.code[3][0] == "ACTIVE"
    assert all(d.case[1][0] == "ReloadWeights" for d in found)


@pytest.mark.parametrize("drift", ["busy_before_cache", "reload_expects_active"])
def test_omni_core_check_fails_on_a_drift(table, monkeypatch, drift):
    monkeypatch.setattr(agree, "spec_table", lambda root, timeout_s: table)  # TLC ran once, above
    if drift == "busy_before_cache":
        monkeypatch.setattr(WorkerCore, "_on_command", busy_before_cache)
    else:
        monkeypatch.setattr(StageCore, "reload", reload_expects_active)
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    lines: list[str] = []
    assert check.run(parser.parse_args(["--only", "agree"]), echo=lines.append) == 1
    out = "\n".join(lines)
    assert "disagree" in out and "first:" in out and "FAIL" in out
    monkeypatch.undo()
    monkeypatch.setattr(agree, "spec_table", lambda root, timeout_s: table)
    assert check.run(parser.parse_args(["--only", "agree"]), echo=lines.append) == 0
