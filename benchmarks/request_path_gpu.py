"""`python -m benchmarks.request_path_gpu --out DIR`: a vllm stage against plain vLLM, on the GPU.

Side by side in one run on one device, the same model (a seeded Qwen2 0.5B, bf16, made by
`omni-core models make`), the same prompts, greedy, NEW_TOKENS tokens each (EOS ignored), the
same vLLM settings (eager, in-process engine core, Triton attention on the trimmed bundle):

- plain: `vllm.LLM.generate` over C prompts at once, C = 1, 8, 64, 256 (its own process: vLLM's
  allocator is one per process);
- engine: a `vllm` stage (one rank, `cumem`, batch_max_requests 256) through `Engine`: C
  requests submitted at once and awaited (waves, as plain's generate), and C kept in flight
  (a new request as each answer arrives: requests that arrive while a batch runs wait for it);
- http: the same waves through `omni-core serve`'s execute route, served in the Engine's
  process as `omni-core serve` does, the client (httpx, C connections) in a process of its own
  as a load generator is (in the server's process it took the GIL from the server: 0.64x at
  256 on an H100);
- cycle: a wave of 64, a sleep (level 1), wake and weight update, another wave: the time the
  cycle adds to the two waves against the cycle's own duration.

Each request's tokens are compared with plain vLLM's for the same prompt. Writes
request_path_gpu.json and request_path_gpu.md under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from benchmarks.control_plane import TARGETS_HEADER, _machine

CONCURRENCY = (1, 8, 64, 256)
NEW_TOKENS = 128
MAX_NUM_SEQS = 256
MAX_MODEL_LEN = 512
GPU_FRACTION = 0.35
TARGET_RATIO_AT_64 = 0.9  # the stage's tokens/s at 64 concurrent over plain vLLM's
HTTP_OVER_API_MAX = 1.2  # the Python API's tokens/s over HTTP's, at every concurrency
ATTENTION = os.environ.get("VLLM_BUNDLE_ATTN_BACKEND")


def _requests_at(concurrency: int) -> int:
    """Requests per level: enough waves that a level takes a few seconds and at least 256
    prompts are answered at the wide levels."""
    return {1: 2, 8: 16, 64: 128, 256: 256}[concurrency]


def prompt(i: int) -> list[int]:
    return [(31 * i + 7 * k) % 5000 + 100 for k in range(16 + i % 24)]


def payload(i: int) -> dict[str, Any]:
    return {"prompt_ids": [prompt(i)], "max_new_tokens": NEW_TOKENS, "stop_at_eos": False}


def _waves(total: int, concurrency: int) -> list[range]:
    return [range(start, min(start + concurrency, total)) for start in range(0, total, concurrency)]


# ---------------------------------------------------------------- plain vLLM (its own process)


def run_plain(model: str, out_json: str) -> None:
    """Plain vLLM: one `LLM`, then `generate` over each wave of each level."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the stage's rank runs the engine core in-process too
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": "bfloat16",
        "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": MAX_NUM_SEQS,
        "enforce_eager": True,
        "gpu_memory_utilization": GPU_FRACTION,
        "seed": 0,
        "load_format": "safetensors",
    }
    if ATTENTION:
        kwargs["attention_config"] = {"backend": ATTENTION}
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def generate(ids: range) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": prompt(i)} for i in ids], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    generate(range(8))  # warm-up
    rows, tokens = [], {}
    for concurrency in CONCURRENCY:
        total = _requests_at(concurrency)
        started = time.perf_counter()
        for wave in _waves(total, concurrency):
            for i, ids in zip(wave, generate(wave), strict=True):
                tokens[i] = ids
        rows.append(_row("plain vLLM generate", concurrency, total, time.perf_counter() - started))
        print("ROW", json.dumps(rows[-1]), flush=True)
    Path(out_json).write_text(json.dumps({"rows": rows, "tokens": {str(k): v for k, v in tokens.items()}}))


