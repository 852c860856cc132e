"""`python -m benchmarks --step-cache`: the DiT step cache's speedup and the image it gives.

One `DiffusersRunner` per threshold on the same seeded DiT checkpoint (made by
`omni_core.models.make_checkpoint`; random weights, so the PSNR says how far the cached
trajectory drifts from the uncached one, not how a trained model's images look), the same
request each time: one warm-up image, then `--reps` timed ones. Reports seconds per image,
steps skipped, and PSNR of the 8-bit image against the uncached one.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.control_plane import TARGETS_HEADER, _machine
from omni_core.models import make_checkpoint
from omni_core.runners.diffusers_runner import DiffusersRunner

THRESHOLDS = (0.0, 0.05, 0.1, 0.2, 0.3)
TARGET_SPEEDUP, TARGET_PSNR_DB = 1.5, 30.0  # at the best threshold meeting the PSNR


def _pixels(result: dict[str, Any]) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(result["png"])), dtype=np.float64) / 255.0


def _psnr(result: dict[str, Any], reference: dict[str, Any]) -> float:
    mse = float(((_pixels(result) - _pixels(reference)) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(1.0 / mse)


def _runner(model: Path, device: str, threshold: float | None) -> DiffusersRunner:
    runner = DiffusersRunner(
        torch.device(device), model=str(model), scheduler="DPMSolverMultistepScheduler", step_cache_threshold=threshold
    )
    runner.load_weights()
    return runner


def _timed(runner: DiffusersRunner, device: str, request: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    result = runner.execute(dict(request))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started, result


def measure_all(
    model: Path, device: str, thresholds: tuple[float | None, ...], request: dict[str, Any], reps: int
) -> list[dict[str, Any]]:
    """Every threshold's runner loaded and warmed up first, then the timed images taken in turn
    (one per runner per round), so a load that changes over the run weighs on each alike."""
    runners = [_runner(model, device, threshold) for threshold in thresholds]
    results = [runner.execute(dict(request)) for runner in runners]  # warm-up: kernels, allocator
    seconds: list[list[float]] = [[] for _ in runners]
    for _ in range(reps):
        for index, runner in enumerate(runners):
            elapsed_s, results[index] = _timed(runner, device, request)
            seconds[index].append(elapsed_s)
    rows = []
    for threshold, runner, times, result in zip(thresholds, runners, seconds, results, strict=True):
        counters = runner.counters()
        calls = counters.get("step_cache_hits", 0) + counters.get("step_cache_misses", 0)
        skipped = counters.get("step_cache_hits", 0) / calls if calls else 0.0
        runner.close()
        median_s = sorted(times)[len(times) // 2]
        rows.append({"threshold": threshold, "s_per_image": median_s, "skipped": skipped, "result": result})
    return rows


def render(rows: list[dict[str, Any]], machine: dict[str, Any], command: str, steps: int, size: str) -> str:
    base = rows[0]
    lines = [
        f"# DiT step cache (TeaCache's method): DiT {size}, {steps} steps, DPM-Solver, guidance 4",
        "",
        f"machine: {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']}; device "
        f"{machine['device']}; commit `{machine['commit']}`; command `{command}`",
        "",
        "Random weights: the PSNR is the cached image against the uncached one (8-bit), a measure of drift.",
        "",
        "| threshold | s per image | speedup | steps skipped | PSNR dB |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        label = "off" if row["threshold"] is None else f"{row['threshold']:g}"
        lines.append(
            f"| {label} | {row['s_per_image']:.3f} | {base['s_per_image'] / row['s_per_image']:.2f}x | "
            f"{row['skipped']:.0%} | {row['psnr_db']:.1f} |"
        )
    good = [r for r in rows[1:] if r["psnr_db"] >= TARGET_PSNR_DB]
    best = max(good, key=lambda r: base["s_per_image"] / r["s_per_image"], default=None)
    speedup = base["s_per_image"] / best["s_per_image"] if best else 0.0
    met = "met" if speedup >= TARGET_SPEEDUP else f"missed ({speedup:.2f}x)"
    where = f"threshold {best['threshold']:g}: {speedup:.2f}x at {best['psnr_db']:.1f} dB" if best else "none"
    lines += [
        *TARGETS_HEADER,
        f"| speedup >= {TARGET_SPEEDUP}x at PSNR >= {TARGET_PSNR_DB} dB against the uncached image | {where} | {met} |",
    ]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size, steps = args.step_cache_size, args.step_cache_steps
    model = Path(args.models_dir) / f"dit-{size}-seed0"
    if not (model / "model_index.json").is_file():  # made by an earlier run: the same seeded checkpoint
        make_checkpoint("dit", size, model, seed=0)
    request = {"class_label": 207, "seed": 1, "steps": steps, "guidance_scale": 4.0}
    rows = measure_all(model, device, (None, *THRESHOLDS), request, args.reps or 5)
    reference = rows[0]["result"]
    for row in rows:
        row["psnr_db"] = _psnr(row.pop("result"), reference)
    machine = {**_machine(), "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    text = render(rows, machine, args.command_line, steps, size)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "step_cache.md").write_text(text)
        (out / "step_cache.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    return 0
