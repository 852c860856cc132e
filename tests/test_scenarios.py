"""Data-driven scenarios with golden output (etcd-raft's interaction tests): each file in
tests/testdata/ is a script of engine inputs, network faults and rank effects run on the one
simulator (`omni_testing.network`), each command followed by `----` and the transcript it must
produce. `pytest tests/test_scenarios.py --rewrite` writes the transcripts of now into the
files; the diff is the review. The language is documented in `omni_testing.script.Script`."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from omni_testing.scenario import parse_blocks, render_blocks, run_blocks

TESTDATA = Path(__file__).parent / "testdata"
SCENARIOS = sorted(TESTDATA.glob("*.txt"))


def test_there_are_scenarios() -> None:
    assert len(SCENARIOS) >= 10, SCENARIOS


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario(path: Path, request: pytest.FixtureRequest) -> None:
    text = path.read_text()
    blocks, trailer = parse_blocks(text)
    assert blocks, f"{path.name} has no commands"
    outputs = run_blocks(blocks)
    again = run_blocks(parse_blocks(text)[0])
    assert outputs == again, f"{path.name} is not deterministic"
    now = render_blocks(blocks, outputs, trailer)
    if request.config.getoption("--rewrite"):
        if now != text:
            path.write_text(now)
        return
    missing = [b.command for b in blocks if b.expected is None]
    assert not missing, f"{path.name}: commands without `----` and output (run with --rewrite): {missing}"
    if now != text:
        diff = "".join(
            difflib.unified_diff(
                text.splitlines(True), now.splitlines(True), f"{path.name} (expected)", f"{path.name} (now)"
            )
        )
        raise AssertionError(f"scenario output changed (pytest {Path(__file__).name} --rewrite to accept):\n{diff}")


def test_the_file_format_round_trips() -> None:
    text = "# a comment\n\nstage ranks=1\n----\nline one\nline two\n\n# trailing note\n"
    blocks, trailer = parse_blocks(text)
    assert [(b.preamble, b.command, b.expected) for b in blocks] == [
        (["# a comment", ""], "stage ranks=1", ["line one", "line two"])
    ]
    assert render_blocks(blocks, [b.expected or [] for b in blocks], trailer) == text


# Worker transitions the engine never causes, and why; every other one a scenario must show.
ENGINE_NEVER_CAUSES = {
    "status": "the engine never sends Status (the conformance suite and the fuzzer do)",
    "sleep_already": "the stage answers ALREADY itself; a copy of a command gets the rank's cached reply",
    "wake_already": "the stage answers ALREADY itself; a copy of a command gets the rank's cached reply",
    "reload@ACTIVE": "the stage reloads only from NEEDS_RELOAD",
    "reload_refused_active@RELOADING": "the stage reloads only from NEEDS_RELOAD",
    "fail@ACTIVE": "in a settled state only a Status effect can raise (a failed Execute is the request's error)",
    "fail@SLEEPING": "in a settled state only a Status effect can raise",
    "fail@PARTIAL": "in a settled state only a Status effect can raise",
    "fail@NEEDS_RELOAD": "in a settled state only a Status effect can raise",
    "shutdown@LOADING": "a simulated runner loads (or fails to) before its Hello",
    "shutdown_already@STOPPED": "a rank exits after it ACKs its Shutdown",
}


def test_the_scenarios_cover_every_transition_and_admission_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The done-when of the scenario suite: every (trigger, state) of the stage table, every
    admission row and queue rule, and every worker transition the engine can cause."""
    from lifecycle_helpers import record_transitions, table_pairs

    from omni_core.fsm import admission, stage

    rows: set[object] = set()

    def recording(lookup):  # type: ignore[no-untyped-def]
        def wrapped(state, policy):  # type: ignore[no-untyped-def]
            row = lookup(state, policy)
            rows.add(row)
            return row

        return wrapped

    for name in ("admit", "queue_rule"):
        wrapped = recording(getattr(admission, name))
        monkeypatch.setattr(admission, name, wrapped)
        monkeypatch.setattr(stage, name, wrapped, raising=False)
    with record_transitions() as fired:
        for path in SCENARIOS:
            run_blocks(parse_blocks(path.read_text())[0])
    assert not table_pairs("stage") - fired, f"no scenario shows {sorted(table_pairs('stage') - fired)}"
    never = {
        (name, trigger, state)
        for (name, trigger, state) in table_pairs("worker")
        if trigger in ENGINE_NEVER_CAUSES or f"{trigger}@{state}" in ENGINE_NEVER_CAUSES
    }
    missing = table_pairs("worker") - never - fired
    assert not missing, f"no scenario shows the worker transitions {sorted(missing)}"
    assert not fired & never, f"the engine did cause {sorted(fired & never)}: update ENGINE_NEVER_CAUSES"
    unused = [row for row in (*admission.ADMISSION, *admission.QUEUE_RULES) if row not in rows]
    assert not unused, f"no scenario uses the rows {unused}"
