"""`omni-core` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _cmd_walkthrough(args: argparse.Namespace) -> int:
    from omni_core.walkthrough import Walkthrough

    return Walkthrough().run()


def _write(path: Path, text: str) -> int:
    """The CLI writes what the sans-IO packages render (they do no file IO themselves)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0


def _cmd_schema(args: argparse.Namespace) -> int:
    from omni_core.protocol.schema import render_schema

    return _write(Path(args.path or "specs/messages.schema.json"), render_schema())


def _cmd_tables(args: argparse.Namespace) -> int:
    from omni_core.fsm import export_mermaid, export_tables

    if args.format == "json":
        print(json.dumps(export_tables(), indent=2))
    else:
        for name, diagram in export_mermaid().items():
            print(f"%% {name} lifecycle\n{diagram}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.config:  # the stages of a config file instead of the built-in scenario
        from omni_core.config import ConfigError, load_config, run_config_demo

        try:
            return run_config_demo(load_config(args.config))
        except ConfigError as exc:
            print(f"omni-core demo: {exc}", file=sys.stderr)
            return 2
    if args.synthetic:  # the scenario on synthetic runners, whose traces `omni-core check` validates
        from omni_core.demo import main as demo_main

        return demo_main(device=args.device, backend=args.backend, weights_mib=args.weights_mib or 64,
                         trace_path=args.trace)  # fmt: skip
    if args.weights_mib is not None:
        print("omni-core demo: --weights-mib sizes the synthetic runners; add --synthetic", file=sys.stderr)
        return 2
    from omni_core.demo_real import llm_runner_problem
    from omni_core.demo_real import main as real_demo_main

    problem = llm_runner_problem(args.llm_runner, args.device, args.size)
    if problem:
        print(f"omni-core demo: {problem}", file=sys.stderr)
        return 2
    return real_demo_main(device=args.device, backend=args.backend, size=args.size, out_dir=args.out,
                          models_dir=args.models, trace_path=args.trace, llm_runner=args.llm_runner)  # fmt: skip


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.control_plane:
        from omni_core.bench.control_plane import main as control_plane_main

        ranks = args.ranks or [1, 2, 4, 8]
        cycles = args.cycles or (25 if args.short else 250)
        return control_plane_main(ranks, cycles, args.out, " ".join(["omni-core", *sys.argv[1:]]))
    if args.real_models:
        from omni_core.bench.real_models import main as real_models_main

        return real_models_main(args)
    if args.swap:
        from omni_core.bench.swap import main as swap_main

        return swap_main(args)
    if args.multi_gpu:
        from omni_core.bench.multi_gpu import main as multi_gpu_main

        return multi_gpu_main(args)
    if args.vllm:
        from omni_core.bench.vllm_stage import main as vllm_stage_main

        return vllm_stage_main(["--out", args.out or "vllm-stage-results", "--models", args.models_dir])
    from omni_core.bench.memory import main as memory_main  # the GPU memory-path benchmark

    return memory_main(args)


def _cmd_docs(args: argparse.Namespace) -> int:
    from omni_core.fsm.docs import render_lifecycles

    return _write(Path("docs/lifecycles.md"), render_lifecycles())


def _cmd_conformance(args: argparse.Namespace) -> int:
    from omni_core.conformance.cli import run

    return run(args)


def _cmd_check(args: argparse.Namespace) -> int:
    from omni_core.formal.check import run

    return run(args)


def _cmd_models(args: argparse.Namespace) -> int:
    from omni_core.models.cli import run

    return run(args)


def _cmd_serve(args: argparse.Namespace) -> int:
    from omni_core.serve.cli import run_serve

    return run_serve(args)


def _cmd_remote(args: argparse.Namespace) -> int:
    from omni_core.serve.cli import run_remote

    return run_remote(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-core", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="a language model and a diffusion stage share one device: sleep, wake, "
                                    "reload, partial wake, a step-wise request across a sleep (--synthetic: "
                                    "synthetic runners, admission policies)")  # fmt: skip
    p.add_argument("--device", default="cpu", help="cpu (portable backend) or cuda (best backend available)")
    p.add_argument("--backend", default=None, help="override the backend (portable, cumem, fast, auto)")
    p.add_argument("--size", default="tiny", choices=("tiny", "large"),
                   help="real models: tiny (CPU, seconds) or large (Qwen2 1.5B + DiT 600M, for a GPU)")
    p.add_argument("--out", default="omni-core-demo-out", help="real models: folder for the images (PNG)")
    p.add_argument("--models", default=None,
                   help="real models: checkpoint cache, made on first use (default ~/.cache/omni-core/models)")
    p.add_argument("--llm-runner", default="transformers", choices=("transformers", "vllm"),
                   help="real models: run the language-model stage on transformers or on vLLM (GPU, --size large)")
    p.add_argument("--synthetic", action="store_true", help="the scenario on synthetic runners instead")
    p.add_argument("--weights-mib", type=int, default=None, help="--synthetic: weights per rank, MiB (default 64)")
    p.add_argument("--trace", default=None, help="append a JSON-lines trace of every message here")
    p.add_argument("--config", default=None, help="a TOML stage config: sleep, wake and reload each of its stages")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("bench", help="benchmarks: memory path on a GPU, or --control-plane on CPU")
    p.add_argument("--control-plane", action="store_true",
                   help="sleep/wake round trips of a stage with N rank processes (portable, empty model)")
    p.add_argument("--ranks", type=int, action="append", help="rank count (repeatable; default 1 2 4 8)")
    p.add_argument("--cycles", type=int, default=None, help="sleep+wake cycles per rank count")
    p.add_argument("--short", action="store_true", help="few cycles: a smoke run for CI")
    p.add_argument("--out", default=None, help="folder for JSON, Markdown (and PNG) results")
    p.add_argument("--methods", action="append",
                   help="memory path: comma-separated methods (default limit,vllm,tms,cumem,fast; options as "
                        "fast:chunk_mib=64,streams=1)")  # fmt: skip
    p.add_argument("--workloads", action="append", help="memory path: comma-separated (default 1g,8g,32g,mixed)")
    p.add_argument("--reps", type=int, default=None, help="memory path: level-1 cycles per case (default 4)")
    p.add_argument("--case-timeout-s", type=float, default=420.0, help="memory path: limit per (method, workload)")
    p.add_argument("--render", default=None, help="memory path: redraw Markdown and PNG from this memory.json")
    p.add_argument("--real-models", action="store_true",
                   help="a Qwen2 LLM and a DiT stage co-located on one GPU through every lifecycle, per backend "
                        "(--methods cumem,fast; --reps level-1 cycles; --render real_models.json)")  # fmt: skip
    p.add_argument("--vllm", action="store_true",
                   help="a vLLM stage through every lifecycle on cumem and fast, two vLLM stages started together "
                        "on one GPU, and plain vllm.LLM sleep/wake with vLLM's backend beside omni_fast (GPU)")
    p.add_argument("--swap", action="store_true",
                   help="one stage sleeps while another wakes on one GPU: link limit, vLLM and omni-core "
                        "sequential, omni-core swap (dirty/clean weights), Engine.swap; --workloads as pairs "
                        "A:B[+fill] (default 16g:16g,8g:16g+fill); --render swap_gpu.json")  # fmt: skip
    p.add_argument("--device", default=None, choices=("cuda", "cpu"),
                   help="--swap: cuda (default) or cpu (a smoke run: portable backend, simulated device, "
                        "workloads 2m/4m); --multi-gpu: cuda (two GPUs, default) or cpu (gloo, portable backend, "
                        "simulated device)")  # fmt: skip
    p.add_argument("--memory-wait-s", type=float, default=60.0,
                   help="--swap: how long the incoming stage's wake may wait for free memory")
    p.add_argument("--multi-gpu", action="store_true",
                   help="tensor-parallel (2 ranks) stages on two GPUs: every lifecycle with per-rank NVML and GB/s "
                        "(--parts tp), through Ray with an actor killed mid-sleep (ray), Engine.swap of two TP "
                        "stages against sequential (swap); --device cpu: the gloo smoke run")  # fmt: skip
    p.add_argument("--parts", default=None, help="multi-gpu: comma-separated parts (default tp,ray,swap)")
    p.add_argument("--runners", default=None,
                   help="multi-gpu: the TP stages of parts tp and ray (default vllm,transformers,synthetic)")
    p.add_argument("--real-size", default="large", choices=("large", "tiny"),
                   help="real models: large (Qwen2 1.5B + DiT 600M) or tiny")
    p.add_argument("--llm-model", default=None, help="real models: a local transformers directory (else made)")
    p.add_argument("--dit-model", default=None, help="real models: a local diffusers DiT directory (else made)")
    p.add_argument("--models-dir", default="/tmp/omni-core-models", help="real models: where missing ones are made")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("walkthrough", help="walk both lifecycles on the sans-IO cores, printing each step")
    p.set_defaults(func=_cmd_walkthrough)
    p = sub.add_parser("schema", help="write the JSON Schema of every wire message")
    p.add_argument("path", nargs="?", help="output path (default specs/messages.schema.json)")
    p.set_defaults(func=_cmd_schema)
    p = sub.add_parser("tables", help="print the transition tables (json or mermaid)")
    p.add_argument("--format", choices=("json", "mermaid"), default="mermaid")
    p.set_defaults(func=_cmd_tables)
    p = sub.add_parser("docs", help="regenerate docs/lifecycles.md from the transition tables")
    p.set_defaults(func=_cmd_docs)
    p = sub.add_parser("conformance", help="run the protocol conformance suite against a worker (docs/conformance.md)")
    from omni_core.conformance.cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_conformance)
    p = sub.add_parser("check", help="model-check tla/OmniSleep.tla with TLC: every model and bug model")
    from omni_core.formal.check import add_arguments as add_check_arguments

    add_check_arguments(p)
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("models", help="write local checkpoints with seeded weights (real-model runners, tests)")
    from omni_core.models.cli import add_arguments as add_models_arguments

    add_models_arguments(p)
    p.set_defaults(func=_cmd_models)
    from omni_core.serve.cli_args import add_remote_arguments, add_serve_arguments

    # allow_abbrev=False: `--api-key SECRET` must not be taken as `--api-key-file SECRET`.
    p = sub.add_parser("serve", help="HTTP control plane for the stages of a TOML config (README: Serving over HTTP)",
                       allow_abbrev=False)  # fmt: skip
    add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)
    for verb, what in (("status", "state of every stage of a running `omni-core serve`"),
                       ("sleep", "put a stage of a running `omni-core serve` to sleep"),
                       ("wake", "wake a stage of a running `omni-core serve`"),
                       ("swap", "stage OUT of a running `omni-core serve` sleeps while stage IN wakes")):  # fmt: skip
        p = sub.add_parser(verb, help=what, allow_abbrev=False)
        add_remote_arguments(p, verb)
        p.set_defaults(func=_cmd_remote)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
