"""`python -m benchmarks.vllm_stage`: a real vLLM under omni-core, on the lent GPU.

Three parts, each its own processes (vLLM's allocator is one per process):

- `stage`: a `vllm` stage (one rank) on each backend (`cumem`, `fast`): greedy tokens taken
  once, then after two level-1 cycles, level 2 + reload from the checkpoint on disk, a
  partial wake (weights only: requests refused; then the KV cache), a weight update from
  another checkpoint (tokens must change) and back (tokens must return), and a reload of a
  checkpoint of another shape (refused, tokens unchanged). Per-rank NVML figures and GB/s.
- `concurrent`: two `vllm` stages started together on one GPU under `gpu_memory_fraction`;
  each KV cache is sized from its own process's use (both get what their fraction allows).
- `plain`: a plain `vllm.LLM` (engine core in its child process, as a vLLM user runs it) with
  the `omni_fast` plugin found through its entry point and selected by environment, beside
  vLLM's stock `cumem` backend on the same model: sleep/wake times, identical tokens.

Writes vllm_stage.json and vllm_stage.md under --out. Models are made with `omni-core models
make` (seeded random weights) under --models.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from omni_core.engine import Engine, RequestRejectedError, StageSpec

REQUEST = {"prompt_ids": [[17, 42, 101, 7, 300, 5], [250, 33, 98, 411]], "max_new_tokens": 24, "stop_at_eos": False}
BACKENDS = ("cumem", "fast")
# Steps that move the weights pool's bytes over the host link (GB/s are computed for these).
COPYING_STEPS = ("sleep L1 #", "wake L1 #", "wake weights", "reload")


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def make_models(models: Path, size: str) -> dict[str, Path]:
    from omni_core.models.make import make_checkpoint

    wanted = {"main": ("qwen2", size, 0), "update": ("qwen2", size, 1), "other_shape": ("qwen2", "tiny", 0)}
    paths = {}
    for key, (family, sz, seed) in wanted.items():
        path = models / f"{family}-{sz}-seed{seed}"
        if not (path / "config.json").is_file():
            started = time.perf_counter()
            make_checkpoint(family, sz, path, seed=seed, dtype="bfloat16")
            print(f"made {path} in {time.perf_counter() - started:.1f} s", flush=True)
        paths[key] = path
    return paths


class Checks:
    def __init__(self, part: str) -> None:
        self.part, self.rows = part, []

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        self.rows.append({"what": what, "ok": bool(ok), "detail": detail})
        print(f"  [{self.part}] {'ok  ' if ok else 'MISS'} {what} {detail}".rstrip(), flush=True)
        return ok


def _runner_args(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "model": str(model),
        "max_model_len": args.max_model_len,
        "max_num_seqs": 4,
        "attention_backend": args.attention_backend,
    }


def stage_part(backend: str, models: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    checks, lifecycle = Checks(f"stage/{backend}"), []
    result: dict[str, Any] = {"backend": backend}
    spec = StageSpec(
        "llm",
        runner="vllm",
        backend=backend,
        device="cuda",
        gpu_memory_fraction=args.fraction,
        runner_args=_runner_args(models["main"], args),
        deadline_s=300.0,
        start_deadline_s=600.0,
        request_timeout_s=300.0,
        admission="reject",
    )
    started = time.perf_counter()
    try:
        with Engine([spec]) as engine:
            result["start_s"] = round(time.perf_counter() - started, 1)
            reference = engine.execute("llm", REQUEST)["token_ids"]
            result["reference_sha"] = _sha(reference)

            def same(what: str) -> bool:
                got = engine.execute("llm", REQUEST)["token_ids"]
                return checks.check(f"tokens {what}", got == reference, f"sha {_sha(got)}")

            def call(what: str, fn: Any, expect: str) -> Any:
                report = fn()
                checks.check(f"{what} -> {expect}", report.state == expect, f"(got {report.state})")
                rank = report.ranks[0]
                weights = max(rank.pool_bytes_before.get("weights", 0), rank.pool_bytes_after.get("weights", 0))
                lifecycle.append(
                    {
                        "what": what,
                        "state": report.state,
                        "stage_s": round(report.duration_s, 4),
                        "rank_s": round(rank.duration_s, 4),
                        "pool_before": rank.pool_bytes_before,
                        "pool_after": rank.pool_bytes_after,
                        "process_before": rank.process_bytes_before,
                        "process_after": rank.process_bytes_after,
                        "source": rank.process_bytes_source,
                        "weights_GBps": round(weights / rank.duration_s / 1e9, 1)
                        if rank.duration_s > 0 and what.startswith(COPYING_STEPS)
                        else None,
                    }
                )
                return report

            for cycle in (1, 2):
                call(f"sleep L1 #{cycle}", lambda: engine.sleep("llm", level=1), "SLEEPING")
                call(f"wake L1 #{cycle}", lambda: engine.wake("llm"), "RUNNING")
                same(f"after L1 cycle {cycle}")
            call("sleep L2", lambda: engine.sleep("llm", level=2), "SLEEPING")
            call("wake L2", lambda: engine.wake("llm"), "NEEDS_RELOAD")
            call("reload (own checkpoint)", lambda: engine.reload_weights("llm"), "RUNNING")
            same("after L2 + reload")
            call("sleep L1 (partial)", lambda: engine.sleep("llm", level=1), "SLEEPING")
            call("wake weights", lambda: engine.wake("llm", tags=["weights"]), "PARTIAL")
            try:
                engine.execute("llm", REQUEST, timeout_s=30.0)
                checks.check("PARTIAL refuses a request", False, "(served)")
            except RequestRejectedError as exc:
                checks.check("PARTIAL refuses a request", "PARTIAL" in str(exc), str(exc)[:120])
            call("wake kv_cache", lambda: engine.wake("llm", tags=["kv_cache"]), "RUNNING")
            same("after partial wake")
            # A weight update (RL): level 2, wake, reload from another checkpoint; then back.
            for label, source in (("update checkpoint", models["update"]), ("own checkpoint again", models["main"])):
                call(f"sleep L2 ({label})", lambda: engine.sleep("llm", level=2), "SLEEPING")
                call(f"wake L2 ({label})", lambda: engine.wake("llm"), "NEEDS_RELOAD")
                call(f"reload ({label})", lambda s=source: engine.reload_weights("llm", str(s)), "RUNNING")
                if source == models["update"]:
                    updated = engine.execute("llm", REQUEST)["token_ids"]
                    checks.check("tokens change after a weight update", updated != reference, f"sha {_sha(updated)}")
            same("after reloading the own checkpoint")
            call("sleep L2 (bad source)", lambda: engine.sleep("llm", level=2), "SLEEPING")
            call("wake L2 (bad source)", lambda: engine.wake("llm"), "NEEDS_RELOAD")
            try:
                engine.reload_weights("llm", str(models["other_shape"]))
                checks.check("reload of another shape refused", False, "(accepted)")
            except Exception as exc:  # the stage's refusal names the first mismatching tensor
                checks.check("reload of another shape refused", "tensor" in str(exc), str(exc)[:240])
            call("reload after the refusal", lambda: engine.reload_weights("llm"), "RUNNING")
            same("after the refused reload")
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], flush=True)
    result.update(checks=checks.rows, lifecycle=lifecycle, wall_s=round(time.perf_counter() - started, 1))
    result["ok"] = "error" not in result and all(c["ok"] for c in checks.rows)
    return result


def concurrent_part(models: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    checks = Checks("concurrent")
    result: dict[str, Any] = {"fraction": args.concurrent_fraction}
    specs = [
        StageSpec(
            name,
            runner="vllm",
            backend="cumem",
            device="cuda",
            gpu_memory_fraction=args.concurrent_fraction,
            runner_args=_runner_args(models["main"], args),
            deadline_s=300.0,
            start_deadline_s=600.0,
            request_timeout_s=300.0,
        )
        for name in ("a", "b")
    ]
    started = time.perf_counter()
    try:
        with Engine(specs) as engine:
            result["start_both_s"] = round(time.perf_counter() - started, 1)
            total = _device_total_bytes()
            result["device_total_bytes"] = total
            for name in ("a", "b"):
                out = engine.execute(name, REQUEST)["token_ids"]
                report = engine.sleep(name, level=1)
                rank = report.ranks[0]
                kv_bytes = rank.pool_bytes_before.get("kv_cache", 0)
                budget = int(total * args.concurrent_fraction) if total else None
                result[name] = {
                    "kv_cache_bytes": kv_bytes,
                    "process_bytes": rank.process_bytes_before,
                    "source": rank.process_bytes_source,
                    "budget_bytes": budget,
                    "tokens_sha": _sha(out),
                }
                engine.wake(name)
                if budget is not None and rank.process_bytes_before is not None:
                    checks.check(
                        f"stage {name} holds at most its fraction",
                        rank.process_bytes_before <= budget,
                        f"({rank.process_bytes_before / 2**30:.2f} of {budget / 2**30:.2f} GiB)",
                    )
                    checks.check(
                        f"stage {name}'s KV cache uses its fraction (>= 80 % of what is left)",
                        kv_bytes >= 0.8 * (budget - (rank.process_bytes_before - kv_bytes)) - (1 << 30),
                        f"(KV {kv_bytes / 2**30:.2f} GiB)",
                    )
            a, b = result["a"]["kv_cache_bytes"], result["b"]["kv_cache_bytes"]
            checks.check(
                "both stages got the same KV size (within 5 %)",
                abs(a - b) <= 0.05 * max(a, b),
                f"({a / 2**30:.2f} and {b / 2**30:.2f} GiB)",
            )
            checks.check("both stages generate the same tokens", result["a"]["tokens_sha"] == result["b"]["tokens_sha"])
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        print(result["traceback"], flush=True)
    result.update(checks=checks.rows, wall_s=round(time.perf_counter() - started, 1))
    result["ok"] = "error" not in result and all(c["ok"] for c in checks.rows)
    return result


def _device_total_bytes() -> int | None:
    try:
        from omni_core.workers.accounting import PynvmlApi, parse_cuda_visible_devices, resolve_physical_device

        api = PynvmlApi()
        device = resolve_physical_device(parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")), 0, api)
        return int(api.total_bytes(device.handle))
    except Exception:
        return None


PLAIN_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
args = json.loads(sys.argv[1])
out = {"backend": args["backend"]}
llm = LLM(model=args["model"], enforce_eager=True, enable_sleep_mode=True, gpu_memory_utilization=args["util"],
          max_model_len=args["max_model_len"], load_format="safetensors", seed=0,
          attention_config={"backend": args["attention_backend"]} if args["attention_backend"] else None)
prompts = [{"prompt_token_ids": p} for p in args["prompts"]]
params = SamplingParams(max_tokens=args["max_tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
def tokens():
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
reference = tokens()
rows = []
for what, level in (("L1 #1", 1), ("L1 #2", 1), ("L1 #3", 1), ("L2", 2)):
    t0 = time.perf_counter(); llm.sleep(level=level); slept = time.perf_counter() - t0
    t0 = time.perf_counter(); llm.wake_up(); woke = time.perf_counter() - t0
    reload_s = None
    if level == 2:
        t0 = time.perf_counter(); llm.collective_rpc("reload_weights"); reload_s = time.perf_counter() - t0
    rows.append({"what": what, "sleep_s": round(slept, 4), "wake_s": round(woke, 4),
                 "reload_s": None if reload_s is None else round(reload_s, 3), "same_tokens": tokens() == reference})
out["rows"] = rows
print("PLAIN_RESULT " + json.dumps(out), flush=True)
"""


