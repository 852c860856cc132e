"""A small RL loop on one machine: a trainer and a rollout stage, versioned weight pushes.

The trainer is a plain PyTorch process (this one; omni-core did not start it) training a tiny
Qwen2 made by `omni-core models make`; the rollout is an omni-core stage running the same
architecture with the transformers runner. Each iteration:

1. the trainer takes an optimizer step (a toy language-modelling loss on the rollout's last
   tokens);
2. it shares its state_dict as bounded shared-memory buckets (`WeightSender`) and the engine
   pushes them into the rollout as weights version `step` (`Engine.update_weights`);
3. the rollout generates greedily; its tokens must equal the trainer's own model generating
   with the same weights, bit for bit;
4. the rollout sleeps (level 1: weights to host) and wakes, as it would while the trainer
   holds the GPU; the tokens after the wake must be the new version's again, never an older
   version's.

    python examples/rl_loop.py --iterations 3          # CPU, a few seconds per iteration

On a GPU: `device="cuda"` for both, `backend="fast"`; the buckets become CUDA IPC handles.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from omni_core import Engine, StageSpec
from omni_core.models import make_checkpoint
from omni_core.runners.weights import own_storage
from omni_core.weights_sender import WeightSender

PROMPT = [5, 6, 7, 8, 9, 10, 11]
NEW_TOKENS = 8


def greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def train_step(model: Any, optimizer: torch.optim.Optimizer, tokens: list[int]) -> float:
    """One step of next-token prediction on the rollout's own tokens (a stand-in for a policy
    gradient: the point is that the weights change every step)."""
    model.train()
    ids = torch.tensor([PROMPT + tokens])
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss.detach())


def run(iterations: int = 3, workdir: str | None = None, lr: float = 0.5) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    root = Path(workdir or tempfile.mkdtemp(prefix="omni-rl-"))
    checkpoint = make_checkpoint("qwen2", "tiny", root / "qwen2", force=True).path
    trainer = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True)
    own_storage([trainer])  # as the runner holds its weights: CPU kernels pick their path by alignment
    optimizer = torch.optim.SGD(trainer.parameters(), lr=lr)
    rollout = StageSpec(
        "rollout",
        runner="transformers",
        backend="portable",
        admission="queue",
        runner_args={"model": str(checkpoint), "max_seq_len": 64, "max_batch": 1, "cpu_threads": 1},
        deadline_s=60.0,
        start_deadline_s=240.0,
        request_timeout_s=60.0,
    )
    history: list[dict[str, Any]] = []
    request = {"prompt_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "stop_at_eos": False}
    with Engine([rollout]) as engine, WeightSender() as sender:
        tokens = engine.execute("rollout", request)["token_ids"]
        assert tokens == greedy(trainer, PROMPT), "the rollout starts from the trainer's weights"
        for step in range(1, iterations + 1):
            loss = train_step(trainer, optimizer, tokens)
            report = engine.update_weights("rollout", sender.share(trainer.state_dict()), version=step)
            tokens = engine.execute("rollout", request)["token_ids"]
            reference = greedy(trainer, PROMPT)
            engine.sleep("rollout", level=1)
            engine.wake("rollout")
            after_wake = engine.execute("rollout", request)["token_ids"]
            history.append(
                {
                    "step": step,
                    "loss": round(loss, 4),
                    "version": report.weights_version,
                    "update_s": round(report.duration_s, 4),
                    "tokens": tokens,
                    "equal_to_trainer": tokens == reference,
                    "equal_after_wake": after_wake == tokens,
                }
            )
            if tokens != reference or after_wake != tokens:
                raise AssertionError(f"step {step}: rollout {tokens}, after wake {after_wake}, trainer {reference}")
        history.append({"status": engine.status()["rollout"]["weights_version"]})
    return history


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the tiny checkpoint goes (default: a temp dir)")
    args = parser.parse_args()
    for line in run(args.iterations, args.workdir):
        print(json.dumps(line))


if __name__ == "__main__":
    main()
