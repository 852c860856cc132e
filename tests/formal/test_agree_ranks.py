"""StageCore agrees with the spec over replies at two ranks (formal/agree_ranks.py): every
sequence of up to three replies to a Sleep or a Wake, each from either rank and well-formed,
wrong in tags, state or epoch, a duplicate or a refusal, ends each step where the spec's
StageReceive says; a core that mishandles one kind of reply disagrees, naming the sequence."""

from __future__ import annotations

import msgspec
import pytest

from omni_core.formal import agree_ranks, check
from omni_core.formal.agree import AgreeParseError
from omni_core.formal.tlc import TlcNotFoundError
from omni_core.fsm.stage import StageCore
from omni_core.protocol import Ack
from tests.formal.test_agree import NoAsleepCheck, NoEpochFence, OnlyWaitingWakeRefused


@pytest.fixture(scope="module")
def table() -> dict:
    try:
        return agree_ranks.spec_table(check.tla_dir())
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))


class DuplicateCounted(StageCore):
    """StageCore counting ACKs, not ranks: a rank's second ACK stands for a rank still silent."""

    def _on_reply(self, reply, now):
        task = self._task
        if isinstance(reply, Ack) and task is not None and reply.rank in task.acks:
            silent = [r for r in self.ranks if r not in task.acks and r not in task.refusals]
            if silent:
                reply = msgspec.structs.replace(reply, rank=silent[0])
        return super()._on_reply(reply, now)


def test_a_duplicate_needs_an_earlier_reply_of_its_rank():
    assert agree_ranks._resolve(((0, "tags"), (1, "ok"), (0, "dup"), (0, "dup")), 3) == "tags"
    with pytest.raises(AgreeParseError, match="no earlier reply of rank 1"):
        agree_ranks._resolve(((0, "ok"), (1, "dup")), 1)
    line = (("Sleep", False), ((0, "ok"),), 2, ("TRANSITIONING", frozenset(), "pending", frozenset(), True, {0}, {}))
    other = line[:3] + (("FAILED",) + line[3][1:],)
    with pytest.raises(AgreeParseError, match="two results"):
        agree_ranks.table_from_lines([line, other])


def test_the_stage_agrees_with_the_spec_over_every_reply_sequence(table):
    seqs = {seq for _, seq in table}
    # every call, both ranks, every kind of reply, sequences of one to three replies
    assert {call for call, _ in table} == {("Sleep", False), ("Wake", False), ("Wake", True)}
    assert {c for seq in seqs for c in seq} == {(r, k) for r in (0, 1) for k in agree_ranks.KINDS}
    assert {len(seq) for seq in seqs} == {1, 2, 3} and len(table) > 4000
    # every end occurs, so the comparison is not vacuous
    ends = {step[2] for steps in table.values() for step in steps.values()}
    assert ends == {"pending", "ok", "failed", "refused"}
    assert agree_ranks.compare(table) == []


@pytest.mark.parametrize(
    "core, first_seq",
    [
        (NoAsleepCheck, (0, "tags")),
        (NoEpochFence, (0, "epoch")),
        (DuplicateCounted, (0, "ok")),
        (OnlyWaitingWakeRefused, (0, "nack")),
    ],
    ids=lambda v: getattr(v, "__name__", None),
)
def test_a_stage_that_mishandles_replies_is_caught(table, core, first_seq):
    found = agree_ranks.compare(table, core)
    assert found, f"{core.__name__} went unnoticed"
    first = found[0]
    assert first.seq[0] == first_seq and first.step >= 2, str(first)
    assert str(first_seq) in str(first) and "the spec holds" in str(first)
    if core is DuplicateCounted:
        # rank 0 ACKs twice: the spec ignores the second and waits for rank 1
        assert first.seq == ((0, "ok"), (0, "dup")) and first.spec[2] == "pending" and first.code[2] == "ok"
    elif core is NoEpochFence:
        assert first.spec[5] == frozenset() and first.code[5] == frozenset({0})
    elif core is OnlyWaitingWakeRefused:
        # a plain wake's NO_MEMORY is a refusal now: the spec waits for rank 1, the mutant fails
        assert first.call == ("Wake", False) and first.code[0] == "FAILED" and first.spec[0] != "FAILED"
    else:
        assert first.spec[0] == "FAILED" and first.code[0] != "FAILED"


def test_the_check_row_fails_on_a_stage_that_mishandles_replies(table, monkeypatch):
    monkeypatch.setattr(agree_ranks, "spec_table", lambda root, timeout_s: table)  # TLC ran once, above
    lines: list[str] = []
    row = check.ranks_agreement_row(check.tla_dir(), 60.0, echo=lines.append)
    assert row.ok and row.states == len(table) and f"{len(table)} reply sequences" in lines[0]
    compare = agree_ranks.compare
    monkeypatch.setattr(agree_ranks, "compare", lambda t: compare(t, NoAsleepCheck))
    row = check.ranks_agreement_row(check.tla_dir(), 60.0, echo=lines.append)
    assert not row.ok and row.got.endswith("disagree") and "first: Sleep then replies [(0, 'tags')]" in row.note
