"""`python -m benchmarks`: every benchmark of omni-core, run from the root of a checkout.

The benchmarks are no part of the installed package (they import it, it never imports them):
they live beside their committed results in `benchmarks/results`.
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m benchmarks"


def run(args: argparse.Namespace) -> int:
    if args.control_plane:
        from benchmarks.control_plane import main as control_plane_main

        ranks = args.ranks or [1, 2, 4, 8]
        cycles = args.cycles or (25 if args.short else 250)
        return control_plane_main(ranks, cycles, args.out, " ".join([PROG, *sys.argv[1:]]))
    if args.step_cache:
        from benchmarks.step_cache import main as step_cache_main

        args.command_line = " ".join([PROG, *sys.argv[1:]])
        return step_cache_main(args)
    if args.offload:
        from benchmarks.diffusion_offload import main as offload_main

        args.command_line = " ".join([PROG, *sys.argv[1:]])
        return offload_main(args)
    if args.stage_queue:
        from benchmarks.stage_queue import main as stage_queue_main

        return stage_queue_main(args.out, " ".join([PROG, *sys.argv[1:]]))
    if args.request_path:
        from benchmarks.request_path import main as request_path_main

        return request_path_main(args.out, " ".join([PROG, *sys.argv[1:]]), short=args.short)
    if args.real_models:
        from benchmarks.real_models import main as real_models_main

        return real_models_main(args)
    if args.swap:
        from benchmarks.swap import main as swap_main

        return swap_main(args)
    if args.multi_gpu:
        from benchmarks.multi_gpu import main as multi_gpu_main

        return multi_gpu_main(args)
    if args.multi_path:
        from benchmarks.multi_path import main as multi_path_main

        args.command_line = " ".join([PROG, *sys.argv[1:]])
        return multi_path_main(args)
    if args.weight_sync:
        from benchmarks.weight_sync import main as weight_sync_main

        args.command_line = " ".join([PROG, *sys.argv[1:]])
        return weight_sync_main(args)
    if args.pipeline:
        from benchmarks.pipeline import main as pipeline_main

        out = args.out or "benchmarks/results"
        out = out if out.endswith(".md") else f"{out}/pipeline.md"
        short = ["--requests", "4", "--warmup", "1"] if args.short else []
        return pipeline_main(["--out", out, *short], " ".join([PROG, *sys.argv[1:]]))
    if args.vllm:
        from benchmarks.vllm_stage import main as vllm_stage_main

        return vllm_stage_main(["--out", args.out or "vllm-stage-results", "--models", args.models_dir])
    from benchmarks.memory import main as memory_main  # the GPU memory-path benchmark

    return memory_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="benchmarks: memory path on a GPU, or --control-plane on CPU")
    p.add_argument(
        "--control-plane",
        action="store_true",
        help="sleep/wake round trips of a stage with N rank processes (portable, empty model)",
    )
    p.add_argument(
        "--step-cache",
        action="store_true",
        help="the DiT step cache's speedup and PSNR per threshold (CUDA where present, else CPU)",
    )
    p.add_argument("--step-cache-size", default="tiny", help="step cache: the DiT size (tiny, 600m)")
    p.add_argument("--step-cache-steps", type=int, default=50, help="step cache: denoising steps per image")
    p.add_argument(
        "--offload",
        action="store_true",
        help="layer-wise offload of a DiT's blocks: device memory and seconds per image (CUDA where present, else CPU)",
    )
    p.add_argument("--offload-size", default="tiny", help="offload: the DiT size (tiny, 600m)")
    p.add_argument("--offload-steps", type=int, default=20, help="offload: denoising steps per image")
    p.add_argument(
        "--stage-queue",
        action="store_true",
        help="the stage core's cost per queued request at 1k, 4k and 16k queued (sans-IO, CPU)",
    )
    p.add_argument(
        "--request-path",
        action="store_true",
        help="throughput of a tiny transformers stage at 1, 8 and 64 requests in flight, and a no-op "
        "command against a raw ZeroMQ + msgspec round trip at 1..4 ranks (CPU)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="a request across a tiny Qwen2 and a tiny SD stage: Engine.pipeline (a transfer) against the "
        "caller chaining them, p50/p95, images compared (CPU; --out FOLDER or FILE.md)",
    )
    p.add_argument("--ranks", type=int, action="append", help="rank count (repeatable; default 1 2 4 8)")
    p.add_argument("--cycles", type=int, default=None, help="sleep+wake cycles per rank count")
    p.add_argument("--short", action="store_true", help="few cycles: a smoke run for CI")
    p.add_argument("--out", default=None, help="folder for JSON, Markdown (and PNG) results")
    p.add_argument(
        "--methods",
        action="append",
        help="memory path: comma-separated methods (default limit,vllm,tms,cumem,fast; options as "
        "fast:chunk_mib=64,streams=1)",
    )
    p.add_argument("--workloads", action="append", help="memory path: comma-separated (default 1g,8g,32g,mixed)")
    p.add_argument("--reps", type=int, default=None, help="memory path: level-1 cycles per case (default 4)")
    p.add_argument("--case-timeout-s", type=float, default=420.0, help="memory path: limit per (method, workload)")
    p.add_argument("--render", default=None, help="memory path: redraw Markdown and PNG from this memory.json")
    p.add_argument(
        "--multi-path",
        action="store_true",
        help="a stage's sleep and wake over 1..N GPUs' host links through Engine, a peer stage serving "
        "on a lending GPU (--gib weights, --reps cycles)",
    )
    p.add_argument(
        "--weight-sync",
        action="store_true",
        help="versioned weight updates (P-17) from this process into a rollout stage: CUDA IPC on the same "
        "and the peer GPU, an NCCL group, 3 and 16 GB bf16, outputs checked after each",
    )
    p.add_argument(
        "--ws-parts",
        default="synthetic,vllm",
        help="weight-sync: which parts, comma-separated: synthetic (3 and 16 GB through Engine), vllm "
        "(omni-core's vllm stage against vLLM's own update_weights, same model; skipped without vLLM)",
    )
    p.add_argument("--ws-vllm-size", default="1.5b", help="weight-sync: the Qwen2 size of the vllm part")
    p.add_argument("--gib", type=float, default=16.0, help="multi-path: GiB of bf16 weights of the stage")
    p.add_argument(
        "--real-models",
        action="store_true",
        help="a Qwen2 LLM and a DiT stage co-located on one GPU through every lifecycle, per backend "
        "(--methods cumem,fast; --reps level-1 cycles; --render real_models.json)",
    )
    p.add_argument(
        "--vllm",
        action="store_true",
        help="a vLLM stage through every lifecycle on cumem and fast, two vLLM stages started together "
        "on one GPU, and plain vllm.LLM sleep/wake with vLLM's backend beside omni_fast (GPU)",
    )
    p.add_argument(
        "--swap",
        action="store_true",
        help="one stage sleeps while another wakes on one GPU: link limit, vLLM and omni-core "
        "sequential, omni-core swap (dirty/clean weights), Engine.swap; --workloads as pairs "
        "A:B[+fill] (default 16g:16g,8g:16g+fill); --render swap_gpu.json",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=("cuda", "cpu"),
        help="--swap: cuda (default) or cpu (a smoke run: portable backend, simulated device, "
        "workloads 2m/4m); --multi-gpu: cuda (two GPUs, default) or cpu (gloo, portable backend, "
        "simulated device)",
    )
    p.add_argument(
        "--memory-wait-s",
        type=float,
        default=60.0,
        help="--swap: how long the incoming stage's wake may wait for free memory",
    )
    p.add_argument(
        "--multi-gpu",
        action="store_true",
        help="tensor-parallel (2 ranks) stages on two GPUs: every lifecycle with per-rank NVML and GB/s "
        "(--parts tp), through Ray with an actor killed mid-sleep (ray), Engine.swap of two TP "
        "stages against sequential (swap); --device cpu: the gloo smoke run",
    )
    p.add_argument("--parts", default=None, help="multi-gpu: comma-separated parts (default tp,ray,swap)")
    p.add_argument(
        "--runners",
        default=None,
        help="multi-gpu: the TP stages of parts tp and ray (default vllm,transformers,synthetic)",
    )
    p.add_argument(
        "--real-size",
        default="large",
        choices=("large", "tiny"),
        help="real models: large (Qwen2 1.5B + DiT 600M) or tiny",
    )
    p.add_argument("--llm-model", default=None, help="real models: a local transformers directory (else made)")
    p.add_argument("--dit-model", default=None, help="real models: a local diffusers DiT directory (else made)")
    p.add_argument("--models-dir", default="/tmp/omni-core-models", help="real models: where missing ones are made")
    return p


def main(argv: list[str] | None = None) -> int:
    return int(run(build_parser().parse_args(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    raise SystemExit(main())
