"""The Python cores agree with the spec's actions beyond the tables (formal/agree.py), and the
two drifts of issue 17 (BUSY before the reply cache; a reload that always expects ACTIVE)
make the agreement check, and so `omni-core check`, fail naming the first case."""

from __future__ import annotations

import argparse

import msgspec
import pytest

from omni_core.formal import agree, check
from omni_core.formal.tlc import TlcNotFoundError
from omni_core.fsm import worker as fsm_worker
from omni_core.fsm.settle import Settled, settle_row
from omni_core.fsm.stage import StageCore
from omni_core.fsm.worker import WorkerCore
from omni_core.protocol import Ack, Execute, Nack, NackReason, Status, Wake


@pytest.fixture(scope="module")
def table() -> agree.SpecTable:
    try:
        return agree.spec_table(check.tla_dir())
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))


def busy_before_cache(self, command):
    """The skeleton's order: BUSY answered before the reply cache is consulted."""
    pending = self.work.pending
    if (
        command.epoch >= self.epoch
        and pending is not None
        and not isinstance(command, Status)
        and pending.command.task_id != command.task_id
    ):
        step = self._refuse(command, NackReason.BUSY, "busy")
        if isinstance(command, Execute):
            self._remember(command, step.replies[0])  # as worker.py records it
        return step
    return ORIGINAL_ON_COMMAND(self, command)


ORIGINAL_ON_COMMAND = WorkerCore._on_command
ORIGINAL_RELOAD = StageCore._reload


def reload_expects_active(self, call, now):
    step = ORIGINAL_RELOAD(self, call, now)
    row = settle_row(Settled.ACTIVE)
    task = self.task
    task.expect_state, task.commit_trigger = row.rank_state, row.stage_commit
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
    assert {"STALE_EPOCH", "EPOCH_AHEAD", "BUSY", "INVALID_STATE", "FAILED", "ALREADY", "CACHED", "-"} <= infos
    assert {v[0] for v in table.issue.values()} >= {"TRANSITIONING", "WAKING", "SLEEPING", "RUNNING"}
    # replies: every kind, every outcome, some wrong in state, tags, epoch or task
    assert len(table.reply) > 3000
    assert {x[1] for _, _, x in table.reply} >= {"OK", "ALREADY", "INVALID_STATE", "INVALID_ARGUMENT", "NO_MEMORY"}
    assert {v[2] for v in table.reply.values()} == {"ok", "failed", "refused", "pending"}
    assert {x[5] for _, _, x in table.reply} == {0, 1, 2} and {x[4] for _, _, x in table.reply} == {1, 3}
    assert agree.compare(table) == []


class NoAsleepCheck(StageCore):
    """StageCore without its check of the asleep tags in an ACK: each ACK is read as if it
    named the tags the stage expects."""

    def _on_reply(self, reply, now):
        task = self._task
        if isinstance(reply, Ack) and task is not None:
            reply = msgspec.structs.replace(reply, asleep_tags=tuple(sorted(task.expect_asleep)))
        return super()._on_reply(reply, now)


class NoEpochFence(StageCore):
    """StageCore taking replies of any epoch as its own."""

    def _on_reply(self, reply, now):
        return super()._on_reply(msgspec.structs.replace(reply, epoch=self.epoch), now)


class OnlyWaitingWakeRefused(StageCore):
    """StageCore taking NO_MEMORY as a refusal only of a wake that may wait, and as a failure of
    a plain one (memory_wait_s 0), though its rank rolled back as cleanly."""

    def _on_reply(self, reply, now):
        task = self._task
        if (
            isinstance(reply, Nack)
            and reply.reason is NackReason.NO_MEMORY
            and task is not None
            and isinstance(task.command, Wake)
            and task.command.memory_wait_s <= 0
        ):
            reply = msgspec.structs.replace(reply, reason=NackReason.INVALID_STATE)
        return super()._on_reply(reply, now)


@pytest.mark.parametrize("core", [NoAsleepCheck, NoEpochFence, OnlyWaitingWakeRefused], ids=lambda c: c.__name__)
def test_a_stage_that_mishandles_replies_is_caught(table, core):
    found = agree.compare(table, stage=core)
    assert found, f"{core.__name__} went unnoticed"
    assert {d.what for d in found} == {"stage reply"}, found[0]
    first = found[0]
    kind, info, _, _, _, epoch = first.case[2]
    if core is NoAsleepCheck:
        assert kind == "ack" and first.spec[0] == "FAILED" and first.code[0] != "FAILED"
    elif core is NoEpochFence:
        assert epoch != 1 and first.spec[2] == "pending"
    else:
        assert info == "NO_MEMORY" and first.spec[2] == "refused" and first.code[2] == "failed"


def test_busy_before_the_reply_cache_is_caught(table, monkeypatch):
    monkeypatch.setattr(WorkerCore, "_on_command", busy_before_cache)
    found = agree.compare(table)
    assert found, "moving BUSY before the reply cache went unnoticed"
    # (its BUSY also comes before the epoch window: those cases disagree too, at epoch 66)
    first = next(d for d in found if d.case[1][4] <= 1)
    (_, _, _, pending_task, _, _, _, cached), (_, _, _, task, epoch) = first.case
    assert first.what == "OnCommand" and cached and task == 2 and epoch == 1 and pending_task == 1
    assert first.spec[7] == "CACHED" and first.code[7] == "BUSY"
    assert "OnCommand in" in str(first) and "BUSY" in str(first)
    assert {d.what for d in found} == {"OnCommand"}


def test_reload_always_expecting_active_is_caught(table, monkeypatch):
    monkeypatch.setattr(StageCore, "_reload", reload_expects_active)
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
        monkeypatch.setattr(StageCore, "_reload", reload_expects_active)
    parser = argparse.ArgumentParser()
    check.add_arguments(parser)
    lines: list[str] = []
    assert check.run(parser.parse_args(["--only", "agree"]), echo=lines.append) == 1
    out = "\n".join(lines)
    assert "disagree" in out and "first:" in out and "FAIL" in out
    monkeypatch.undo()
    monkeypatch.setattr(agree, "spec_table", lambda root, timeout_s: table)
    assert check.run(parser.parse_args(["--only", "agree"]), echo=lines.append) == 0


@pytest.mark.parametrize("window", [63, 65, 5000])
def test_another_epoch_window_is_caught(table, monkeypatch, window):
    """The spec holds P-13's window (64) as its own number: a worker core with another one
    disagrees at the window's edge, however the code's constant is imported elsewhere."""
    monkeypatch.setattr(fsm_worker, "MAX_EPOCH_AHEAD", window)
    found = agree.compare(table)
    assert found and {d.what for d in found} == {"OnCommand"}, f"an epoch window of {window} went unnoticed"
    epochs = {d.case[1][4] for d in found}
    assert epochs == ({65} if window < 64 else {66}), epochs
    assert all("EPOCH_AHEAD" in (d.spec[7], d.code[7]) for d in found)
