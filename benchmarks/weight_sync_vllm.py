"""`--weight-sync`'s vLLM part: omni-core's update path against vLLM's own, one model, one run.

The same Qwen2 checkpoint (`omni-core models make`, the 3 GB 1.5B shape by default) is served
twice, one after the other, on GPU 0, and both receive the same trainer tensors (this process
holds them on cuda:0, new values per version) over CUDA IPC on the same GPU:

- omni-core: a `vllm` stage, `Engine.update_weights(stage, WeightSender().share(tensors))`
  (the rank applies them through vLLM's layer-wise reload); the first update opens the
  buckets' handles, the next reuses them;
- vLLM: a plain `vllm.LLM(weight_transfer_config={"backend": "ipc"})` in a child process (the
  engine core in it), fed as vLLM's own trainer helper feeds it (`IPCWeightTransferEngine.
  trainer_send_weights`, unpacked: one handle per tensor, keyed by the GPU's UUID):
  `start_weight_update`, `update_weights`, `finish_weight_update`. The child reads each
  update over a pipe; its own time is from the update's arrival to finish's return.

After each version both generate greedily from the same prompt: the tokens must be equal
(the same weights in the same engine). vLLM's IPC engine module imports `ray` and `requests`
at its top for its 'ray' and 'http' send modes, which this path does not use; where the device
lacks them, the child imports that module once over empty stand-ins and removes them again.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pickle
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

PROMPT = [5, 6, 7, 8, 9, 10, 11]
NEW_TOKENS = 8
MAX_MODEL_LEN = 64
FRACTION = 0.25
CHILD_TIMEOUT_S = 300.0

CHILD = r"""
import base64, importlib, json, os, pickle, sys, time, types
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from vllm import LLM, SamplingParams
missing = []
for name in ("ray", "requests"):
    try:
        importlib.import_module(name)
    except ImportError:
        missing.append(name)
        sys.modules[name] = types.ModuleType(name)
importlib.import_module("vllm.distributed.weight_transfer.ipc_engine")
for name in missing:
    del sys.modules[name]
args = json.loads(sys.argv[1])
attention = {"backend": args["attention_backend"]} if args["attention_backend"] else None
llm = LLM(model=args["model"], enforce_eager=True, gpu_memory_utilization=args["fraction"], seed=0,
          max_model_len=args["max_model_len"], max_num_seqs=1, load_format="safetensors",
          attention_config=attention, weight_transfer_config={"backend": "ipc"})
