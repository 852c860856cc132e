"""The tamper corpus (tests/formal/tamper): every legal trace of a real run is accepted by
TLC, every tampered copy rejected, each where the replay stops on content (a divergence, a
refuted line, a broken invariant, a line out of order or a step owed at the end), never by
a TLC error or a timeout. The committed tampered traces are what the generator makes from
the committed legal ones today."""

from __future__ import annotations

import json

import pytest

from omni_core.formal import trace_check
from omni_core.trace import read_trace
from tests.formal.tamper import generate
from tests.formal.test_trace_validation import needs_tlc

CORPUS = json.loads(generate.MANIFEST.read_text())
REJECTIONS = (
    "no spec action matches this event",
    "refuted by the records around it",
    "the replay breaks",
    "out of program order",
    trace_check.OWED_AT_END,
)

# Classes whose lie is one line: the replay must stop there, saying so.
STOPS = {
    "task_ok_after_rank_failure": "TaskEnded task_id=sleep-talker-",
    "request_ok_without_results": "RequestAnswered request_id=req-talker-1",
    "stopped_hides_rest": "written for the stage after its StageStopped",
    "old_epoch_result_after_restart": "StageReceived epoch=0 rank=1 task_id=req-talker-1 reply=result",
    "refused_by_policy_while_running": "the admission table decides otherwise there (queue: run",
    "auto_wake_under_queue": "started by the stage itself in SLEEPING under policy queue",
    "queued_request_unanswered": "req-talker-8 never answered",
    "request_deadline_rewritten": "it came in (line 17) with it at",
    "fenced_hides_death": "death flagged fenced, but it is the process of the stage's epoch 0",
    "no_memory_before_wait": "NO_MEMORY 0.010 s after taking it; it was sent to wait 0.2 s",
    "wake_wait_shortened": "sent with memory_wait_s 0.01; its issue named 0.2",
    "incoming_wakes_overlap": "which the incoming wake 'fits/in' of stage 'decoder' holds since line",
    "incoming_wake_unheld": "wake 'refused/in' waits for memory, but no IncomingHeld line holds its devices",
    "links_without_multi_path": "has links, but the rank may not be sent any",
    "link_to_unreported_peer": "a link through cuda:1, which is not a peer its Hello reported reachable",
    "link_to_own_gpu": "a link through cuda:0, which is not a peer its Hello reported reachable",
    "link_bytes_lie": "spreads [1179904, 2359808] bytes over its links",
    "link_lent_twice": "lent already to rank 0 for task",
    "link_to_busy_stage": "on which stage 'b' runs a rank with a task in flight",
    "link_own_gpu_moved": "names its own GPU '0', but its RankSpawned put it on '2'",
    "link_plan_of_no_send": "has a link plan, but no StageSent of that command to that rank precedes it",
    "incoming_bytes_without_swap": "but the rank did not declare SWAP",
    "incoming_bytes_on_wake": "only a swap's outgoing Sleep does",
}


def test_the_corpus_is_what_the_generator_makes() -> None:
    made = generate.tampered()
    assert generate.manifest(made) == CORPUS, "run: python -m tests.formal.tamper.generate"
    assert sorted(p.stem for p in generate.TAMPERED.glob("*.jsonl")) == sorted(made)
    for name, (_, _, data) in made.items():
        assert (generate.TAMPERED / f"{name}.jsonl").read_bytes() == data, name


@needs_tlc
@pytest.mark.parametrize("name", CORPUS["legal"])
def test_a_legal_trace_is_accepted(name: str) -> None:
    verdicts = trace_check.validate_records(read_trace(generate.LEGAL / f"{name}.jsonl"))
    assert verdicts and all(v.accepted for v in verdicts), "\n".join(v.line() for v in verdicts)


@needs_tlc
@pytest.mark.parametrize("name", sorted(CORPUS["tampered"]))
def test_a_tampered_trace_is_rejected(name: str) -> None:
    entry = CORPUS["tampered"][name]
    verdicts = trace_check.validate_records(read_trace(generate.TAMPERED / f"{name}.jsonl"), entry["stage"])
    verdict = verdicts[-1]
    print(verdict.line())
    assert not verdict.accepted, f"{name} ({entry['what']}) was accepted"
    assert verdict.reason.startswith(REJECTIONS), verdict.line()
    assert STOPS.get(name, "") in verdict.line(), verdict.line()