def plain_part(models: dict[str, Path], args: argparse.Namespace) -> dict[str, Any]:
    checks = Checks("plain")
    runs = []
    for backend in ("cumem", "omni_fast"):
        env = dict(os.environ)
        env.pop("OMNI_CORE_VLLM_SLEEP_BACKEND", None)
        env["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM names the sleep-mode backend it created at INFO
        if backend == "omni_fast":
            env["OMNI_CORE_VLLM_SLEEP_BACKEND"] = "omni_fast"
        payload = {
            "backend": backend,
            "model": str(models["main"]),
            "util": args.fraction,
            "max_model_len": args.max_model_len,
            "attention_backend": args.attention_backend,
            "prompts": REQUEST["prompt_ids"],
            "max_tokens": REQUEST["max_new_tokens"],
        }
        started = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-c", PLAIN_SCRIPT, json.dumps(payload)],
            env=env,
            text=True,
            capture_output=True,
            timeout=420,
        )
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PLAIN_RESULT ")), None)
        run: dict[str, Any] = json.loads(line[len("PLAIN_RESULT ") :]) if line else {"backend": backend}
        run["wall_s"] = round(time.perf_counter() - started, 1)
        run["rc"] = proc.returncode
        chosen = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "sleep-mode backend" in ln]
        run["selected_log"] = chosen[-1][-200:] if chosen else None
        if line is None:
            run["error_tail"] = (proc.stdout + proc.stderr)[-3000:]
            print(run["error_tail"], flush=True)
        runs.append(run)
        checks.check(f"{backend}: ran", line is not None and proc.returncode == 0)
        for row in run.get("rows", []):
            checks.check(f"{backend}: tokens identical after {row['what']}", row["same_tokens"])
        if backend == "omni_fast":
            checks.check(
                "omni_fast was the backend vLLM used",
                bool(run["selected_log"]) and "omni_fast" in run["selected_log"],
                str(run["selected_log"]),
            )
    return {"runs": runs, "checks": checks.rows, "ok": all(c["ok"] for c in checks.rows)}


