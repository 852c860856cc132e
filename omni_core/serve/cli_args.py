"""Arguments of `omni-core serve` and of the client verbs `status`, `sleep`, `wake`, `swap`.

Kept free of the server's dependencies: `omni-core --help` builds every parser.
There is deliberately no `--api-key`: a key on the command line is readable by every user of
the host (ps, /proc/*/cmdline) and stays in shell history. Use a file or OMNI_CORE_API_KEY.
"""

from __future__ import annotations

import argparse
import os

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "OMNI_CORE_URL"


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="TOML stage config (examples/two_stages.toml is one)")
    p.add_argument(
        "--host",
        default=None,
        help="interface to listen on (default [server] host, else 127.0.0.1); anything but loopback needs an API key",
    )
    p.add_argument("--port", type=int, default=None, help="port (default [server] port, else 8000; 0: any free)")
    p.add_argument(
        "--api-key-file",
        default=None,
        help="file holding the API key (else [server] api_key_file, else the OMNI_CORE_API_KEY environment variable)",
    )
    p.add_argument("--default-stage", default=None, help="the stage vLLM's /sleep, /wake_up ... act on")
    p.add_argument(
        "--allowed-host",
        action="append",
        default=None,
        metavar="NAME",
        help="a Host name the server answers to besides loopback and the bind address (repeatable; "
        "'*': any, which opens it to DNS rebinding)",
    )
    p.add_argument(
        "--allowed-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="a page origin (scheme://host:port) that may send state-changing requests (repeatable; '*': any)",
    )
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument(
        "--log-json",
        action="store_true",
        help="log one JSON object per line (time, level, logger, message and the event's fields: "
        "stage, command, outcome, rank, pid, ...) instead of text",
    )
    p.add_argument(
        "--access-log",
        action="store_const",
        const=True,
        default=None,
        help="log one line per HTTP answer (method, path, status, duration, client; at most 50 a "
        "second, the rest counted); else [server] access_log",
    )
    p.add_argument(
        "--write-openapi",
        default=None,
        metavar="PATH",
        help="write the OpenAPI schema (specs/openapi.json) and exit; starts nothing",
    )


def add_remote_arguments(p: argparse.ArgumentParser, verb: str) -> None:
    p.add_argument(
        "--url",
        default=os.environ.get(URL_ENV, DEFAULT_URL),
        help=f"where `omni-core serve` listens (default ${URL_ENV}, else {DEFAULT_URL})",
    )
    p.add_argument("--api-key-file", default=None, help="file holding the API key (else OMNI_CORE_API_KEY)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--timeout-s", type=float, default=None, help="deadline of the command (server side)")
    p.set_defaults(verb=verb)
    if verb == "status":
        p.add_argument("stage", nargs="?", default=None, help="one stage (default: all)")
        return
    if verb == "swap":
        p.add_argument("out_stage", metavar="OUT", help="the stage to put to sleep")
        p.add_argument("in_stage", metavar="IN", help="the stage to wake while OUT sleeps")
        p.add_argument(
            "--memory-wait-s",
            type=float,
            default=None,
            help="how long IN's ranks may wait for free device memory (default: half the deadline)",
        )
    else:
        p.add_argument("stage", help="stage name")
    p.add_argument(
        "--tags",
        action="append",
        default=None,
        help="tag to act on (repeatable; default: all)" + ("; of OUT" if verb == "swap" else ""),
    )
    p.add_argument("--idempotency-key", default=None, help="a retry with the same key has no second effect")
    if verb in ("sleep", "swap"):
        p.add_argument("--level", type=int, default=1, choices=(1, 2), help="1: offload weights; 2: discard all")
    if verb == "sleep":
        p.add_argument("--abort-in-flight", action="store_true", help="fail in-flight requests instead of draining")