params = SamplingParams(max_tokens=args["new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
def reply(**fields):
    print("VLLM_REPLY " + json.dumps(fields), flush=True)
def tokens():
    out = llm.generate([{"prompt_token_ids": args["prompt"]}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)
reply(ready=True, tokens=tokens(), stand_ins=missing)
for line in sys.stdin:
    msg = json.loads(line)
    if msg["op"] == "update":
        started = time.perf_counter()
        info = pickle.loads(base64.b64decode(msg["info"]))
        llm.start_weight_update()
        llm.update_weights({"update_info": info})
        llm.finish_weight_update()
        reply(update_s=time.perf_counter() - started)
    elif msg["op"] == "tokens":
        reply(tokens=tokens())
    else:
        break
os._exit(0)
"""


def vllm_available() -> str:
    """'' when vLLM can be imported (found on the path; the child imports it), else why not."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return "no vllm on the path (on the device: source .vllm/setup-vllm.sh)"
    return ""


def trainer_tensors(base: dict[str, torch.Tensor], version: int) -> dict[str, torch.Tensor]:
    """Version `version` of the weights: the checkpoint's plus seeded noise, on cuda:0."""
    gen = torch.Generator(device="cuda:0").manual_seed(7000 + version)
    return {
        name: (t + 0.02 * t.float().std() * torch.randn(t.shape, generator=gen, device="cuda:0")).to(t.dtype)
        for name, t in base.items()
    }


def ipc_update_info(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What vLLM's trainer helper sends, unpacked: a handle per tensor keyed by the GPU's UUID."""
    from torch.multiprocessing.reductions import reduce_tensor

    uuid = str(torch.cuda.get_device_properties(0).uuid)
    return {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "ipc_handles": [{uuid: reduce_tensor(t)[1]} for t in tensors.values()],
    }


class PlainVllm:
    """The child process serving the checkpoint with vLLM's own weight transfer engine."""

    def __init__(self, model: Path, attention_backend: str | None, log_path: Path, script: str = CHILD) -> None:
        payload = {
            "model": str(model),
            "fraction": FRACTION,
            "attention_backend": attention_backend,
            "max_model_len": MAX_MODEL_LEN,
            "new_tokens": NEW_TOKENS,
            "prompt": PROMPT,
        }
        self.log = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(payload)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        self.replies: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.ready = self._reply()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("VLLM_REPLY "):
                self.replies.put(line.removeprefix("VLLM_REPLY "))
        self.replies.put(None)  # the child's stdout closed: it ended

    def _reply(self) -> dict[str, Any]:
        try:
            line = self.replies.get(timeout=CHILD_TIMEOUT_S)
        except queue.Empty:
            line = None
        if line is None:
            raise RuntimeError(
                f"the plain vLLM child ended or said nothing for {CHILD_TIMEOUT_S:.0f} s (rc {self.proc.poll()}); "
                f"its log: {self.log.name}"
            )
        return json.loads(line)

    def ask(self, **msg: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):  # a child already gone closed the pipe
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def omni_core_rows(model: Path, base: dict[str, torch.Tensor], attention_backend: str | None) -> list[dict[str, Any]]:
    from omni_core.engine import Engine, StageSpec
    from omni_core.weights_sender import WeightSender

    runner_args: dict[str, Any] = {"model": str(model), "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 1}
    if attention_backend:
        runner_args["attention_backend"] = attention_backend
    spec = StageSpec(
        "rollout",
        runner="vllm",
        backend="fast",
        device="cuda",
        gpu_memory_fraction=FRACTION,
        runner_args=runner_args,
        deadline_s=300.0,
        start_deadline_s=600.0,
        request_timeout_s=300.0,
    )
    request = {"prompt_ids": PROMPT, "max_new_tokens": NEW_TOKENS, "stop_at_eos": False}
    rows = []
    with Engine([spec]) as engine, WeightSender() as sender:
        for version, case in ((1, "first (opens the handles)"), (2, "again (handles reused)")):
            tensors = trainer_tensors(base, version)
            torch.cuda.synchronize()  # the noise kernels are the trainer's step, not the share
            started = time.perf_counter()
            source = sender.share(tensors)
            share_s = time.perf_counter() - started
            started = time.perf_counter()
            report = engine.update_weights("rollout", source, version=version)
            wall_s = time.perf_counter() - started
            tokens = engine.execute("rollout", request)["token_ids"]
            rows.append(
                {
                    "method": "omni-core Engine.update_weights (ipc buckets)",
                    "case": case,
                    "version": version,
                    "share_s": share_s,
                    "update_wall_s": wall_s,
                    "own_s": report.ranks[0].duration_s,
                    "tokens": tokens,
                }
            )
            del tensors
    torch.cuda.empty_cache()
    return rows


def plain_vllm_rows(model: Path, base: dict[str, torch.Tensor], attention_backend: str | None, out: Path) -> list:
    child = PlainVllm(model, attention_backend, out / "weight_sync_plain_vllm.log")
    rows = []
    try:
        for version, case in ((1, "first"), (2, "again (new handles: vLLM opens them per update)")):
            tensors = trainer_tensors(base, version)
            torch.cuda.synchronize()
            started = time.perf_counter()
            info = base64.b64encode(pickle.dumps(ipc_update_info(tensors))).decode("ascii")
            share_s = time.perf_counter() - started
            started = time.perf_counter()
            answer = child.ask(op="update", info=info)
            wall_s = time.perf_counter() - started
            tokens = child.ask(op="tokens")["tokens"]
            rows.append(
                {
                    "method": "vLLM update_weights (IPC engine, in-process core)",
                    "case": case,
                    "version": version,
                    "share_s": share_s,
                    "update_wall_s": wall_s,
                    "own_s": answer["update_s"],
                    "tokens": tokens,
                    "stand_ins": child.ready.get("stand_ins", []),
                }
            )
            del tensors
    finally:
        child.close()
    return rows


def run_vllm_part(size: str, out: Path, log: Any) -> dict[str, Any]:
    """Both methods on the same checkpoint; rows, and whether their tokens agree per version."""
    why = vllm_available()
    if why:
        log(f"vllm part skipped: vLLM does not import here ({why})")
        return {"skipped": why}
    from safetensors.torch import load_file

    from omni_core.models import make_checkpoint

    attention_backend = os.environ.get("VLLM_BUNDLE_ATTN_BACKEND")
    root = Path(tempfile.mkdtemp(prefix="omni-ws-vllm-"))
    started = time.perf_counter()
    info = make_checkpoint("qwen2", size, root / f"qwen2-{size}", dtype="bfloat16")
    log(f"vllm part: qwen2 {size} made in {time.perf_counter() - started:.1f} s ({info.file_bytes / 1e9:.2f} GB)")
    model = Path(info.path)
    base = {name: t.to("cuda:0") for name, t in load_file(str(model / "model.safetensors")).items()}
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    rows: list[dict[str, Any]] = []
    methods = (
        ("omni-core", lambda: omni_core_rows(model, base, attention_backend)),
        ("vLLM", lambda: plain_vllm_rows(model, base, attention_backend, out)),
    )
    for name, method in methods:
        try:
            rows += method()
        except Exception as exc:  # reported, not hidden: the other method's rows stand
            log(f"vllm part, {name}: {type(exc).__name__}: {exc}")
            rows.append({"method": name, "error": f"{type(exc).__name__}: {exc}"})
    for row in rows:
        if "error" not in row:
            row["gbps_wall"] = nbytes / row["update_wall_s"] / 1e9
            log(
                f"vllm part: {row['method']}, {row['case']}: {row['update_wall_s'] * 1e3:.1f} ms "
                f"(own {row['own_s'] * 1e3:.1f} ms), tokens {row['tokens']}"
            )
    agree = tokens_agree(rows)
    return {"model": f"qwen2 {size}", "bytes": nbytes, "tensors": len(base), "rows": rows, "tokens_agree": agree}


def tokens_agree(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """Per version: True when both methods generated and their tokens are equal (False when
    they differ or a method has no tokens for it)."""
    by_version: dict[int, list[tuple[int, ...]]] = {}
    for row in rows:
        if "tokens" in row:
            by_version.setdefault(row["version"], []).append(tuple(row["tokens"]))
    return {str(v): len(tokens) == 2 and len(set(tokens)) == 1 for v, tokens in sorted(by_version.items())}


def render_vllm(part: dict[str, Any]) -> list[str]:
    if "skipped" in part:
        return ["", f"vLLM's own update path: not measured ({part['skipped']})."]
    lines = [
        "",
        f"## Against vLLM's own in-memory update path ({part['model']}, {part['bytes'] / 1e9:.2f} GB in "
        f"{part['tensors']} tensors, same GPU, CUDA IPC)",
        "",
        "| method | case | update (caller's wall) | own time | GB/s (wall) | sender's share | tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in part["rows"]:
        if "error" in r:
            lines.append(f"| {r['method']} | error: {r['error'][:160]} | | | | | |")
            continue
        lines.append(
            f"| {r['method']} | {r['case']} | {r['update_wall_s'] * 1e3:.1f} ms | {r['own_s'] * 1e3:.1f} ms | "
            f"{r['gbps_wall']:.0f} | {r['share_s'] * 1e3:.1f} ms | {r['tokens']} |"
        )
    lines += ["", f"Tokens equal across the two methods, per version: {part['tokens_agree']}."]
    return lines
