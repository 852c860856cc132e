"""The link-plan checks of trace validation (omni_core/formal/trace_links.py) without TLC: the
legal trace of a run with link plans (tests/formal/tamper/legal/links.jsonl) passes them,
each forged plan of the tamper corpus is refuted at its own line with its reason, and a
trace of an engine that wrote no plans owes none."""

from __future__ import annotations

import msgspec
import pytest

from omni_core.formal.trace_links import LinkChecks
from omni_core.fsm import trace_records as T
from omni_core.trace import read_trace
from tests.formal.tamper import generate
from tests.formal.test_tamper_corpus import CORPUS, STOPS

LINK_CLASSES = sorted(name for name, entry in CORPUS["tampered"].items() if entry["source"] == "links")


def refuted(lines: list[T.TraceLine], stage: str) -> dict[int, str]:
    checks = LinkChecks(lines, stage)
    return {n: checks.why(n) for n in range(1, len(lines) + 1) if checks.why(n)}


def test_the_legal_trace_lends_peers_and_passes_every_check():
    lines = read_trace(generate.LEGAL / "links.jsonl")
    plans = [ln.record for ln in lines if isinstance(ln.record, T.LinkPlanned)]
    lent = {(p.task_id, p.rank, p.visible[p.links[1].peer]) for p in plans if p.links}
    assert {gpu for _, _, gpu in lent} == {"0", "2"} and len(lent) == 5  # a: 2 wakes, a sleep; b: both
    assert any(not p.links and p.rank == 0 and p.visible[p.own] == "0" for p in plans)  # while b was busy
    for stage in ("a", "b"):
        assert refuted(lines, stage) == {}


def test_the_corpus_forges_each_rule():
    assert len(LINK_CLASSES) >= 10


@pytest.mark.parametrize("name", LINK_CLASSES)
def test_a_forged_plan_is_refuted_at_its_line(name: str) -> None:
    entry = CORPUS["tampered"][name]
    lines = read_trace(generate.TAMPERED / f"{name}.jsonl")
    found = refuted(lines, entry["stage"])
    assert len(found) == 1, found
    ((n, why),) = found.items()
    assert isinstance(lines[n - 1].record, T.LinkPlanned)
    assert STOPS[name] in why


def test_a_trace_with_no_plans_owes_none():
    lines = read_trace(generate.LEGAL / "swap.jsonl")
    assert not any(isinstance(ln.record, T.LinkPlanned) for ln in lines)
    assert refuted(lines, "talker") == refuted(lines, "decoder") == {}


def test_a_plan_after_its_task_ended_may_lend_the_gpu_again():
    """The GPU a's first sleep lent is free once that task ended: a's wake lends it again."""
    lines = read_trace(generate.LEGAL / "links.jsonl")
    ended = [k for k, ln in enumerate(lines) if isinstance(ln.record, T.TaskEnded) and ln.stage == "a"]
    del lines[ended[0]]  # the sleep never ends: its GPU stays lent to it
    assert any("lent already to rank 0 for task 'sleep-a-" in why for why in refuted(lines, "a").values())


def test_a_resent_command_carries_the_plan_its_first_send_had():
    lines = read_trace(generate.LEGAL / "links.jsonl")
    k = next(k for k, ln in enumerate(lines) if isinstance(ln.record, T.LinkPlanned) and ln.record.links)
    sent = next(j for j in range(k, -1, -1) if isinstance(lines[j].record, T.StageSent) and lines[j].record.rank == 0)
    again = [lines[sent], lines[k]]  # the same send once more (a SendFailed resend), same plan: fine
    assert refuted([*lines[: k + 1], *again, *lines[k + 1 :]], "a") == {}
    changed = msgspec.structs.replace(lines[k], record=msgspec.structs.replace(lines[k].record, links=()))
    found = refuted([*lines[: k + 1], lines[sent], changed, *lines[k + 1 :]], "a")
    assert list(found.values()) == [found[k + 3]] and "was resent with links []; its first had" in found[k + 3]