def _row(path: str, concurrency: int, total: int, seconds: float) -> dict[str, Any]:
    return {
        "path": path,
        "concurrency": concurrency,
        "requests": total,
        "seconds": round(seconds, 3),
        "requests_per_s": round(total / seconds, 2),
        "tokens_per_s": round(total * NEW_TOKENS / seconds, 1),
    }


# ---------------------------------------------------------------- the stage


def _spec(model: str) -> Any:
    from omni_core.engine import StageSpec

    return StageSpec(
        "llm",
        runner="vllm",
        backend="cumem",
        device="cuda",
        gpu_memory_fraction=GPU_FRACTION,
        runner_args={
            "model": model,
            "dtype": "bfloat16",
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "attention_backend": ATTENTION,
        },
        max_in_flight=1024,
        batch_max_requests=MAX_NUM_SEQS,
        deadline_s=300.0,
        start_deadline_s=600.0,
        request_timeout_s=600.0,
    )


def _engine_waves(engine: Any, total: int, concurrency: int, tokens: dict[int, list[int]]) -> float:
    started = time.perf_counter()
    for wave in _waves(total, concurrency):
        futures = [(i, engine.submit("llm", payload(i))) for i in wave]
        for i, future in futures:
            tokens[i] = future.result(timeout=600)["token_ids"][0]
    return time.perf_counter() - started


def _engine_in_flight(engine: Any, total: int, concurrency: int) -> float:
    started = time.perf_counter()
    pending: list[Future] = []
    sent = 0
    while sent < total or pending:
        while sent < total and len(pending) < concurrency:
            pending.append(engine.submit("llm", payload(sent)))
            sent += 1
        pending.pop(0).result(timeout=600)
    return time.perf_counter() - started


async def _http_waves(url: str, total: int, concurrency: int, tokens: dict[int, list[int]]) -> float:
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600.0, limits=limits) as client:

        async def one(i: int) -> None:
            answer = await client.post("/v1/stages/llm/execute", json={"payload": payload(i)})
            answer.raise_for_status()
            tokens[i] = answer.json()["output"]["token_ids"][0]

        started = time.perf_counter()
        for wave in _waves(total, concurrency):
            await asyncio.gather(*(one(i) for i in wave))
        return time.perf_counter() - started


def _http_client_child(url: str, total: int, concurrency: int, tokens: dict[int, list[int]]) -> float:
    """`_http_waves` in a process of its own; its seconds, and each request's tokens into `tokens`."""
    with tempfile.TemporaryDirectory() as tmp:
        answer = Path(tmp) / "http.json"
        child = [sys.executable, "-m", "benchmarks.request_path_gpu", "--http-client", url, str(total)]
        subprocess.run([*child, str(concurrency), str(answer)], check=True)
        data = json.loads(answer.read_text())
    tokens.update({int(i): ids for i, ids in data["tokens"].items()})
    return float(data["seconds"])


def run_http_client(url: str, total: int, concurrency: int, out_json: str) -> None:
    tokens: dict[int, list[int]] = {}
    seconds = asyncio.run(_http_waves(url, total, concurrency, tokens))
    Path(out_json).write_text(json.dumps({"seconds": seconds, "tokens": tokens}))


def _cycle(engine: Any, model: str) -> dict[str, Any]:
    """Two waves of 64 with a sleep, wake and update between them, against the same two waves
    back to back: what the cycle adds beyond its own duration."""
    scratch: dict[int, list[int]] = {}
    plain_s = _engine_waves(engine, 128, 64, scratch)
    first_s = _engine_waves(engine, 64, 64, scratch)
    started = time.perf_counter()
    engine.sleep("llm", level=1)
    engine.wake("llm")
    engine.update_weights("llm", model, version=1)
    cycle_s = time.perf_counter() - started
    second_s = _engine_waves(engine, 64, 64, scratch)
    added_s = first_s + cycle_s + second_s - plain_s
    return {
        "two_waves_s": round(plain_s, 3),
        "with_cycle_s": round(first_s + cycle_s + second_s, 3),
        "cycle_s": round(cycle_s, 3),
        "added_beyond_cycle_s": round(added_s - cycle_s, 3),
        "version_after": engine.status()["llm"]["weights_version"],
    }


