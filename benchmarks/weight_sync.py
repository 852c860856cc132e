"""`python -m benchmarks --weight-sync`: versioned weight updates (P-17) from a trainer process
into a rollout stage, through `Engine.update_weights`, on one or two GPUs.

The bench process is the trainer (a process omni-core did not start): it holds the new weights
as CUDA tensors and shares them with `WeightSender` (CUDA IPC buckets). Part `synthetic`: for
1.5B-shaped (3 GB, 254 tensors) and 8B-shaped (16 GB, 291 tensors) bf16 weights: an update
from the same GPU (first: the rank opens the handles; then again with new values: the handles
are reused), from the peer GPU over NVLink when there is one, and through an NCCL weight group
from the peer (the peer rows are left out on one GPU). After each update the rollout's output
digest must equal that of a plain runner loaded with the same weights in this process, and
again after a level-1 sleep and wake (the backend's clean host copy must not bring back an
older version). The engine and its rank trace every update, and each row's time through the
Engine is cut into phases (benchmarks/weight_sync_path.py). Part `vllm`
(benchmarks/weight_sync_vllm.py): omni-core's vllm stage against vLLM's own `update_weights`
on the same Qwen2 checkpoint. `--ws-parts` picks the parts. Writes weight_sync.json/.md to
--out. Without CUDA it measures the update's path through the engine on the CPU instead.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.weight_sync_path import PHASES, cpu_update_path, render_paths, timed_update, update_path
from benchmarks.weight_sync_vllm import render_vllm, run_vllm_part
from omni_core.engine import Engine, StageSpec
from omni_core.provenance import git_commit, git_dirty
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.trace import read_trace
from omni_core.weights_sender import WeightSender

GiB = 1 << 30
SHAPES = {"3g": (3.09e9, 254), "16g": (16.06e9, 291)}  # bytes, tensors (Qwen2-1.5B, Llama-8B counts)
PROBE = {"seed": 1, "batch": 4}


def _args(nbytes: float, tensors: int) -> dict[str, Any]:
    return {
        "weights_bytes": int(nbytes),
        "tensor_count": tensors,
        "hidden": 4096,
        "dtype": "bfloat16",
        "kv_bytes": GiB // 4,
        "seed": 3,
    }


def _trainer_weights(args: dict[str, Any], device: str, step: int) -> dict[str, torch.Tensor]:
    shapes = SyntheticRunner(torch.device("cpu"), **args).weight_specs()
    g = torch.Generator(device=device).manual_seed(1000 + step)
    return {
        name: torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)
        for name, (shape, _) in shapes.items()
    }


def _reference(args: dict[str, Any], weights: dict[str, torch.Tensor]) -> str:
    runner = SyntheticRunner(torch.device("cuda", 0), **args)
    runner.load_weights()
    runner.allocate_caches()
    runner.update_weights((n, t.to("cuda:0")) for n, t in weights.items())
    digest = runner.execute(PROBE)["sha256"]
    runner.close()
    torch.cuda.empty_cache()
    return digest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, engine: Engine, args: dict[str, Any], nbytes: int, log: Any) -> None:
        self.engine, self.args, self.nbytes, self.log = engine, args, nbytes, log
        self.version = 0
        self.rows: list[dict[str, Any]] = []
        self.stamps: dict[str, tuple[float, float]] = {}  # task id -> the caller's monotonic call, return

    def attach_paths(self, trace: str) -> None:
        """Each traced update's phases (benchmarks/weight_sync_path.py) into its row; a trace
        that cannot be read is said in every row, the figures stand."""
        try:
            lines = read_trace(trace)
        except (OSError, ValueError) as exc:
            for row in self.rows:
                row["path_error"] = f"{type(exc).__name__}: {exc}"
            return
        for row in self.rows:
            stamp = self.stamps.get(row.get("task_id", ""))
            if stamp is None:
                continue
            try:
                path = update_path(lines, row["task_id"], *stamp)
            except ValueError as exc:  # reported in the row, the figures stand
                row["path_error"] = str(exc)
                continue
            row["path"] = {**path.phases, "commands_sent": path.commands_sent}
            row["path"]["replies_received"] = path.replies_received
            row["path"]["other_frames"] = path.other_frames

    def check(self, weights: dict[str, torch.Tensor]) -> dict[str, bool]:
        expected = _reference(self.args, weights)
        served = self.engine.execute("rollout", PROBE)["sha256"] == expected
        self.engine.sleep("rollout", level=1)
        self.engine.wake("rollout")
        after_wake = self.engine.execute("rollout", PROBE)["sha256"] == expected
        return {"exact": served, "exact_after_sleep_wake": after_wake}

    def update(
        self, case: str, source: Any, share_s: float, weights: dict[str, torch.Tensor], during: Any = None
    ) -> None:
        self.version += 1
        task_id = f"update-{self.version}"
        try:
            report, called_at_s, returned_at_s = timed_update(self.engine, "rollout", source, self.version, task_id)
        except Exception as exc:  # recorded: the stage is NEEDS_RELOAD and the next update replaces the reload
            self.log(f"{case}: {type(exc).__name__}: {exc}")
            self.rows.append({"case": case, "version": self.version, "error": f"{type(exc).__name__}: {exc}"})
            if during is not None:
                during.join(300)
            return
        wall_s = returned_at_s - called_at_s
        self.stamps[task_id] = (called_at_s, returned_at_s)
        if during is not None:
            during.join(300)
        rank_s = report.ranks[0].duration_s
        row = {
            "case": case,
            "task_id": task_id,
            "version": self.version,
            "share_s": share_s,
            "update_wall_s": wall_s,
            "rank_s": rank_s,
            "gbps_wall": self.nbytes / wall_s / 1e9,
            **self.check(weights),
        }
        self.rows.append(row)
        self.log(
            f"{case}: update {wall_s * 1e3:.1f} ms through Engine (rank {rank_s * 1e3:.1f} ms, "
            f"{row['gbps_wall']:.0f} GB/s), share {share_s * 1e3:.1f} ms, exact {row['exact']}, "
            f"after sleep/wake {row['exact_after_sleep_wake']}"
        )


def run_shape(name: str, log: Any, out: Path) -> dict[str, Any]:
    nbytes, tensors = SHAPES[name]
    args = _args(nbytes, tensors)
    two = torch.cuda.device_count() > 1
    spec = StageSpec(
        "rollout",
        runner="synthetic",
        runner_args=args,
        device="cuda",
        backend="fast",
        devices=("0,1",) if two else ("0",),
        deadline_s=300.0,
        start_deadline_s=600.0,
    )
    trace = out / f"trace_{name}.jsonl"
    trace.unlink(missing_ok=True)
    with Engine([spec], trace_path=str(trace)) as engine, WeightSender() as sender:
        weights = _trainer_weights(args, "cuda:0", 1)
        moved = sum(t.numel() * t.element_size() for t in weights.values())
        run = Run(engine, args, moved, log)
        same_gpu = ((1, "same GPU, ipc, first (opens handles)"), (2, "same GPU, ipc, again (handles reused)"))
        for step, case in same_gpu:
            weights = _trainer_weights(args, "cuda:0", step)
            started = time.perf_counter()
            source = sender.share(weights)
            run.update(case, source, time.perf_counter() - started, weights)
        if two:
            sender.release()
            del weights
            torch.cuda.empty_cache()
            for step, case in ((3, "peer GPU, ipc, first"), (4, "peer GPU, ipc, again")):
                weights = _trainer_weights(args, "cuda:1", step)
                started = time.perf_counter()
                source = sender.share(weights)
                run.update(case, source, time.perf_counter() - started, weights)
            sender.release()
            try:
                port = _free_port()
                joining = threading.Thread(
                    target=sender.init_group, args=("127.0.0.1", port, 2), kwargs={"backend": "nccl"}, daemon=True
                )
                joining.start()
                engine.init_weight_group("rollout", address="127.0.0.1", port=port, world_size=2, backend="nccl")
                joining.join(60)
                for step, case in ((5, "peer GPU, nccl broadcast, first"), (6, "peer GPU, nccl broadcast, again")):
                    weights = _trainer_weights(args, "cuda:1", step)
                    source = sender.collective_source(weights)
                    run.update(case, source, 0.0, weights, during=sender.broadcast_in_thread(weights))
            except Exception as exc:  # reported, not hidden: the other rows stand
                log(f"nccl weight group: {type(exc).__name__}: {exc}")
                run.rows.append({"case": "peer GPU, nccl broadcast", "error": f"{type(exc).__name__}: {exc}"})
    run.attach_paths(str(trace))
    return {"shape": name, "bytes": moved, "tensors": tensors, "rows": run.rows}


def rank_memory_figure_s(calls: int = 20) -> dict[str, Any]:
    """What one of the rank's memory figures costs here (NVML's process list on GPU 0; a rank
    takes one before an update, inside its own time, and one after, outside it)."""
    from omni_core.workers.accounting import ProcessMemory

    try:
        memory = ProcessMemory(torch.device("cuda", 0))
        source = memory.measure().source
    except Exception as exc:  # said in the output; the update rows do not depend on it
        return {"error": f"{type(exc).__name__}: {exc}"}
    started = time.perf_counter()
    for _ in range(calls):
        memory.measure()
    return {"per_call_s": (time.perf_counter() - started) / calls, "source": source}


def render(results: dict[str, Any]) -> str:
    lines = ["# Weight sync: versioned updates from a trainer into a rollout stage (P-17)", "", "| | |", "|---|---|"]
    for key in ("machine", "commit", "command"):
        lines.append(f"| {key} | {results[key]} |")
    lines += [
        "",
        "| shape | case | update through Engine | rank's own time | GB/s (Engine) | trainer's share | "
        "exact | exact after sleep+wake |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape in results["shapes"]:
        for r in shape["rows"]:
            if "error" in r:
                lines.append(f"| {shape['shape']} | {r['case']} | error: {r['error'][:120]} | | | | | |")
                continue
            lines.append(
                f"| {shape['shape']} | {r['case']} | {r['update_wall_s'] * 1e3:.1f} ms | "
                f"{r['rank_s'] * 1e3:.1f} ms | {r['gbps_wall']:.0f} | {r['share_s'] * 1e3:.1f} ms | "
                f"{r['exact']} | {r['exact_after_sleep_wake']} |"
            )
    lines += [
        "",
        "Where the time through the Engine goes (from the trace; ms; the slowest rank): "
        + "; ".join(f"{key.removesuffix('_s')}: {what}" for key, what in PHASES)
        + ". Frames: commands sent / replies received by the update's task.",
        "",
        "| shape | case | " + " | ".join(key.removesuffix("_s") for key, _ in PHASES) + " | frames | other frames |",
        "|---|---|" + "---|" * (len(PHASES) + 2),
    ]
    for shape in results["shapes"]:
        for r in shape["rows"]:
            path = r.get("path")
            if path is None:
                continue
            phases = " | ".join(f"{path[key] * 1e3:.2f}" for key, _ in PHASES)
            frames = f"{path['commands_sent']} / {path['replies_received']}"
            lines.append(f"| {shape['shape']} | {r['case']} | {phases} | {frames} | {len(path['other_frames'])} |")
    figure = results.get("memory_figure")
    if figure and "error" in figure:
        lines += ["", f"The rank memory figure's cost was not measured: {figure['error']}"]
    elif figure:
        lines += [
            "",
            f"One rank memory figure ({figure['source']}) costs {figure['per_call_s'] * 1e3:.3f} ms here; "
            "an update takes two (one inside the rank's time, one in rank_extra).",
        ]
    if "vllm" in results:
        lines += render_vllm(results["vllm"])
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or "weight-sync-results")
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        # CUDA IPC and NCCL need a GPU; the update's path through the engine is measured here.
        tables = render_paths("CPU: shared-memory updates of 291 tensors, back to back", cpu_update_path())
        spaced = cpu_update_path(10, idle_s=1.0)
        tables += ["", *render_paths("The same, spaced as the GPU bench spaces them (sleep, wake, 1 s idle)", spaced)]
        text = "\n".join(tables) + "\n"
        (out / "weight_sync_path_cpu.md").write_text(text)
        print(text, end="")
        return 0

    def log(line: str) -> None:
        print(line, flush=True)
        with (out / "weight_sync.log").open("a") as f:
            f.write(line + "\n")

    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    results: dict[str, Any] = {
        "machine": f"{torch.cuda.device_count()} x {', '.join(names)}; {platform.node()}",
        "commit": f"{git_commit()}{' (dirty)' if git_dirty() else ''}",
        "command": args.command_line,
        "shapes": [],
    }
    results["memory_figure"] = rank_memory_figure_s()
    parts = set(getattr(args, "ws_parts", "synthetic,vllm").split(","))
    if "synthetic" in parts:
        for name in SHAPES:
            results["shapes"].append(run_shape(name, log, out))
            (out / "weight_sync.json").write_text(json.dumps(results, indent=1))
    if "vllm" in parts:
        results["vllm"] = run_vllm_part(getattr(args, "ws_vllm_size", "1.5b"), out, log)
        (out / "weight_sync.json").write_text(json.dumps(results, indent=1))
    (out / "weight_sync.md").write_text(render(results))
    return 0
