"""examples/rl_loop.py runs: each step's weights reach the rollout as that version, its greedy
tokens equal the trainer's model with the same weights, and a sleep and wake keeps them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_loop.py"


def load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rl_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_rl_example_runs_and_every_step_matches_the_trainer(tmp_path) -> None:
    module = load_example()
    history = module.run(iterations=3, workdir=str(tmp_path))
    steps, final = history[:-1], history[-1]
    assert [s["version"] for s in steps] == [1, 2, 3] and final["status"] == 3
    assert final["start_equal_to_reference"]
    assert all(s["equal_to_reference"] and s["equal_after_wake"] for s in steps)
    assert module.failures(history) == []
    assert {"make the checkpoint", "start the rollout stage", "step 3: update"} <= final["phases_s"].keys()
    assert len({tuple(s["tokens"]) for s in steps}) > 1  # the training moved the policy


def test_a_step_whose_tokens_differ_is_a_failure_with_its_divergence() -> None:
    module = load_example()
    good = {"step": 1, "equal_to_reference": True, "equal_after_wake": True}
    stale = {"step": 2, "equal_to_reference": False, "equal_after_wake": True, "divergence": {"at": 3}}
    woke_old = {"step": 3, "equal_to_reference": True, "equal_after_wake": False}
    said = module.failures([good, stale, woke_old, {"status": 3, "start_equal_to_reference": True}])
    assert [line.split(":")[0] for line in said] == ["step 2", "step 3"]
    assert module.failures([good, {"status": 1, "start_equal_to_reference": False}])[0].startswith("start")


def test_divergence_names_the_first_differing_token_and_the_trainers_preference(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from omni_core.models import make_checkpoint

    module = load_example()
    checkpoint = make_checkpoint("qwen2", "tiny", tmp_path / "m").path
    model = AutoModelForCausalLM.from_pretrained(checkpoint, local_files_only=True).eval()
    reference = module.greedy(model, module.PROMPT)
    other = [*reference[:2], (reference[2] + 1) % 512, *reference[3:]]
    said = module.divergence(model, other, reference)
    assert said["at"] == 2
    assert said["gap_at_divergence"] > 0  # greedy took the reference's token: its logit is the largest


def test_the_rl_example_in_adapter_mode_syncs_only_the_adapter_each_step(tmp_path) -> None:
    """`--adapter`: each step refits the rollout's LoRA adapter from the trainer's adapter
    tensors (adapter-only refit) as adapter version `step`; the base weights stay version 0,
    and the rollout's tokens with the adapter equal the trainer's PEFT model's, also after a
    level-1 sleep and wake."""
    import pytest

    pytest.importorskip("peft", reason="needs the models extra: pip install -e '.[models]'")
    module = load_example()
    history = module.run(iterations=3, workdir=str(tmp_path), adapter=True)
    steps, final = history[:-1], history[-1]
    assert [(s["version"], s["base_version"], s["source"]) for s in steps] == [
        (1, 0, "adapter-shm"),
        (2, 0, "adapter-shm"),
        (3, 0, "adapter-shm"),
    ]
    assert (final["status"], final["adapters"]) == (0, {"policy": 3})  # no base update ever went out
    assert final["start_equal_to_reference"]
    assert module.failures(history) == []
    assert {"step 3: share the adapter (shm)", "step 3: refit the adapter"} <= final["phases_s"].keys()
    assert not any("update" in phase for phase in final["phases_s"])
    assert len({tuple(s["tokens"]) for s in steps}) > 1  # training the adapter moved the policy
