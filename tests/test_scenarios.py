"""Data-driven scenarios with golden output (etcd-raft's interaction tests): each file in
tests/testdata/ is a script of engine inputs, network faults and rank effects run on the one
simulator (`omni_core.fsm.sim`), each command followed by `----` and the transcript it must
produce. `pytest tests/test_scenarios.py --rewrite` writes the transcripts of now into the
files; the diff is the review. The language is documented in `omni_core.fsm.sim.Script`."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from omni_core.fsm.sim import parse_blocks, render_blocks, run_blocks

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
        diff = "".join(difflib.unified_diff(text.splitlines(True), now.splitlines(True), f"{path.name} (expected)",
                                            f"{path.name} (now)"))  # fmt: skip
        raise AssertionError(f"scenario output changed (pytest {Path(__file__).name} --rewrite to accept):\n{diff}")


def test_the_file_format_round_trips() -> None:
    text = "# a comment\n\nstage ranks=1\n----\nline one\nline two\n\n# trailing note\n"
    blocks, trailer = parse_blocks(text)
    assert [(b.preamble, b.command, b.expected) for b in blocks] == [
        (["# a comment", ""], "stage ranks=1", ["line one", "line two"])]
    assert render_blocks(blocks, [b.expected or [] for b in blocks], trailer) == text
