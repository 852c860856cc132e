"""`python -m benchmarks --offload`: layer-wise offload of a DiT's blocks: the device memory it
saves and the time it costs.

Two `DiffusersRunner`s on the same seeded DiT checkpoint (`omni_core.models.make_checkpoint`),
in the pools of a portable backend: one with every weight resident, one with
`offload="layerwise"` (blocks on the host, streamed through one slab of the `offload` pool).
Reports per mode the bytes its pools hold on the device (what the Hello declares and the
memory gate counts), on CUDA the measured peak of allocated device memory while serving, the
bytes streamed per image and the median seconds per image over `--reps` (taken in turn).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.control_plane import TARGETS_HEADER, _machine
from benchmarks.step_cache import _timed
from omni_core.models import make_checkpoint
from omni_core.runners.block_offload import OFFLOAD_TAG
from omni_core.runners.diffusers_runner import DiffusersRunner
from omni_core.workers.backends import PortableBackend

TAGS = {"none": ("weights", "kv_cache"), "layerwise": ("weights", OFFLOAD_TAG, "kv_cache")}
TARGET_POOL_SHARE = 0.5  # offloaded pools at most this share of the resident ones
TARGET_SLOWDOWN = 1.5  # seconds per image at most this many times the resident ones


def _loaded(model: Path, device: torch.device, mode: str) -> tuple[DiffusersRunner, PortableBackend]:
    runner = DiffusersRunner(device, model=str(model), scheduler="DPMSolverMultistepScheduler", offload=mode)
    backend = PortableBackend(device)
    runner.load(backend.pool, TAGS[mode], None)
    for tag in TAGS[mode]:
        backend.track(tag, runner.tensors(tag))
    return runner, backend


def _peak_bytes(runner: DiffusersRunner, device: torch.device, request: dict[str, Any]) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(dict(request))
    return int(torch.cuda.max_memory_allocated(device))


def measure(model: Path, device: torch.device, request: dict[str, Any], reps: int) -> list[dict[str, Any]]:
    loaded = {mode: _loaded(model, device, mode) for mode in TAGS}
    for runner, _ in loaded.values():
        runner.execute(dict(request))  # warm-up: kernels, allocator
    peaks = {mode: _peak_bytes(runner, device, request) for mode, (runner, _) in loaded.items()}
    seconds: dict[str, list[float]] = {mode: [] for mode in TAGS}
    for _ in range(reps):
        for mode, (runner, _) in loaded.items():
            seconds[mode].append(_timed(runner, str(device), request)[0])
    rows = []
    for mode, (runner, backend) in loaded.items():
        offload = runner.offload
        before = offload.streamed_bytes if offload else 0
        runner.execute(dict(request))
        rows.append(
            {
                "mode": mode,
                "pool_bytes": dict(backend.usage()),
                "device_bytes": sum(backend.usage().values()),
                "peak_allocated_bytes": peaks[mode],
                "streamed_bytes_per_image": (offload.streamed_bytes - before) if offload else 0,
                "slab_bytes": offload.slab_bytes if offload else 0,
                "s_per_image": sorted(seconds[mode])[len(seconds[mode]) // 2],
            }
        )
        runner.close()
    return rows


def render(rows: list[dict[str, Any]], machine: dict[str, Any], command: str, steps: int, size: str) -> str:
    base, off = rows
    mib = 1 << 20
    lines = [
        f"# Layer-wise offload of a DiT's blocks: DiT {size}, {steps} steps, DPM-Solver, guidance 4",
        "",
        f"machine: {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']}; device "
        f"{machine['device']}; commit `{machine['commit']}`; command `{command}`",
        "",
        "| offload | device pools MiB | slab MiB | peak allocated MiB | streamed MiB per image | s per image |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        peak = "n/a (CPU)" if row["peak_allocated_bytes"] is None else f"{row['peak_allocated_bytes'] / mib:.1f}"
        lines.append(
            f"| {row['mode']} | {row['device_bytes'] / mib:.2f} | {row['slab_bytes'] / mib:.2f} | {peak} | "
            f"{row['streamed_bytes_per_image'] / mib:.1f} | {row['s_per_image']:.3f} |"
        )
    share = off["device_bytes"] / base["device_bytes"]
    slowdown = off["s_per_image"] / base["s_per_image"]
    share_met = "met" if share <= TARGET_POOL_SHARE else f"missed by {share - TARGET_POOL_SHARE:.0%}"
    slow_met = "met" if slowdown <= TARGET_SLOWDOWN else f"missed ({slowdown:.2f}x)"
    lines += [
        *TARGETS_HEADER,
        f"| device pools <= {TARGET_POOL_SHARE:.0%} of the resident model's | {share:.0%} | {share_met} |",
        f"| seconds per image <= {TARGET_SLOWDOWN}x the resident model's | {slowdown:.2f}x | {slow_met} |",
    ]
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size, steps = args.offload_size, args.offload_steps
    model = Path(args.models_dir) / f"dit-{size}-seed0"
    if not (model / "model_index.json").is_file():  # made by an earlier run: the same seeded checkpoint
        make_checkpoint("dit", size, model, seed=0)
    request = {"class_label": 207, "seed": 1, "steps": steps, "guidance_scale": 4.0}
    rows = measure(model, device, request, args.reps or 5)
    machine = {**_machine(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    text = render(rows, machine, args.command_line, steps, size)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "offload.md").write_text(text)
        (out / "offload.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    return 0