def run_stage(model: str) -> tuple[list[dict[str, Any]], dict[str, dict[int, list[int]]], dict[str, Any]]:
    from omni_core.config import OmniConfig
    from omni_core.engine import Engine
    from omni_core.serve import create_app, serve_in_thread

    rows: list[dict[str, Any]] = []
    tokens: dict[str, dict[int, list[int]]] = {"engine": {}, "http": {}}
    spec = _spec(model)
    with Engine([spec]) as engine:
        _engine_waves(engine, 8, 8, {})  # warm-up
        for concurrency in CONCURRENCY:
            total = _requests_at(concurrency)
            seconds = _engine_waves(engine, total, concurrency, tokens["engine"])
            rows.append(_row("Engine, waves", concurrency, total, seconds))
            rows.append(
                _row("Engine, kept in flight", concurrency, total, _engine_in_flight(engine, total, concurrency))
            )
            print("ROW", json.dumps(rows[-2:]), flush=True)
        app = create_app(engine, OmniConfig(stages=(spec,)))
        with serve_in_thread(app) as running:
            _http_client_child(running.url, 8, 8, {})
            for concurrency in CONCURRENCY:
                total = _requests_at(concurrency)
                seconds = _http_client_child(running.url, total, concurrency, tokens["http"])
                rows.append(_row("HTTP execute, waves", concurrency, total, seconds))
                print("ROW", json.dumps(rows[-1]), flush=True)
        cycle = _cycle(engine, model)
    return rows, tokens, cycle


# ---------------------------------------------------------------- report


def _matches(plain: dict[str, list[int]], mine: dict[int, list[int]]) -> dict[str, int]:
    same = sum(1 for i, ids in mine.items() if plain.get(str(i)) == ids)
    return {"compared": len(mine), "equal_to_plain": same}


def _ratio_at(rows: list[dict[str, Any]], path: str, concurrency: int) -> float:
    mine = next(r for r in rows if r["path"] == path and r["concurrency"] == concurrency)
    plain = next(r for r in rows if r["path"] == "plain vLLM generate" and r["concurrency"] == concurrency)
    return float(mine["tokens_per_s"]) / float(plain["tokens_per_s"])