def render(data: dict[str, Any]) -> str:
    lines = [
        f"# vLLM under omni-core ({data['device']})",
        "",
        f"command: `{data['command']}`",
        "",
        f"commit {data['commit']}, {data['versions']}",
        "",
    ]
    for run in data.get("stage", []):
        lines += [
            f"## `vllm` stage, backend {run['backend']} (start {run.get('start_s')} s)",
            "",
            "| step | state | rank s | weights GB/s | process GiB before -> after |",
            "|---|---|---|---|---|",
        ]
        for row in run["lifecycle"]:
            pb, pa = row["process_before"], row["process_after"]
            mem = f"{pb / 2**30:.2f} -> {pa / 2**30:.2f}" if pb is not None and pa is not None else "-"
            lines.append(f"| {row['what']} | {row['state']} | {row['rank_s']} | {row['weights_GBps'] or ''} | {mem} |")
        lines += ["", "checks: " + ", ".join(("ok " if c["ok"] else "MISS ") + c["what"] for c in run["checks"]), ""]
        if "error" in run:
            lines += [f"error: `{run['error']}`", ""]
    conc = data.get("concurrent")
    if conc:
        lines += [
            "## Two `vllm` stages started together on one GPU",
            "",
            "```",
            json.dumps(
                {k: conc.get(k) for k in ("fraction", "start_both_s", "device_total_bytes", "a", "b", "error")},
                indent=1,
            ),
            "```",
            "",
        ]
    plain = data.get("plain")
    if plain:
        lines += [
            "## Plain `vllm.LLM`: stock cumem vs the omni_fast plugin",
            "",
            "| backend | step | sleep s | wake s | reload s | same tokens |",
            "|---|---|---|---|---|---|",
        ]
        for run in plain["runs"]:
            for row in run.get("rows", []):
                lines.append(
                    f"| {run['backend']} | {row['what']} | {row['sleep_s']} | {row['wake_s']} | "
                    f"{row['reload_s'] or ''} | {row['same_tokens']} |"
                )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", type=Path, default=Path("/tmp/omni-models"))
    parser.add_argument("--size", default="1.5b")
    parser.add_argument("--parts", default="stage,concurrent,plain")
    parser.add_argument("--fraction", type=float, default=0.35)
    parser.add_argument("--concurrent-fraction", type=float, default=0.4)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--attention-backend", default=os.environ.get("VLLM_BUNDLE_ATTN_BACKEND"))
    parser.add_argument("--commit", default="?")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    data: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "commit": args.commit,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA",
    }
    try:
        import vllm

        data["versions"] = f"vllm {vllm.__version__}, torch {torch.__version__}"
    except Exception as exc:
        data["versions"] = f"vllm unavailable ({exc})"
    models = make_models(args.models, args.size)
    parts = args.parts.split(",")
    runs = {
        "stage": lambda: [stage_part(b, models, args) for b in BACKENDS],
        "concurrent": lambda: concurrent_part(models, args),
        "plain": lambda: plain_part(models, args),
    }
    for part in parts:
        data[part] = runs[part]()
        # Written after every part: a run cut short by its time limit keeps what it measured.
        (args.out / "vllm_stage.json").write_text(json.dumps(data, indent=1, default=str))
        (args.out / "vllm_stage.md").write_text(render(data))
    ok = (
        all(r["ok"] for r in data.get("stage", []))
        and data.get("concurrent", {"ok": True})["ok"]
        and data.get("plain", {"ok": True})["ok"]
    )
    print("VLLM_STAGE_OK" if ok else "VLLM_STAGE_MISS", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
