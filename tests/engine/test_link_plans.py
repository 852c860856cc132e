"""The engine lends idle GPUs' links to a stage's sleep and wake (P-18), end to end on CPU:
the ranks run a portable backend that declares relay peers and logs each command's plan
(tests/engine/link_backend.py). A rank frozen mid-sleep (SIGSTOP) holds the other stage's
command in flight without sleeping to prove anything."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.engine.conftest import in_thread, rank_pid, resume, small_spec, wait_for

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
    pid_b = rank_pid(engine, "b", 0)
    os.kill(pid_b, signal.SIGSTOP)  # b's sleep stays in flight: its GPU's link is busy
    try:
        sleeping_b = in_thread(lambda: engine.sleep("b", timeout_s=60.0))
        wait_for(lambda: engine.status()["b"]["state"] == "TRANSITIONING", what="b TRANSITIONING")
        engine.sleep("a")
    finally:
        resume(pid_b)
    sleeping_b.result(60.0)
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
