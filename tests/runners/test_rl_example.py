"""examples/rl_loop.py runs: each step's weights reach the rollout as that version, its greedy
tokens equal the trainer's model with the same weights, and a sleep and wake keeps them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def test_the_rl_example_runs_and_every_step_matches_the_trainer(tmp_path) -> None:
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.run(iterations=3, workdir=str(tmp_path))
    steps, final = history[:-1], history[-1]
    assert [s["version"] for s in steps] == [1, 2, 3] and final == {"status": 3}
    assert all(s["equal_to_reference"] and s["equal_after_wake"] for s in steps)
    assert len({tuple(s["tokens"]) for s in steps}) > 1  # the training moved the policy
