"""The engine lends idle GPUs' links to a stage's sleep and wake (P-18), end to end on CPU:
the ranks run a portable backend that declares relay peers and logs each command's plan
(tests/engine/link_backend.py). A rank frozen mid-sleep (SIGSTOP) holds the other stage's
command in flight without sleeping to prove anything."""

from __future__ import annotations

import json

import pytest

from tests.engine.conftest import sleep_held_by_a_stopped_rank, small_spec

BACKEND = "tests.engine.link_backend:LinkRecordingBackend"


def plans(log) -> list[tuple[str, list]]:
    return [(e["op"], e["links"]) for e in map(json.loads, log.read_text().splitlines())] if log.exists() else []


@pytest.fixture
def logs(tmp_path, monkeypatch):
    monkeypatch.setenv("OMNI_TEST_RELAY_PEERS", "1")
    return tmp_path


def test_an_idle_peer_gpu_is_lent_to_the_sleep_and_the_wake(engine_factory, logs, monkeypatch):
    monkeypatch.setenv("OMNI_TEST_LINKS_LOG", str(logs / "a.jsonl"))
    engine = engine_factory(small_spec("a", backend=BACKEND, devices=("0,1",)))  # own GPU 0, GPU 1 as cuda:1
    assert engine.status()["a"]["ranks"][0]["backend"] == "link-recording"
    engine.sleep("a")
    engine.wake("a")
    assert plans(logs / "a.jsonl") == [("sleep", [[None, 1.0], [1, 1.0]]), ("wake", [[None, 1.0], [1, 1.0]])]


def test_a_peer_whose_stage_is_in_a_lifecycle_command_is_not_lent(engine_factory, logs, monkeypatch):
    monkeypatch.setenv("OMNI_TEST_LINKS_LOG", str(logs / "both.jsonl"))
    engine = engine_factory(
        small_spec("a", backend=BACKEND, devices=("0,1",)), small_spec("b", backend=BACKEND, devices=("1,0",))
    )
    with sleep_held_by_a_stopped_rank(engine, "b"):  # b's sleep in flight: its GPU's link is busy
        engine.sleep("a")
    assert ("sleep", []) in plans(logs / "both.jsonl")  # a's sleep, on its own link alone
    # b's sleep was planned before a's command: a was idle, so b got GPU 0's link.
    assert ("sleep", [[None, 1.0], [1, 1.0]]) in plans(logs / "both.jsonl")
    engine.wake("b")
    engine.wake("a")  # both idle again: each lends to the other's command in turn
    assert plans(logs / "both.jsonl")[-2:] == [("wake", [[None, 1.0], [1, 1.0]])] * 2


def test_a_stage_can_turn_multi_path_off(engine_factory, logs, monkeypatch):
    monkeypatch.setenv("OMNI_TEST_LINKS_LOG", str(logs / "off.jsonl"))
    engine = engine_factory(small_spec("a", backend=BACKEND, devices=("0,1",), multi_path=False))
    engine.sleep("a")
    assert plans(logs / "off.jsonl") == [("sleep", [])]


def test_the_trace_records_each_plan_as_the_rank_got_it(engine_factory, logs, monkeypatch, tmp_path):
    from omni_core.formal.trace_links import LinkChecks
    from omni_core.fsm.trace_records import LinkPlanned
    from omni_core.trace import read_trace

    monkeypatch.setenv("OMNI_TEST_LINKS_LOG", str(logs / "traced.jsonl"))
    trace = tmp_path / "trace.jsonl"
    engine = engine_factory(small_spec("a", backend=BACKEND, devices=("0,1",)), trace_path=str(trace))
    engine.sleep("a")
    engine.wake("a")
    lines = read_trace(trace)
    recorded = [
        (ln.record.command.lower(), [[s.peer, s.share] for s in ln.record.links])
        for ln in lines
        if isinstance(ln.record, LinkPlanned)
    ]
    assert (
        recorded
        == plans(logs / "traced.jsonl")
        == [("sleep", [[None, 1.0], [1, 1.0]]), ("wake", [[None, 1.0], [1, 1.0]])]
    )
    checks = LinkChecks(lines, "a")
    assert not [checks.why(n) for n in range(1, len(lines) + 1) if checks.why(n)]
