"""`omni-core` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _cmd_walkthrough(args: argparse.Namespace) -> int:
    from omni_testing.walkthrough import Walkthrough

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

    if args.format == "json" or args.json:
        print(json.dumps(export_tables(), indent=2))
    else:
        for name, diagram in export_mermaid().items():
            print(f"%% {name} lifecycle\n{diagram}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from omni_core.workers.config import device_problem

    if args.config:  # the stages of a config file instead of the built-in scenario
        from omni_core.config import ConfigError, load_config, run_config_demo

        if args.json:
            print(
                "omni-core demo: --json is for the built-in scenarios; --config prints its steps as text "
                "(its exit status says whether every stage passed)",
                file=sys.stderr,
            )
            return 2

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            print(f"omni-core demo: {exc}", file=sys.stderr)
            return 2
        # Ranks started elsewhere (launcher = "ray") use their node's devices, not this machine's.
        local = config.engine.get("launcher", "local") == "local"
        for stage in config.stages if local else ():
            problem = device_problem(stage.device)
            if problem:
                print(
                    f"omni-core demo: {args.config}: stage {stage.name!r}: device = {stage.device!r}: {problem}; "
                    'set the TOML key `device` of that [[stages]] table to "cpu", or run where the GPU is',
                    file=sys.stderr,
                )
                return 2
        return run_config_demo(config)
    problem = device_problem(args.device)
    if problem:
        print(
            f"omni-core demo: --device {args.device}: {problem}; use --device cpu, or run on a machine with an "
            "NVIDIA GPU and a CUDA build of torch",
            file=sys.stderr,
        )
        return 2
    if args.synthetic:  # the scenario on synthetic runners, whose traces `omni-core check` validates
        from omni_core.demo import main as demo_main

        return demo_main(
            device=args.device,
            backend=args.backend,
            weights_mib=args.weights_mib or 64,
            trace_path=args.trace,
            json_out=args.json,
        )
    if args.weights_mib is not None:
        print("omni-core demo: --weights-mib sizes the synthetic runners; add --synthetic", file=sys.stderr)
        return 2
    from omni_core.demo_real import llm_runner_problem
    from omni_core.demo_real import main as real_demo_main

    problem = llm_runner_problem(args.llm_runner, args.device, args.size)
    if problem:
        print(f"omni-core demo: {problem}", file=sys.stderr)
        return 2
    return real_demo_main(
        device=args.device,
        backend=args.backend,
        size=args.size,
        out_dir=args.out,
        models_dir=args.models,
        trace_path=args.trace,
        llm_runner=args.llm_runner,
        json_out=args.json,
    )


def _cmd_docs(args: argparse.Namespace) -> int:
    from omni_core.fsm.docs import render_lifecycles

    return _write(Path("docs/lifecycles.md"), render_lifecycles())


def _cmd_examples(args: argparse.Namespace) -> int:
    from omni_core.resources import data_dir, data_file

    found = sorted(data_dir("examples").glob("*.toml"))
    if args.name:
        name = args.name.removesuffix(".toml")
        if name not in {p.stem for p in found}:
            print(
                f"omni-core examples: no example named {name!r}; there are {', '.join(p.stem for p in found)} "
                "(omni-core examples lists them)",
                file=sys.stderr,
            )
            return 2
        sys.stdout.write(data_file("examples", f"{name}.toml").read_text())
        return 0
    if args.json:
        print(json.dumps([{"name": p.stem, "path": str(p), "about": _first_comment(p)} for p in found], indent=2))
        return 0
    for path in found:
        print(f"{path.stem:<18} {path}\n    {_first_comment(path)}")
    return 0


def _first_comment(path: Path) -> str:
    first = path.read_text().splitlines()[:1]
    return first[0].lstrip("# ").strip() if first and first[0].startswith("#") else ""


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


# Client verbs for the stage calls that `serve/cli.py`'s verbs (status, sleep, wake, swap) leave out.
CLIENT_VERBS = {
    "reload": "reload a stage's weights on a running `omni-core serve` (after a level-2 sleep: NEEDS_RELOAD)",
    "update-weights": "load new weights as a version above the stage's, from a checkpoint, on a running "
    "`omni-core serve` (any state with the weights resident; RUNNING drains first)",
    "save-weights": "write a stage's weights, at its version, to a directory on the ranks' disk (under "
    "allowed_reload_sources) on a running `omni-core serve`; a restart then comes back at that version",
    "restart": "restart every rank of a stage of a running `omni-core serve` (a FAILED stage; new epoch)",
    "execute": "run one request on a stage of a running `omni-core serve`; prints rank 0's output as JSON",
    "pause": "close a stage's admission keeping its memory, on a running `omni-core serve` (PAUSED once "
    "no request is in flight; requests wait until resume)",
    "resume": "open a PAUSED stage's admission again, on a running `omni-core serve`",
}
# What the engine's refusals ask for, as the command an operator types.
_FIXES = (
    # First: a stage under a version floor names update_weights and this, never a reload.
    (
        "restart(from_checkpoint=True)",
        "omni-core update-weights {stage} --version FLOOR, or omni-core restart {stage} --from-checkpoint",
    ),
    ("reload_weights()", "omni-core reload {stage}"),
    ("restart()", "omni-core restart {stage}"),
    ("resume()", "omni-core resume {stage}"),
)


def _add_client_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    import os

    from omni_core.serve.cli_args import DEFAULT_URL, URL_ENV

    p.add_argument("stage", help="stage name")
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"where `omni-core serve` listens (default ${URL_ENV}, else {DEFAULT_URL})",
    )
    p.add_argument("--api-key-file", default=None, help="file holding the API key (else OMNI_CORE_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--idempotency-key", default=None, help="a retry with the same key has no second effect")
    if verb != "restart":
        p.add_argument("--timeout-s", type=float, default=None, help="deadline of the command (server side)")
    if verb == "pause":
        p.add_argument(
            "--mode",
            choices=("wait", "keep", "abort"),
            default="wait",
            help="in-flight requests finish first (wait, keep) or fail now (abort); default wait",
        )
    if verb == "reload":
        p.add_argument("--source", default=None, help="checkpoint to load (default: the stage's own)")
    if verb == "restart":
        p.add_argument(
            "--from-checkpoint",
            action="store_true",
            help="start over from the checkpoint at weights version 0 (default: back at the version held)",
        )
    if verb == "update-weights":
        p.add_argument(
            "--version",
            type=int,
            required=True,
            dest="weights_version",
            help="the new weights version, above the stage's (`omni-core status`)",
        )
        p.add_argument("--source", required=True, help="checkpoint directory (under allowed_reload_sources)")
    if verb == "save-weights":
        p.add_argument("--directory", required=True, help="where the ranks write (under allowed_reload_sources)")
        p.add_argument("--overwrite", action="store_true", help="replace the directory if it exists")
    if verb == "execute":
        p.add_argument("--payload", default=None, metavar="JSON", help="the request, as JSON: '{\"seed\": 1}'")
    p.set_defaults(verb=verb)


def _client_call(client: Any, args: argparse.Namespace, payload: Any) -> Any:
    """The server's answer to the client verb `args.verb`."""
    verb = args.verb
    if verb == "reload":
        return client.reload_weights(
            args.stage, args.source, timeout_s=args.timeout_s, idempotency_key=args.idempotency_key
        )
    elif verb == "update-weights":
        return client.update_weights(
            args.stage,
            args.source,
            version=args.weights_version,
            timeout_s=args.timeout_s,
            idempotency_key=args.idempotency_key,
        )
    elif verb == "save-weights":
        return client.save_weights(
            args.stage,
            args.directory,
            overwrite=args.overwrite,
            timeout_s=args.timeout_s,
            idempotency_key=args.idempotency_key,
        )
    elif verb == "restart":
        return client.restart(args.stage, from_checkpoint=args.from_checkpoint, idempotency_key=args.idempotency_key)
    elif verb == "pause":
        return client.pause(args.stage, args.mode, timeout_s=args.timeout_s, idempotency_key=args.idempotency_key)
    elif verb == "resume":
        return client.resume(args.stage, timeout_s=args.timeout_s, idempotency_key=args.idempotency_key)
    else:
        return client.execute(args.stage, payload, timeout_s=args.timeout_s, idempotency_key=args.idempotency_key)


