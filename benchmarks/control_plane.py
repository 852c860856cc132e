"""`python -m benchmarks --control-plane`: what the protocol itself costs.

A stage of N rank processes with the portable backend and an empty model (one 64-byte
weight tensor, so every sleep and wake takes the whole path: API call, orchestrator,
N sockets, N worker cores and backends, N ACKs, commit) is put to sleep and woken over and
over; each call's wall time from the caller's side is one sample. Reports p50/p99 per N.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from omni_core.engine import Engine, StageSpec
from omni_core.provenance import git_commit

EMPTY_MODEL = {"weights_bytes": 64, "tensor_count": 1, "hidden": 4, "kv_bytes": 16, "cpu_threads": 1}
TARGET_P50_MS, TARGET_P99_MS = 2.0, 10.0  # at 8 ranks on the 2-core CI machine


def _percentile(sorted_ms: list[float], q: float) -> float:
    index = min(len(sorted_ms) - 1, max(0, round(q * (len(sorted_ms) - 1))))
    return sorted_ms[index]


def measure(ranks: int, cycles: int, warmup: int = 20) -> dict[str, Any]:
    spec = StageSpec(f"cp{ranks}", runner_args=EMPTY_MODEL, ranks=ranks, backend="portable", deadline_s=10.0)
    sleep_ms: list[float] = []
    wake_ms: list[float] = []
    with Engine([spec]) as engine:
        for i in range(warmup + cycles):
            started = time.perf_counter()
            engine.sleep(spec.name)
            slept = time.perf_counter()
            engine.wake(spec.name)
            woke = time.perf_counter()
            if i >= warmup:
                sleep_ms.append((slept - started) * 1e3)
                wake_ms.append((woke - slept) * 1e3)
    both = sorted(sleep_ms + wake_ms)
    return {
        "ranks": ranks,
        "samples": len(both),
        "p50_ms": _percentile(both, 0.50),
        "p99_ms": _percentile(both, 0.99),
        "mean_ms": statistics.fmean(both),
        "max_ms": both[-1],
        "sleep_p50_ms": _percentile(sorted(sleep_ms), 0.5),
        "wake_p50_ms": _percentile(sorted(wake_ms), 0.5),
    }


def _machine() -> dict[str, Any]:
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git_commit(),
    }


TARGETS_HEADER = ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
"""The start of a results file's closing table (target | measured | met), for its rows."""


def render_markdown(results: list[dict[str, Any]], machine: dict[str, Any], command: str) -> str:
    lines = [
        "# Control-plane round trips (sleep and wake of a stage, portable backend, empty model)",
        "",
        f"machine: {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']}; "
        f"commit `{machine['commit']}`; command `{command}`",
        "",
        "| ranks | samples | p50 ms | p99 ms | mean ms | max ms | sleep p50 ms | wake p50 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['ranks']} | {r['samples']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['mean_ms']:.2f} | {r['max_ms']:.2f} | {r['sleep_p50_ms']:.2f} | {r['wake_p50_ms']:.2f} |"
        )
    eight = [r for r in results if r["ranks"] == 8]
    if eight:
        r = eight[0]
        ok = r["p50_ms"] <= TARGET_P50_MS and r["p99_ms"] <= TARGET_P99_MS
        lines += [
            "",
            f"target at 8 ranks: p50 <= {TARGET_P50_MS} ms and p99 <= {TARGET_P99_MS} ms: "
            f"{'met' if ok else 'MISSED'} (p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms)",
        ]
    return "\n".join(lines) + "\n"


def main(ranks: list[int], cycles: int, out_dir: str | None, command: str) -> int:
    results = []
    for n in ranks:
        started = time.perf_counter()
        result = measure(n, cycles)
        results.append(result)
        print(
            f"ranks {n}: p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms over "
            f"{result['samples']} round trips ({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
    machine = _machine()
    text = render_markdown(results, machine, command)
    print(text)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        (path / "control_plane.json").write_text(
            json.dumps({"machine": machine, "command": command, "results": results}, indent=2) + "\n"
        )
        (path / "control_plane.md").write_text(text)
        print(f"wrote {path / 'control_plane.json'} and {path / 'control_plane.md'}")
    return 0
