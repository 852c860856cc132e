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
3. the rollout generates greedily; its tokens must equal, bit for bit, those of the trainer's
   own model (a plain transformers model holding exactly the weights just pushed);
4. the rollout sleeps (level 1: weights to host) and wakes, as it would while the trainer
   holds the GPU; the tokens after the wake must be the new version's again, never an older
   version's.

On a GPU the model is float32 by default (`--dtype`): vLLM's kernels and transformers' differ
in rounding, and in bfloat16 (errors near 1e-2) a greedy step of a random model can flip
between two near-equal logits; float32 (with Triton's dots in IEEE float32,
TRITON_F32_DEFAULT=ieee, set here for the rollout's process) makes such a flip far rarer. A
step whose tokens differ records where, and by how much the trainer's logits preferred its own
token there (`gap_at_divergence`): a rounding flip shows a gap near the rounding error, other
weights a gap of the order of the logits themselves.
Each phase's wall time goes to stderr as it ends (`[rl] ...`) and into the records.

With `--adapter` the trainer trains a LoRA adapter (PEFT, rank 4 on q_proj and v_proj) over
frozen base weights, and each step syncs only the adapter: its tensors, by PEFT's names, are
shared the same way and the engine refits the rollout's adapter `policy` to version `step`
(`Engine.add_adapter(..., tensors=...)`, adapter-only refit: no copy of the base weights, whose
version stays 0); the rollout generates with the adapter, and its tokens must equal the
trainer's PEFT model's, before and after the sleep and wake.

    python examples/rl_loop.py --iterations 3                                  # CPU, seconds per step
    python examples/rl_loop.py --iterations 3 --adapter                        # CPU, the adapter only
    python examples/rl_loop.py --rollout vllm --size 0.5b --out DIR            # a GPU with vLLM, ~2 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
ADAPTER = "policy"  # the rollout's name for the trainer's LoRA adapter (--adapter)
ADAPTER_RANK = 4
ADAPTER_MODULES = ("q_proj", "v_proj")


class Clock:
    """Wall time of each named phase, printed to stderr as it ends (a run cut short by a
    timeout still shows where its time went)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self.started = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, started)

    def record(self, name: str, started: float) -> None:
        took_s = time.perf_counter() - started
        self.phases[name] = round(took_s, 3)
        print(f"[rl] {name}: {took_s:.2f} s (at {time.perf_counter() - self.started:.1f} s)", file=sys.stderr)


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


def divergence(model: Any, tokens: list[int], reference: list[int]) -> dict[str, Any]:
    """Where `tokens` leave `reference` (the trainer's greedy tokens) and how much the trainer's
    logits preferred its own token there (near the rounding error: a flip at a near-tie)."""
    at = next(i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b)
    with torch.no_grad():
        ids = torch.tensor([PROMPT + reference[:at]], device=model.device)
        logits = model(input_ids=ids).logits[0, -1].float()
    return {"at": at, "gap_at_divergence": float(logits[reference[at]] - logits[tokens[at]])}


def adapter_trainer(model: Any, lr: float) -> tuple[Any, torch.optim.Optimizer]:
    """The trainer as a PEFT model: a LoRA adapter on ADAPTER_MODULES trains, the base is frozen.
    PEFT starts lora_B at zero, so before the first step the adapter changes nothing."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=ADAPTER_RANK, lora_alpha=ADAPTER_RANK, target_modules=list(ADAPTER_MODULES), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    trained = [p for p in peft_model.parameters() if p.requires_grad]  # the adapter's only
    return peft_model, torch.optim.SGD(trained, lr=lr)


def adapter_tensors(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors by PEFT's saved names (base_model.model.<module>.lora_A.weight)."""
    from peft import get_peft_model_state_dict

    return {name: t.detach().contiguous() for name, t in get_peft_model_state_dict(peft_model).items()}


def rollout_spec(
    rollout: str,
    checkpoint: Path,
    fraction: float,
    attention_backend: str | None,
    dtype: str,
    adapter: bool = False,
) -> StageSpec:
    timeouts: dict[str, Any] = {
        "deadline_s": 300.0,
        "start_deadline_s": 600.0,
        "request_timeout_s": 300.0,
        "admission": "queue",
    }
    if adapter:  # one adapter, in its own pool where the runner has one (a level-1 sleep offloads it)
        timeouts |= {"max_loras": 1, "max_lora_rank": ADAPTER_RANK}
    if rollout == "vllm":
        runner_args = {"model": str(checkpoint), "dtype": dtype, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 1}
        if adapter:  # vLLM's own LoRA serves it
            runner_args |= {"enable_lora": True, "max_loras": 1, "max_lora_rank": ADAPTER_RANK}
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
        tags=("weights", "kv_cache", "adapters") if adapter else ("weights", "kv_cache"),
        **timeouts,
    )


def push(engine: Engine, sender: WeightSender, trainer: Any, step: int, ctx: dict[str, Any]) -> tuple[str, Any]:
    """Step `step`'s sync: the whole state_dict as weights version `step` (odd steps over shared
    buckets, IPC on a GPU; even ones from a checkpoint), or with `--adapter` the adapter's
    tensors alone as adapter version `step`. The source's kind and the engine's report."""
    clock, bucket_kind = ctx["clock"], "ipc" if ctx["on_gpu"] else "shm"
    if ctx["adapter"]:
        with clock.phase(f"step {step}: share the adapter ({bucket_kind})"):
            source: Any = sender.share(adapter_tensors(trainer))
        with clock.phase(f"step {step}: refit the adapter"):
            report = engine.add_adapter("rollout", ADAPTER, tensors=source, version=step, lora_alpha=ADAPTER_RANK)
        return f"adapter-{bucket_kind}", report
    source_kind = "disk" if step % 2 == 0 else bucket_kind
    with clock.phase(f"step {step}: share or save ({source_kind})"):
        if source_kind == "disk":
            source = save_weights(trainer, ctx["checkpoint"], ctx["root"] / f"step-{step}")
        else:
            source = sender.share(trainer.state_dict())
    with clock.phase(f"step {step}: update"):
        report = engine.update_weights("rollout", source, version=step)
    return source_kind, report


def run(
    iterations: int = 3,
    workdir: str | None = None,
    lr: float = 0.5,
    *,
    rollout: str = "transformers",
    size: str = "tiny",
    dtype: str | None = None,
    fraction: float = 0.3,
    attention_backend: str | None = None,
    adapter: bool = False,
) -> list[dict[str, Any]]:
    """Train, push, generate, sleep and wake `iterations` times; one record per step, then
    the stage's final version and the phases' wall times. The transformers rollout runs on
    the CPU, vllm on the GPU (float32 unless `dtype` says otherwise). `adapter`: train and
    sync a LoRA adapter only (each record's `version` is the adapter's, `base_version` the
    base weights', which stay 0)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    clock = Clock()
    root = Path(workdir or tempfile.mkdtemp(prefix="omni-rl-"))
    on_gpu = rollout == "vllm"
    dtype = dtype or ("float32" if on_gpu else None)
    if on_gpu and dtype == "float32":
        os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # the rank inherits it: vLLM's Triton attention
    with clock.phase("make the checkpoint"):
        checkpoint = Path(make_checkpoint("qwen2", size, root / f"qwen2-{size}", dtype=dtype, force=True).path)
    with clock.phase("load the trainer"):
        trainer = AutoModelForCausalLM.from_pretrained(str(checkpoint), local_files_only=True)
        trainer.to("cuda" if on_gpu else "cpu")
        own_storage([trainer])  # as the runner holds its weights: CPU kernels pick their path by alignment
        optimizer = torch.optim.SGD(trainer.parameters(), lr=lr)
        if adapter:
            trainer, optimizer = adapter_trainer(trainer, lr)
    history: list[dict[str, Any]] = []
    request = {"prompt_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "stop_at_eos": False}
    spec = rollout_spec(rollout, checkpoint, fraction, attention_backend, dtype or "auto", adapter)
    ctx = {"clock": clock, "on_gpu": on_gpu, "adapter": adapter, "checkpoint": checkpoint, "root": root}
    starting = time.perf_counter()
    with Engine([spec]) as engine, WeightSender() as sender:
        clock.record("start the rollout stage", starting)

        def generate(named: str | None = None) -> Any:
            return engine.execute("rollout", request, adapter=named, with_version=True)

        tokens = generate().output["token_ids"]  # the adapter's lora_B starts at zero: the base's tokens
        start_reference = greedy(trainer, PROMPT)
        start = {"start_equal_to_reference": tokens == start_reference}
        if tokens != start_reference:
            start["start_divergence"] = divergence(trainer, tokens, start_reference)
        for step in range(1, iterations + 1):
            with clock.phase(f"step {step}: train"):
                loss = train_step(trainer, optimizer, tokens)
            source_kind, report = push(engine, sender, trainer, step, ctx)
            named = ADAPTER if adapter else None
            with clock.phase(f"step {step}: generate, sleep, wake, generate"):
                result = generate(named)
                tokens = result.output["token_ids"]
                engine.sleep("rollout", level=1)
                engine.wake("rollout")
                after_wake = generate(named).output["token_ids"]
            with clock.phase(f"step {step}: reference"):
                reference = greedy(trainer, PROMPT)
            record = {
                "step": step,
                "loss": round(loss, 4),
                "version": result.adapter_version if adapter else report.weights_version,
                "base_version": result.weights_version,
                "source": source_kind,
                "update_s": round(report.duration_s, 4),
                "tokens": tokens,
                "equal_to_reference": tokens == reference,
                "equal_after_wake": after_wake == tokens,
            }
            if tokens != reference:
                record["divergence"] = divergence(trainer, tokens, reference)
            history.append(record)
        final = {"status": engine.status()["rollout"]["weights_version"], **start}
        if adapter:
            final["adapters"] = {a.name: a.version for a in engine.list_adapters("rollout").adapters}
    final["phases_s"] = clock.phases
    final["total_s"] = round(time.perf_counter() - clock.started, 1)
    return [*history, final]


def failures(lines: list[dict[str, Any]]) -> list[str]:
    """Each step (or the start) whose tokens are not the reference's, or changed at a wake."""
    steps, final = lines[:-1], lines[-1]
    said = [] if final.get("start_equal_to_reference", True) else [f"start: {final.get('start_divergence')}"]
    for record in steps:
        if not (record["equal_to_reference"] and record["equal_after_wake"]):
            said.append(f"step {record['step']}: {record}")
    return said


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where the checkpoints go (default: a temp dir)")
    parser.add_argument("--rollout", choices=("transformers", "vllm"), default="transformers")
    parser.add_argument("--size", default="tiny", help="the Qwen2 size (`omni-core models list`)")
    parser.add_argument("--dtype", default=None, help="the model's dtype (default: float32 with vllm, else the size's)")
    parser.add_argument("--lr", type=float, default=None, help="SGD step (default 0.5 on CPU, 0.01 with vllm)")
    parser.add_argument("--fraction", type=float, default=0.3, help="the vLLM rollout's share of the GPU")
    parser.add_argument("--attention-backend", default=os.environ.get("VLLM_BUNDLE_ATTN_BACKEND"))
    parser.add_argument("--out", default=None, help="also write the records to OUT/rl_loop.jsonl")
    parser.add_argument("--adapter", action="store_true", help="train and sync a LoRA adapter only, each step")
    args = parser.parse_args()
    lr = args.lr if args.lr is not None else (0.01 if args.rollout == "vllm" else 0.5)
    lines = run(
        args.iterations,
        args.workdir,
        lr,
        rollout=args.rollout,
        size=args.size,
        dtype=args.dtype,
        fraction=args.fraction,
        attention_backend=args.attention_backend,
        adapter=args.adapter,
    )
    text = "".join(json.dumps(line) + "\n" for line in lines)
    print(text, end="", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "rl_loop.jsonl").write_text(text)
    failed = failures(lines)
    for line in failed:
        print(f"[rl] NOT EQUAL: {line}", file=sys.stderr, flush=True)
    code = 1 if failed else 0
    if args.rollout == "vllm":
        os._exit(code)  # CUDA and vLLM's allocator are not torn down: the results are written
    sys.exit(code)


if __name__ == "__main__":
    main()
