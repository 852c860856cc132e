"""A small RL loop on one machine: a trainer and a rollout stage, versioned weight pushes.

The trainer is a plain PyTorch process (this one; omni-core did not start it) training a Qwen2
made by `omni-core models make`; the rollout is an omni-core stage running the same
architecture, with the transformers runner (CPU) or vLLM (`--rollout vllm`, on a GPU). Each
iteration:

1. the trainer takes an optimizer step (a toy language-modelling loss on the rollout's last
   tokens);
2. it shares its state_dict as bounded buckets (`WeightSender`: shared memory on the host, CUDA
   IPC handles on a GPU), or every other step saves a checkpoint, and the engine pushes it into
   the rollout as weights version `step` (`Engine.update_weights`; the vllm runner hands the
   tensors to vLLM's own loader);
3. the rollout generates greedily; its tokens must equal a plain reference with the same
   weights, bit for bit: the trainer's own model generating (transformers), or a plain
   `vllm.LLM` in a child process that loads each step's weights from disk (vllm);
4. the rollout sleeps (level 1: weights to host) and wakes, as it would while the trainer
   holds the GPU; the tokens after the wake must be the new version's again, never an older
   version's.

    python examples/rl_loop.py --iterations 3                         # CPU, seconds per step
    python examples/rl_loop.py --rollout vllm --size 1.5b --out DIR   # a GPU with vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
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
MAX_MODEL_LEN = 64

# A plain vLLM, as a vLLM user runs it: loads the first directory, then each next one through
# vLLM's own reload from disk; greedy tokens of each, as one JSON line. Exits with os._exit:
# vLLM's teardown of its allocator is not what is tested.
PLAIN_VLLM = """
import json, os, sys
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
attention = {"backend": args["attention_backend"]} if args["attention_backend"] else None
llm = LLM(model=args["dirs"][0], enforce_eager=True, gpu_memory_utilization=args["fraction"], seed=0,
          max_model_len=args["max_model_len"], max_num_seqs=1, load_format="safetensors", attention_config=attention)
