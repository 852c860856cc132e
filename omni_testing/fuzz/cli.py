"""`python -m omni_testing.fuzz --target worker|engine --frames N --seed S [--time-box-s T] [--out DIR]`.

Prints a progress line every few seconds (frames/s), then a summary: frames sent, replies,
crashes, hangs, memory before/after, duration. Writes the report as JSON to --out. Exit
status 0 only when there were no crashes, hangs or violations and memory stayed flat.
"""

from __future__ import annotations

import argparse
import sys

from omni_testing.fuzz.common import MAX_RSS_GROWTH_BYTES, FuzzReport, write_report


def _emit(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_target(args: argparse.Namespace, transport: str) -> FuzzReport:
    if args.target == "worker":
        from omni_testing.fuzz.worker_target import WorkerFuzzConfig, WorkerFuzzer

        config = WorkerFuzzConfig(
            seed=args.seed,
            frames=args.frames,
            time_box_s=args.time_box_s,
            transport=transport,
            probe_every_frames=args.probe_every,
            big_every_frames=args.big_every,
            socket_drop_frames=args.socket_drop_frames,
            warmup_frames=args.warmup_frames,
            max_rss_growth_bytes=args.max_rss_growth_mib << 20,
            progress_interval_s=args.progress_s,
            out_dir=args.out,
            withhold_known_issues=not args.send_known_issues,
            schema_share=args.schema_share,
        )
        return WorkerFuzzer(config, emit=_emit).run()
    from omni_testing.fuzz.engine_target import EngineFuzzConfig, EngineFuzzer

    config = EngineFuzzConfig(
        seed=args.seed,
        frames=args.frames,
        time_box_s=args.time_box_s,
        transport=transport,
        probe_every_frames=args.probe_every * 5,
        big_every_frames=args.big_every,
        warmup_frames=args.warmup_frames,
        max_rss_growth_bytes=args.max_rss_growth_mib << 20,
        progress_interval_s=args.progress_s,
        out_dir=args.out,
        schema_share=args.schema_share,
    )
    return EngineFuzzer(config, emit=_emit).run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m omni_testing.fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", choices=("worker", "engine"), required=True)
    parser.add_argument("--frames", type=int, default=10_000, help="fuzzed frames to send (default 10000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-box-s", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--out", default=None, help="directory for the JSON report and reproducers")
    parser.add_argument(
        "--transport",
        choices=("ipc", "tcp", "both"),
        default="ipc",
        help="ipc, tcp (loopback) or both one after the other (time box split)",
    )
    parser.add_argument(
        "--probe-every",
        type=int,
        default=200,
        help="worker: frames between oracle rounds (engine: 5x this between probes)",
    )
    parser.add_argument(
        "--big-every", type=int, default=0, help="every N-th frame is at or just over the frame limit (64 MiB); 0: none"
    )
    parser.add_argument(
        "--socket-drop-frames",
        action="store_true",
        help="worker: big frames may exceed the socket limit (zmq drops the link)",
    )
    parser.add_argument(
        "--send-known-issues",
        action="store_true",
        help="worker: also send frames that trigger reported open bugs (known_issues.py)",
    )
    parser.add_argument("--warmup-frames", type=int, default=2_000, help="RSS 'before' is taken after these")
    parser.add_argument("--max-rss-growth-mib", type=int, default=MAX_RSS_GROWTH_BYTES >> 20)
    parser.add_argument(
        "--schema-share",
        type=float,
        default=0.0,
        help="share of frames derived from the wire schema (fuzz/schema.py), 0 to 1",
    )
    parser.add_argument("--progress-s", type=float, default=5.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    transports = ("ipc", "tcp") if args.transport == "both" else (args.transport,)
    if args.time_box_s is not None:
        args.time_box_s /= len(transports)
    ok = True
    for transport in transports:
        report = run_target(args, transport)
        print(report.summary(), flush=True)
        if args.out:
            print(f"report: {write_report(report, args.out)}", flush=True)
        ok = ok and report.ok
    return 0 if ok else 1
