"""`omni-core conformance --worker TARGET [--junit FILE] [--only P-3,P-7]`."""

from __future__ import annotations

import argparse
import json
import sys

EXIT_PASSED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2

TARGET_HELP = (
    "the worker under test: 'synthetic' (this project's reference worker), "
    "'cmd:<shell command with {address} {rank} {epoch}>', or 'package.module:factory' "
    "(a callable (address, rank, epoch) returning an argv, a shell command, a WorkerConfig "
    "or a started process)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker", required=True, metavar="TARGET", help=TARGET_HELP)
    p.add_argument("--junit", metavar="FILE", help="also write the results as JUnit XML")
    p.add_argument("--only", metavar="P-n,...", help="check only these requirements, e.g. P-3,P-7")
    p.add_argument(
        "--payload",
        metavar="JSON",
        default=None,
        help='Execute payload the worker\'s model accepts (default: the synthetic runner\'s {"seed": 1, "batch": 1})',
    )
    p.add_argument("--reply-timeout", type=float, default=10.0, metavar="S", help="deadline of every reply")
    p.add_argument("--start-timeout", type=float, default=60.0, metavar="S", help="deadline of the Hello")
    p.add_argument(
        "--case-timeout",
        type=float,
        default=120.0,
        metavar="S",
        help="limit of one whole case, however many replies it waits for",
    )
    p.add_argument(
        "--failing-worker",
        metavar="TARGET",
        default=None,
        help="a worker whose start-up fails (it greets in FAILED), to check that Shutdown leaves "
        "FAILED; built in for 'synthetic', else that case is skipped",
    )
    p.add_argument(
        "--needs-reload-worker",
        metavar="TARGET",
        default=None,
        help="a worker that greets NEEDS_RELOAD (its weights loaded, not to be served), to check it "
        "serves nothing until a reload; built in for 'synthetic', else that case is skipped",
    )
    p.add_argument(
        "--memory-pressure",
        metavar="package.module:factory",
        default=None,
        help="a factory of memory-pressure hooks (omni_core.conformance.pressure) that start the "
        "worker on a device they can fill, for the P-16 NO_MEMORY case; built in for "
        "'synthetic', else that case is skipped",
    )
    p.add_argument("--epoch", type=int, default=3, help="epoch the workers are started in (>= 1)")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per case as well")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of text")
    p.add_argument("--quiet", action="store_true", help="no progress line (it is shown only on a terminal anyway)")


def run(args: argparse.Namespace) -> int:
    from omni_core.conformance.harness import SuiteOptions
    from omni_core.conformance.pressure import resolve_pressure
    from omni_core.conformance.runner import parse_only, run_suite
    from omni_core.conformance.targets import TargetError, resolve_target

    try:
        only = parse_only(args.only)
        resolve_target(args.worker)
        for other in (args.failing_worker, args.needs_reload_worker):
            if other is not None:
                resolve_target(other)
        if args.memory_pressure is not None:
            resolve_pressure(args.memory_pressure)
        fields = {
            "reply_timeout_s": args.reply_timeout,
            "start_timeout_s": args.start_timeout,
            "epoch": args.epoch,
            "case_timeout_s": args.case_timeout,
            "failing_worker": args.failing_worker,
            "needs_reload_worker": args.needs_reload_worker,
            "memory_pressure": args.memory_pressure,
        }
        if args.payload is not None:
            fields["execute_payload"] = json.loads(args.payload)
        options = SuiteOptions(**fields)
    except (TargetError, ValueError) as exc:
        print(f"omni-core conformance: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from omni_core.progress import Progress

    with Progress("conformance", unit="cases", enabled=False if args.quiet else None) as progress:
        report = run_suite(args.worker, only=only, options=options, progress=progress)
    if args.json:
        print(json.dumps(report.to_json(), indent=2), flush=True)
    else:
        print(report.render(verbose=args.verbose), flush=True)
    if args.junit:
        report.write_junit(args.junit)
        print(f"wrote {args.junit}", file=sys.stderr if args.json else sys.stdout)
    return EXIT_FAILED if report.failed else EXIT_PASSED


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omni-core conformance", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
