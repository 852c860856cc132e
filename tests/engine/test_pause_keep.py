"""In-flight refit through real rank processes (pause mode keep): requests frozen
mid-generation, the weights updated under them, resumed; each result's version spans match a
reference generation that switches weights at the recorded token, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_core.engine import Engine, ExecuteResult
from omni_core.engine.errors import InvalidArgumentError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import LONG_TIMEOUT_S, SMALL_RUNNER, small_spec, wait_for
from tests.engine.test_weight_updates import new_weights
from tests.engine.token_runner import next_token

NAME = "k"
MAX_TOKENS = 24


def _engine(engine_factory) -> Engine:
    spec = small_spec(NAME, runner="tests.engine.token_runner:TokenRunner", max_in_flight=8, batch_max_requests=8)
    return engine_factory(spec)


def _weights_v0() -> tuple[SyntheticRunner, torch.Tensor]:
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len(NAME)))
    runner.load_weights()
    return runner, runner.weights[0].clone()


def reference(first: int, result: ExecuteResult, weights: dict[int, torch.Tensor]) -> list[int]:
    """What a generation that switches weights at each recorded span's start computes."""
    spans = [(s.start_token, s.weights_version) for s in result.version_spans] or [(0, result.weights_version)]
    tokens, previous = [], first
    for i in range(MAX_TOKENS):
        version = [v for start, v in spans if start <= i][-1]
        previous = next_token(weights[version], previous)
        tokens.append(previous)
    return tokens


def _gated(engine: Engine, tmp_path: Path, first: int, gate_at: int):
    payload = {
        "first": first,
        "max_tokens": MAX_TOKENS,
        "gate_at": gate_at,
        "gate": str(tmp_path / "gate"),
        "reached": str(tmp_path / f"reached-{first}"),
    }
    return engine.submit(NAME, payload, timeout_s=LONG_TIMEOUT_S, with_version=True)


def _update(engine: Engine, runner: SyntheticRunner, seed: int, version: int) -> torch.Tensor:
    weights = new_weights(runner, seed)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        report = engine.update_weights(NAME, sender.share(weights), version=version)
    assert report.weights_version == version and report.state == "PAUSED"
    return weights["w0"]


def test_held_requests_resume_on_the_new_weights_and_their_spans_say_from_which_token(
    engine_factory, tmp_path: Path
) -> None:
    engine = _engine(engine_factory)
    runner, w0 = _weights_v0()
    gates = {1: 2, 2: 5, 3: 9}  # first token -> where it waits, mid-generation
    held = {first: _gated(engine, tmp_path, first, at) for first, at in gates.items()}
    free = engine.submit(NAME, {"first": 4, "max_tokens": MAX_TOKENS}, timeout_s=LONG_TIMEOUT_S, with_version=True)
    wait_for(lambda: all((tmp_path / f"reached-{f}").exists() for f in gates), what="every request at its gate")
    report = engine.pause(NAME, "keep")
    assert (report.status, report.state) == ("OK", "PAUSED")
    # Opened now: a rank that stepped them while held would generate past it under version 0.
    (tmp_path / "gate").touch()
    w1 = _update(engine, runner, seed=11, version=1)
    assert not any(f.done() for f in held.values())
    assert engine.resume(NAME).state == "RUNNING"
    weights = {0: w0, 1: w1}
    for first, at in gates.items():
        result = held[first].result(timeout=LONG_TIMEOUT_S)
        assert result.weights_version == 1
        assert [(s.weights_version, s.start_token) for s in result.version_spans] == [(0, 0), (1, at)]
        assert result.output["tokens"] == reference(first, result, weights)
        # Not the generation of either version alone: the switch is where the spans say.
        assert result.output["tokens"] != reference(first, ExecuteResult(None, 1), weights)
    done = free.result(timeout=LONG_TIMEOUT_S)  # held wherever the pause found it, or finished
    assert done.output["tokens"] == reference(4, done, weights)


def test_clear_cache_restarts_held_requests_on_the_new_weights_and_says_what_it_discarded(
    engine_factory, tmp_path: Path
) -> None:
    engine = _engine(engine_factory)
    runner, _ = _weights_v0()
    future = _gated(engine, tmp_path, first=7, gate_at=4)
    wait_for(lambda: (tmp_path / "reached-7").exists(), what="the request at its gate")
    engine.pause(NAME, "keep", clear_cache=True)
    (tmp_path / "gate").touch()
    w1 = _update(engine, runner, seed=12, version=1)
    engine.resume(NAME)
    result = future.result(timeout=LONG_TIMEOUT_S)
    assert result.discarded_tokens == 4
    assert [(s.weights_version, s.start_token) for s in result.version_spans] == [(1, 0)]
    assert result.output["tokens"] == reference(7, result, {1: w1})


def test_only_an_update_runs_beside_held_requests(engine_factory, tmp_path: Path) -> None:
    engine = _engine(engine_factory)
    future = _gated(engine, tmp_path, first=5, gate_at=3)
    wait_for(lambda: (tmp_path / "reached-5").exists(), what="the request at its gate")
    engine.pause(NAME, "keep")
    with pytest.raises(InvalidArgumentError, match="held on its ranks"):
        engine.sleep(NAME, level=1)
    (tmp_path / "gate").touch()
    engine.resume(NAME)
    result = future.result(timeout=LONG_TIMEOUT_S)
    assert result.version_spans == () and result.weights_version == 0
    assert engine.sleep(NAME, level=1).state == "SLEEPING"