def render_markdown(data: dict[str, Any]) -> str:
    machine = data["machine"]
    lines = [
        "# The request path on the GPU: a vllm stage against plain vLLM",
        "",
        f"machine: {data['device']}, {machine['cpus']} CPUs, Python {machine['python']}; commit "
        f"`{machine['commit']}`; command `{data['command']}`",
        "",
        f"Qwen2 0.5B (seeded, bf16, `omni-core models make qwen2 0.5b`), greedy, {NEW_TOKENS} new tokens per "
        f"request (EOS ignored), prompts of 16-39 tokens; vLLM {data['vllm']}, eager, in-process engine "
        f"core, max_num_seqs {MAX_NUM_SEQS}, gpu fraction {GPU_FRACTION}; the stage: one rank, `cumem`, "
        f"batch_max_requests {MAX_NUM_SEQS}.",
        "",
        "| path | concurrent | requests | seconds | requests/s | tokens/s | x plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in data["rows"]:
        ratio = _ratio_at(data["rows"], row["path"], row["concurrency"])
        lines.append(
            f"| {row['path']} | {row['concurrency']} | {row['requests']} | {row['seconds']} | "
            f"{row['requests_per_s']} | {row['tokens_per_s']} | {ratio:.3f} |"
        )
    cycle = data["cycle"]
    lines += [
        "",
        f"Tokens equal to plain vLLM's for the same prompt: Engine {data['equal']['engine']['equal_to_plain']} "
        f"of {data['equal']['engine']['compared']}, HTTP {data['equal']['http']['equal_to_plain']} of "
        f"{data['equal']['http']['compared']}.",
        "",
        f"Cycle between waves of 64: two waves back to back {cycle['two_waves_s']} s; with a sleep (level 1), "
        f"wake and update between them {cycle['with_cycle_s']} s, the cycle itself {cycle['cycle_s']} s, so "
        f"the cycle added {cycle['added_beyond_cycle_s']} s beyond its own duration (version after: "
        f"{cycle['version_after']}).",
    ]
    return "\n".join(lines + _targets(data)) + "\n"


def _verdict(ratio: float, why: str = "") -> str:
    if ratio >= TARGET_RATIO_AT_64:
        return "met"
    return f"missed by {TARGET_RATIO_AT_64 - ratio:.3f}" + (f": {why}" if why else "")


KEPT_WHY = "a request that arrives while a batch runs waits for the whole batch (no add_request/step loop yet)"


def _targets(data: dict[str, Any]) -> list[str]:
    rows, cycle = data["rows"], data["cycle"]
    waves, kept, http = (
        _ratio_at(rows, p, 64) for p in ("Engine, waves", "Engine, kept in flight", "HTTP execute, waves")
    )
    added, own = cycle["added_beyond_cycle_s"], cycle["cycle_s"]
    cycle_met = "met" if added <= 0.05 * own + 0.5 else "missed"
    return TARGETS_HEADER + [
        f"| tokens/s at 64 concurrent >= {TARGET_RATIO_AT_64}x plain vLLM (Engine, waves) "
        f"| {waves:.3f}x | {_verdict(waves)} |",
        f"| the same, kept in flight (answers as they come) | {kept:.3f}x | {_verdict(kept, KEPT_WHY)} |",
        f"| the same through HTTP | {http:.3f}x | {_verdict(http)} |",
        f"| a sleep/wake/update cycle between batches adds no more than its own duration "
        f"| {added:+.3f} s beyond the cycle's {own} s | {cycle_met} |",
        *(_http_row(rows, c) for c in CONCURRENCY),
    ]


def _http_row(rows: list[dict[str, Any]], concurrency: int) -> str:
    """HTTP within HTTP_OVER_API_MAX of the Python API (Engine, waves) at `concurrency`."""
    api, http = (
        next(float(r["tokens_per_s"]) for r in rows if r["path"] == p and r["concurrency"] == concurrency)
        for p in ("Engine, waves", "HTTP execute, waves")
    )
    slower = api / http
    met = "met" if slower <= HTTP_OVER_API_MAX else f"missed by {slower / HTTP_OVER_API_MAX - 1:.0%}"
    return f"| HTTP within {HTTP_OVER_API_MAX}x of the Python API at {concurrency} concurrent | {slower:.3f}x | {met} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.request_path_gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="directory for request_path_gpu.json and .md")
    parser.add_argument("--plain", nargs=2, metavar=("MODEL", "JSON"), help=argparse.SUPPRESS)  # the child
    parser.add_argument("--http-client", nargs=4, metavar=("URL", "TOTAL", "C", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.http_client:
        url, total, concurrency, out_json = args.http_client
        run_http_client(url, int(total), int(concurrency), out_json)
        return 0
    if args.plain:
        run_plain(*args.plain)
        return 0
    import torch
    import vllm

    from omni_core.models import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_checkpoint("qwen2", "0.5b", Path(tmp) / "qwen2", seed=0, dtype="bfloat16").path)
        plain_json = Path(tmp) / "plain.json"
        subprocess.run(
            [sys.executable, "-m", "benchmarks.request_path_gpu", "--plain", model, str(plain_json)], check=True
        )
        plain = json.loads(plain_json.read_text())
        rows, tokens, cycle = run_stage(model)
    data = {
        "machine": _machine(),
        "device": torch.cuda.get_device_name(0),
        "vllm": vllm.__version__,
        "command": "python -m benchmarks.request_path_gpu " + " ".join(argv or sys.argv[1:]),
        "rows": plain["rows"] + rows,
        "cycle": cycle,
        "equal": {path: _matches(plain["tokens"], mine) for path, mine in tokens.items()},
    }
    text = render_markdown(data)
    print(text, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "request_path_gpu.json").write_text(json.dumps(data, indent=2) + "\n")
        (out / "request_path_gpu.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