params = SamplingParams(max_tokens=args["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
tokens = []
for index, directory in enumerate(args["dirs"]):
    if index:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": directory})
    out = llm.generate([{"prompt_token_ids": args["prompt"]}], params, use_tqdm=False)
    tokens.append(list(out[0].outputs[0].token_ids))
print("PLAIN_VLLM " + json.dumps(tokens), flush=True)
os._exit(0)
"""


def greedy(model: Any, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    return out[0, len(prompt) :].tolist()


def train_step(model: Any, optimizer: torch.optim.Optimizer, tokens: list[int]) -> float:
    """One step of next-token prediction on the rollout's own tokens (a stand-in for a policy
    gradient: the point is that the weights change every step)."""
    model.train()
    ids = torch.tensor([PROMPT + tokens], device=model.device)
    loss = model(input_ids=ids, labels=ids).loss
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    model.eval()
    return float(loss.detach())


def save_weights(model: Any, checkpoint: Path, directory: Path) -> str:
    """The trainer's weights as a checkpoint beside the original: its config and tokenizer,
    its tensors under the checkpoint's own names (tied ones once)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    shutil.copytree(checkpoint, directory, ignore=shutil.ignore_patterns("*.safetensors"))
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    state = model.state_dict()
    save_file({n: state[n].detach().to("cpu").contiguous() for n in names}, str(directory / "model.safetensors"))
    return str(directory)


def plain_vllm_tokens(dirs: list[str], fraction: float, attention_backend: str | None) -> list[list[int]]:
    args = {
        "dirs": dirs,
        "fraction": fraction,
        "attention_backend": attention_backend,
        "max_model_len": MAX_MODEL_LEN,
        "new_tokens": NEW_TOKENS,
        "prompt": PROMPT,
    }
    done = subprocess.run(
        [sys.executable, "-c", PLAIN_VLLM, json.dumps(args)], capture_output=True, text=True, timeout=900
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("PLAIN_VLLM ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the plain vLLM reference failed (rc {done.returncode}): {done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("PLAIN_VLLM "))


def rollout_spec(rollout: str, checkpoint: Path, fraction: float, attention_backend: str | None) -> StageSpec:
    timeouts = {"deadline_s": 300.0, "start_deadline_s": 600.0, "request_timeout_s": 300.0, "admission": "queue"}
    if rollout == "vllm":
        runner_args = {"model": str(checkpoint), "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 1}
        if attention_backend:
            runner_args["attention_backend"] = attention_backend
        return StageSpec(
            "rollout",
            runner="vllm",
            backend="fast",
            device="cuda",
            gpu_memory_fraction=fraction,
            runner_args=runner_args,
            **timeouts,
        )
    return StageSpec(
        "rollout",
        runner="transformers",
        backend="portable",
        runner_args={"model": str(checkpoint), "max_seq_len": MAX_MODEL_LEN, "max_batch": 1, "cpu_threads": 1},
        **timeouts,
    )


def run(
    iterations: int = 3,
    workdir: str | None = None,
    lr: float = 0.5,
    *,
    rollout: str = "transformers",
    size: str = "tiny",
    fraction: float = 0.3,
    attention_backend: str | None = None,
) -> list[dict[str, Any]]:
    """Train, push, generate, sleep and wake `iterations` times; one record per step, then
    the stage's final version. The transformers rollout runs on the CPU, vllm on the GPU."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    root = Path(workdir or tempfile.mkdtemp(prefix="omni-rl-"))
    on_gpu = rollout == "vllm"
    dtype = "bfloat16" if on_gpu else None
    checkpoint = Path(make_checkpoint("qwen2", size, root / f"qwen2-{size}", dtype=dtype, force=True).path)
    trainer = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True)
    trainer.to("cuda" if on_gpu else "cpu")
    own_storage([trainer])  # as the runner holds its weights: CPU kernels pick their path by alignment
    optimizer = torch.optim.SGD(trainer.parameters(), lr=lr)
    history: list[dict[str, Any]] = []
    saved: list[str] = []
    request = {"prompt_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "stop_at_eos": False}
    spec = rollout_spec(rollout, checkpoint, fraction, attention_backend)
    with Engine([spec]) as engine, WeightSender() as sender:
        tokens = engine.execute("rollout", request)["token_ids"]
        if on_gpu:
            saved.append(str(checkpoint))
            start_tokens = tokens
        elif tokens != greedy(trainer, PROMPT):
            raise AssertionError("the rollout does not start from the trainer's weights")
        for step in range(1, iterations + 1):
            loss = train_step(trainer, optimizer, tokens)
            # Odd steps over shared buckets (IPC on a GPU), even ones from the trainer's checkpoint.
            source_kind = "disk" if step % 2 == 0 else ("ipc" if on_gpu else "shm")
            directory = root / f"step-{step}"
            if on_gpu or source_kind == "disk":
                saved.append(save_weights(trainer, checkpoint, directory))
            source = str(directory) if source_kind == "disk" else sender.share(trainer.state_dict())
            report = engine.update_weights("rollout", source, version=step)
            tokens = engine.execute("rollout", request)["token_ids"]
            engine.sleep("rollout", level=1)
            engine.wake("rollout")
            after_wake = engine.execute("rollout", request)["token_ids"]
            record = {
                "step": step,
                "loss": round(loss, 4),
                "version": report.weights_version,
                "source": source_kind,
                "update_s": round(report.duration_s, 4),
                "tokens": tokens,
                "equal_after_wake": after_wake == tokens,
            }
            if not on_gpu:
                record["reference"] = greedy(trainer, PROMPT)
            history.append(record)
        final = {"status": engine.status()["rollout"]["weights_version"]}
    if on_gpu:
        del trainer, optimizer
        torch.cuda.empty_cache()
        plain = plain_vllm_tokens(saved, fraction, attention_backend)
        final["start_equal_to_reference"] = plain[0] == start_tokens
        for record, reference in zip(history, plain[1:], strict=True):
            record["reference"] = reference
    for record in history:
        record["equal_to_reference"] = record["tokens"] == record.pop("reference")
        if not (record["equal_to_reference"] and record["equal_after_wake"]):
            raise AssertionError(f"step {record['step']}: the rollout's tokens are not the reference's: {record}")
    return [*history, final]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--rollout", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--size", default="tiny", help="the Qwen2 size (`omni-core models list`)")
    parser.add_argument("--lr", type=float, default=None, help="SGD step (default 0.5 on CPU, 0.01 with vllm)")
    parser.add_argument("--fraction", type=float, default=0.3, help="the vLLM rollout's share of the GPU")
    parser.add_argument("--attention-backend", default=os.environ.get("VLLM_BUNDLE_ATTN_BACKEND"))
    parser.add_argument("--out", default=None, help="also write the records to OUT/rl_loop.jsonl")
    args = parser.parse_args()
    lr = args.lr if args.lr is not None else (0.01 if args.rollout == "vllm" else 0.5)
    lines = run(
        args.iterations,
        args.workdir,
        lr,
        rollout=args.rollout,
        size=args.size,
        fraction=args.fraction,
        attention_backend=args.attention_backend,
    )
    text = "".join(json.dumps(line) + "\n" for line in lines)
    print(text, end="", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rl_loop.jsonl").write_text(text)
    if args.rollout == "vllm":
        os._exit(0)  # CUDA and vLLM's allocator are not torn down: the results are written


if __name__ == "__main__":
    main()