def _cmd_client(args: argparse.Namespace) -> int:
    from omni_core.client import OmniClient, ServeError

    verb = args.verb
    payload = None
    if getattr(args, "payload", None) is not None:
        try:
            payload = json.loads(args.payload)
        except ValueError as exc:
            print(f"omni-core execute: --payload is not JSON ({exc}): {args.payload[:200]!r}", file=sys.stderr)
            return 2
    try:
        answer = _client_call(OmniClient(args.url, api_key_file=args.api_key_file), args, payload)
    except ServeError as exc:
        print(f"omni-core {verb}: HTTP {exc.status} {exc.type}: {exc}", file=sys.stderr)
        fixes = [fix.format(stage=args.stage) for asked, fix in _FIXES if asked in str(exc)]
        if fixes:
            print(f"  to fix: {fixes[0]} --url {args.url}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"omni-core {verb}: cannot read the API key file: {exc}", file=sys.stderr)
        return 2
    from omni_core.serve.cli import say_if_replayed

    say_if_replayed(verb, answer, args.idempotency_key)
    if args.json or verb == "execute":
        print(json.dumps(answer, indent=2))
    elif verb in ("reload", "pause", "resume", "save-weights"):
        print(
            f"{answer['stage']}: {answer['command']} -> {answer['state']} ({answer['status']}) in "
            f"{answer['duration_s'] * 1000:.1f} ms"
        )
    elif verb == "update-weights":
        print(
            f"{answer['stage']}: weights version {answer['weights_version']} -> {answer['state']} "
            f"({answer['status']}) in {answer['duration_s'] * 1000:.1f} ms"
        )
    else:
        print(
            f"{answer['stage']}: restarted -> {answer['state']}, epoch {answer['epoch']}, "
            f"weights version {answer['weights_version']}"
        )
        if answer.get("version_floor") or answer.get("version_reset_from") is not None:
            print(f"  {answer.get('detail', '')}")
    return 0


def _cmd_adapters(args: argparse.Namespace) -> int:
    from omni_core.serve.adapter_cli import run_adapters

    return run_adapters(args)


def _cmd_remote(args: argparse.Namespace) -> int:
    from omni_core.serve.cli import run_remote

    return run_remote(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omni-core", description=__doc__)
    parser.add_argument(
        "--version",
        action="version",
        version=_version(),
        help="print the version, where the package is installed, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "demo",
        help="a language model and a diffusion stage share one device: sleep, wake, "
        "reload, partial wake, a step-wise request across a sleep (--synthetic: "
        "synthetic runners, admission policies)",
    )
    p.add_argument("--device", default="cpu", help="cpu (portable backend) or cuda (best backend available)")
    p.add_argument("--backend", default=None, help="override the backend (portable, cumem, fast, auto)")
    p.add_argument(
        "--size",
        default="tiny",
        choices=("tiny", "large"),
        help="real models: tiny (CPU, seconds) or large (Qwen2 1.5B + DiT 600M, for a GPU)",
    )
    p.add_argument("--out", default="omni-core-demo-out", help="real models: folder for the images (PNG)")
    p.add_argument(
        "--models",
        default=None,
        help="real models: checkpoint cache, made on first use (default ~/.cache/omni-core/models)",
    )
    p.add_argument(
        "--llm-runner",
        default="transformers",
        choices=("transformers", "vllm"),
        help="real models: run the language-model stage on transformers or on vLLM (GPU, --size large)",
    )
    p.add_argument("--synthetic", action="store_true", help="the scenario on synthetic runners instead")
    p.add_argument("--weights-mib", type=int, default=None, help="--synthetic: weights per rank, MiB (default 64)")
    p.add_argument("--trace", default=None, help="append a JSON-lines trace of every message here")
    p.add_argument("--config", default=None, help="a TOML stage config: sleep, wake and reload each of its stages")
    p.add_argument(
        "--json",
        action="store_true",
        help="print the steps and verdict as JSON on stdout (the narration goes to stderr)",
    )
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("walkthrough", help="walk both lifecycles on the sans-IO cores, printing each step")
    p.set_defaults(func=_cmd_walkthrough)
    p = sub.add_parser("schema", help="write the JSON Schema of every wire message")
    p.add_argument("path", nargs="?", help="output path (default specs/messages.schema.json)")
    p.set_defaults(func=_cmd_schema)
    p = sub.add_parser("tables", help="print the transition tables (json or mermaid)")
    p.add_argument("--format", choices=("json", "mermaid"), default="mermaid")
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.set_defaults(func=_cmd_tables)
    p = sub.add_parser("docs", help="regenerate docs/lifecycles.md from the transition tables")
    p.set_defaults(func=_cmd_docs)
    p = sub.add_parser(
        "examples",
        help="list the example stage configs this install carries, or print one "
        "(omni-core examples two_stages > stages.toml)",
    )
    p.add_argument("name", nargs="?", default=None, help="an example to print (two_stages, ray_stages, ...)")
    p.add_argument("--json", action="store_true", help="list them as JSON")
    p.set_defaults(func=_cmd_examples)
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
    from omni_core.serve.adapter_cli import add_adapter_arguments
    from omni_core.serve.cli_args import add_remote_arguments, add_serve_arguments

    # allow_abbrev=False: `--api-key SECRET` must not be taken as `--api-key-file SECRET`.
    p = sub.add_parser(
        "serve",
        help="HTTP control plane for the stages of a TOML config (README: Serving over HTTP)",
        allow_abbrev=False,
    )
    add_serve_arguments(p)
    p.set_defaults(func=_cmd_serve)
    for verb, what in (
        ("status", "state of every stage of a running `omni-core serve`"),
        ("sleep", "put a stage of a running `omni-core serve` to sleep"),
        ("wake", "wake a stage of a running `omni-core serve`"),
        ("swap", "stage OUT of a running `omni-core serve` sleeps while stage IN wakes"),
    ):
        p = sub.add_parser(verb, help=what, allow_abbrev=False)
        add_remote_arguments(p, verb)
        p.set_defaults(func=_cmd_remote)
    for verb, what in CLIENT_VERBS.items():
        p = sub.add_parser(verb, help=what, allow_abbrev=False)
        _add_client_arguments(p, verb)
        p.set_defaults(func=_cmd_client)
    p = sub.add_parser(
        "adapters",
        help="list, add, remove or pin a stage's LoRA adapters on a running `omni-core serve`",
        allow_abbrev=False,
    )
    add_adapter_arguments(p)
    p.set_defaults(func=_cmd_adapters)
    return parser


def _version() -> str:
    import platform

    import omni_core

    return f"omni-core {omni_core.__version__} ({Path(omni_core.__file__).parent}, Python {platform.python_version()})"


def main(argv: list[str] | None = None) -> int:
    from omni_core.resources import MissingDataError

    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed pipe shows here, where it is caught, not at the interpreter's exit
        return code
    except MissingDataError as exc:
        print(f"omni-core {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`omni-core tables | head -1`): nothing more can be said to it.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        _quiet_stdout()
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


def _quiet_stdout() -> None:
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is no real file (a test's StringIO)
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":
    raise SystemExit(main())
