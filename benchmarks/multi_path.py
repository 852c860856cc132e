"""`python -m benchmarks --multi-path`: a stage's sleep and wake over k host links, through
`Engine`, with a peer stage serving requests on a lending GPU.

For k = 1..N (N = GPUs seen): an Engine with stage `big` (a synthetic runner whose weights
execution writes, so every level-1 sleep copies: `DirtySyntheticRunner`; `--gib` of bf16
weights in 8B-like tensor counts) on GPU 0 that sees GPUs 0..k-1 (its link plan lends it
the others), and stage `peer` on GPU 1 serving a stream of requests. Each cycle: sleep
(level 1), wake, one request compared with the reference output (sha256). Figures are the
ranks' own command times over the weights bytes; the peer's request rate alone and during
the copies. Writes multi_path.json and multi_path.md (ending with ## Targets) to --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from omni_core.engine import Engine, StageSpec
from omni_core.provenance import git_commit, git_dirty
from omni_core.runners.synthetic import SyntheticRunner

GiB = 1 << 30
TENSORS_PER_16_GIB = 291  # Llama-8B's tensor count for 16 GB of bf16
# The peer's requests are GPU-bound: ~18 TFLOP each against a 4 MB output (an 8 MB output
# with a tenth of the work made the first run's peer host-bound: its rate fell with the
# host's memory traffic, not with the lent link).
PEER_REQUEST = {"seed": 3, "batch": 256}


class DirtySyntheticRunner(SyntheticRunner):
    """The synthetic runner, declared to write its weights (a trainer's, an RL rollout's after
    an update): the fast backend keeps no clean host copy, so every level-1 sleep copies."""

    execute_writes_weights = True


def _big(gib: float, gpus: int) -> StageSpec:
    devices = ",".join(str(i) for i in range(gpus))
    count = max(8, round(TENSORS_PER_16_GIB * gib / 16))
    args = {
        "weights_bytes": int(gib * GiB),
        "tensor_count": count,
        "hidden": 4096,
        "dtype": "bfloat16",
        "kv_bytes": GiB,
        "seed": 11,
    }
    return StageSpec(
        "big",
        runner="benchmarks.multi_path:DirtySyntheticRunner",
        runner_args=args,
        device="cuda",
        devices=(devices,),
        backend="fast",
        deadline_s=300.0,
        start_deadline_s=600.0,
    )


def _peer() -> StageSpec:
    args = {
        "weights_bytes": 32 * GiB,
        "tensor_count": 64,
        "hidden": 8192,
        "dtype": "bfloat16",
        "kv_bytes": GiB,
        "seed": 5,
    }
    return StageSpec(
        "peer",
        runner="synthetic",
        runner_args=args,
        device="cuda",
        devices=("1",),
        backend="fast",
        start_deadline_s=600.0,
        request_timeout_s=300.0,
    )


class PeerLoad:
    """Requests to the peer stage, back to back, each one's end time kept."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.ends, self.stop = engine, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.engine.execute("peer", PEER_REQUEST)
            self.ends.append(time.monotonic())

    def rate(self, start: float, end: float) -> float:
        return sum(1 for t in self.ends if start <= t < end) / (end - start)


def _moved(report: Any) -> tuple[int, float]:
    rank = report.ranks[0]
    return abs(rank.pool_bytes_before["weights"] - rank.pool_bytes_after["weights"]), rank.duration_s


def run_links(k: int, gib: float, cycles: int, log: Any) -> dict[str, Any]:
    specs = [_big(gib, k)] + ([_peer()] if torch.cuda.device_count() > 1 else [])
    with Engine(specs) as engine:
        status = engine.status()
        reference = engine.execute("big", {"seed": 1, "batch": 4})["sha256"]
        load = PeerLoad(engine) if "peer" in status else None
        if load is not None:
            load.thread.start()
            time.sleep(3.0)  # the peer's rate alone
        alone_end = time.monotonic()
        runs = []
        for cycle in range(cycles):
            started = time.monotonic()
            sleep = engine.sleep("big", level=1)
            wake = engine.wake("big")
            ended = time.monotonic()
            exact = engine.execute("big", {"seed": 1, "batch": 4})["sha256"] == reference
            (sleep_bytes, sleep_s), (wake_bytes, wake_s) = _moved(sleep), _moved(wake)
            runs.append(
                {
                    "cycle": cycle,
                    "sleep_gbps": sleep_bytes / sleep_s / 1e9,
                    "wake_gbps": wake_bytes / wake_s / 1e9,
                    "bytes": sleep_bytes,
                    "exact": exact,
                    "window": (started, ended),
                }
            )
            log(
                f"k={k} cycle {cycle}: sleep {runs[-1]['sleep_gbps']:.1f} GB/s, wake {runs[-1]['wake_gbps']:.1f} GB/s, "
                f"exact {exact}"
            )
        peer = {}
        if load is not None:
            load.stop.set()
            load.thread.join(120)
            first = load.ends[0] if load.ends else alone_end
            copying = [r["window"] for r in runs]
            during = sum(load.rate(a, b) * (b - a) for a, b in copying) / sum(b - a for a, b in copying)
            peer = {"alone_rps": load.rate(first, alone_end), "during_rps": during}
        for r in runs:
            del r["window"]
        return {"links": k, "runs": runs, "peer": peer, "backend": status["big"]["ranks"][0]["backend"]}


def render(results: dict[str, Any]) -> str:
    lines = ["# Multi-path sleep and wake through `Engine` (issue 28)", "", "| | |", "|---|---|"]
    for key in ("machine", "commit", "command"):
        lines.append(f"| {key} | {results[key]} |")
    lines += [
        "",
        "| links | first sleep GB/s | later sleeps GB/s | wakes GB/s | bit-exact | peer req/s alone | "
        "peer req/s during copies |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in results["cases"]:
        runs = case["runs"]
        later = [r["sleep_gbps"] for r in runs[1:]] or [runs[0]["sleep_gbps"]]
        wakes = [r["wake_gbps"] for r in runs]
        peer = case["peer"]
        lines.append(
            f"| {case['links']} | {runs[0]['sleep_gbps']:.1f} | {min(later):.1f}-{max(later):.1f} | "
            f"{min(wakes):.1f}-{max(wakes):.1f} | {all(r['exact'] for r in runs)} | "
            f"{peer.get('alone_rps', 0):.1f} | {peer.get('during_rps', 0):.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or "multi-path-results")
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    if gpus < 1:
        print("--multi-path needs CUDA GPUs; this machine has none")
        return 2
    log_path = out / "multi_path.log"

    def log(line: str) -> None:
        print(line, flush=True)
        with log_path.open("a") as f:
            f.write(line + "\n")

    names = {torch.cuda.get_device_name(i) for i in range(gpus)}
    results: dict[str, Any] = {
        "machine": f"{gpus} x {', '.join(sorted(names))}; {platform.node()}",
        "commit": f"{git_commit()}{' (dirty)' if git_dirty() else ''}",
        "command": args.command_line,
        "cases": [],
    }
    for k in range(1, gpus + 1):
        results["cases"].append(run_links(k, args.gib, args.reps or 3, log))
        (out / "multi_path.json").write_text(json.dumps(results, indent=1))
    (out / "multi_path.md").write_text(render(results))
    best = {c["links"]: statistics.median(r["wake_gbps"] for r in c["runs"]) for c in results["cases"]}
    log(f"median wake GB/s by links: {best}")
    return 0
