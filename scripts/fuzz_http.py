#!/usr/bin/env python
"""Long HTTP fuzz campaign: `omni-core serve` in its own process, on two synthetic stages,
fuzzed over a socket from its OpenAPI document (tests/serve/http_fuzz.py: every route, schema
cases and hostile ones) round after round with a new seed, until the time is up.

    .venv/bin/python scripts/fuzz_http.py --minutes 10 --out benchmarks/results/fuzz_http.md

Reports requests, answers by status, 5xx (500s apart), hangs (no answer within
--request-timeout-s), problems found, and the server's RSS and descriptors before and after.
Exit 1 when a target is missed. Not part of CI (minutes); the CI run is
tests/serve/test_fuzz_http.py.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import run_report  # noqa: E402
import schemathesis  # noqa: E402
from requests.exceptions import ConnectionError as RequestsConnectionError  # noqa: E402
from requests.exceptions import Timeout  # noqa: E402

from tests.serve import http_fuzz  # noqa: E402

CONFIG = """
[server]
host = "127.0.0.1"
port = {port}

[[stages]]
name = "talker"
ranks = 2
backend = "portable"
deadline_s = 10.0
request_timeout_s = 10.0
[stages.runner_args]
weights_bytes = 2097152
tensor_count = 4
kv_bytes = 262144
cpu_threads = 1

[[stages]]
name = "decoder"
backend = "portable"
deadline_s = 10.0
request_timeout_s = 10.0
[stages.runner_args]
weights_bytes = 2097152
tensor_count = 4
kv_bytes = 262144
cpu_threads = 1
"""
RSS_GROWTH_TARGET_BYTES = 64 << 20
STARTUP_S = 120.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"omni-core serve exited with {proc.returncode} before answering")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling for the server to come up, not proving anything
    raise SystemExit(f"omni-core serve did not answer /health within {STARTUP_S} s")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--examples-per-route", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout-s", type=float, default=60.0, help="no answer by then counts as a hang")
    p.add_argument("--out", default=None, help="write the markdown report here")
    args = p.parse_args()

    commit = run_report.commit()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "fuzz.toml"
        config.write_text(CONFIG.format(port=port))
        log_path = Path(tmp) / "serve.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(ROOT / ".venv/bin/omni-core"), "serve", "--config", str(config), "--log-level", "warning"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_up(url, proc)
            rss_before, fds_before = run_report.rss_bytes(proc.pid), run_report.descriptors(proc.pid)
            schema = schemathesis.openapi.from_url(url + "/openapi.json")

            def call(case: object) -> tuple[int | None, bytes]:
                try:
                    response = case.call(base_url=url, timeout=args.request_timeout_s)  # type: ignore[attr-defined]
                except (Timeout, RequestsConnectionError):
                    return None, b""
                return response.status_code, response.content

            tally = http_fuzz.Tally()
            started = time.monotonic()
            until = started + args.minutes * 60
            rounds = 0
            while time.monotonic() < until:
                http_fuzz.fuzz(
                    schema,
                    call,
                    stage_names=["talker", "decoder"],
                    seed=args.seed + rounds,
                    examples_per_route=args.examples_per_route,
                    tally=tally,
                    until=until,
                )
                rounds += 1
                print(
                    f"round {rounds}: {tally.requests} requests, {len(tally.problems)} problems, "
                    f"{tally.hangs} hangs, RSS {run_report.rss_bytes(proc.pid) >> 20} MiB",
                    flush=True,
                )
            elapsed_s = time.monotonic() - started
            alive = proc.poll() is None
            health = httpx.get(url + "/health", timeout=10.0).status_code if alive else None
            rss_after, fds_after = (
                (run_report.rss_bytes(proc.pid), run_report.descriptors(proc.pid)) if alive else (0, 0)
            )
        finally:
            proc.terminate()
            proc.wait(30)
        log_lines = log_path.read_text(errors="replace").count("\n")
    server_errors = sum(n for s, n in tally.by_status.items() if s >= 500)
    five_hundreds = tally.by_status.get(500, 0)
    growth = rss_after - rss_before
    targets = [
        ("no 500 answer", str(five_hundreds), five_hundreds == 0),
        ("no hang (answer within the request timeout)", str(tally.hangs), tally.hangs == 0),
        ("every error a JSON body naming what went wrong", f"{len(tally.problems)} problems", not tally.problems),
        ("the server alive and healthy at the end", f"alive={alive}, /health {health}", alive and health == 200),
        (
            f"server RSS growth under {RSS_GROWTH_TARGET_BYTES >> 20} MiB",
            f"{growth / 2**20:+.1f} MiB",
            alive and growth < RSS_GROWTH_TARGET_BYTES,
        ),
    ]
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(tally.by_status.items()))
    lines = [
        "# HTTP fuzz campaign (Schemathesis, every route)",
        "",
        f"- command: `.venv/bin/python scripts/fuzz_http.py --minutes {args.minutes:g} --examples-per-route "
        f"{args.examples_per_route} --seed {args.seed}`",
        run_report.machine_line(commit, f"schemathesis {schemathesis.__version__}"),
        "- server: `omni-core serve` in its own process, two synthetic stages (talker 2 ranks, decoder 1), no key",
        f"- ran {elapsed_s:.0f} s, {rounds} rounds (seeds {args.seed}..{args.seed + rounds - 1})",
        f"- requests: {tally.requests} (plus {tally.unsendable} cases the client could not encode)",
        f"- answers by status: {statuses}",
        f"- 5xx: {server_errors} ({five_hundreds} of them 500; 503/504 are the engine's own answers)",
        f"- hangs: {tally.hangs}",
        f"- server RSS: {rss_before / 2**20:.1f} MiB before, {rss_after / 2**20:.1f} MiB after; descriptors "
        f"{fds_before} before, {fds_after} after; {log_lines} log lines",
        "",
        "## Problems",
        "",
        *([f"- {p}" for p in tally.problems[:20]] or ["none"]),
        "",
    ]
    return run_report.finish(lines, targets, args.out)


if __name__ == "__main__":
    sys.exit(main())
