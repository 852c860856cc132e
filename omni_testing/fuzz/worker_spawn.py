"""The worker process under fuzzing: started as a launcher starts a rank (`python -m
omni_core.workers`, synthetic runner, CPU, portable backend), its output kept in a log file,
its Hello awaited on the fuzzer's ROUTER."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import msgspec
import zmq

from omni_core.isolation import LOG_MARK
from omni_core.protocol import Hello, decode
from omni_testing.fuzz.common import log_tail

START_TIMEOUT_S = 120.0  # torch import and model load on a loaded 2-core machine
KILL_WAIT_S = 10.0
LOG_TAIL_LINES = 30
ALL_LOG_LINES = 1_000_000
EXCERPT_LINES = 60  # of a handler's traceback, kept in its finding
MAX_EXCERPTS = 3


class WorkerHung(Exception):
    """The worker answered nothing in time (recorded as a finding already): replace it."""


class WorkerCrashed(Exception):
    """The worker process exited, or is in a state the oracle cannot leave: replace it."""


def spawn_worker(
    address: str, epoch: int, *, runner_args: dict[str, Any], max_frame_bytes: int, log_path: str
) -> subprocess.Popen:
    """Start rank 0 of stage "fuzz" connecting to `address`; its stdout and stderr go to `log_path`."""
    config = {
        "address": address,
        "rank": 0,
        "epoch": epoch,
        "stage": "fuzz",
        "runner": "synthetic",
        "runner_args": runner_args,
        "backend": "portable",
        "device": "cpu",
        "max_frame_bytes": max_frame_bytes,
        "parent_check_interval_s": 0.5,
        "parent_pid": os.getpid(),
    }
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "omni_core.workers", "--config", msgspec.json.encode(config).decode()],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
        )


def await_hello(sock: zmq.Socket, proc: subprocess.Popen, log_path: str) -> bytes:
    """The ROUTER identity of the worker once its Hello arrives; RuntimeError with its log's
    tail when it exits or stays silent for START_TIMEOUT_S."""
    deadline_at = time.monotonic() + START_TIMEOUT_S
    while True:
        left_ms = int((deadline_at - time.monotonic()) * 1000)
        if left_ms <= 0 or proc.poll() is not None:
            raise RuntimeError(
                f"the worker did not say Hello (exit code {proc.poll()}):\n{log_tail(log_path, LOG_TAIL_LINES)}"
            )
        if not sock.poll(min(left_ms, 200)):
            continue
        identity, *parts = sock.recv_multipart()
        if isinstance(decode(parts[-1]), Hello):
            return identity


def kill_worker(proc: subprocess.Popen | None) -> None:
    """Kill the worker if it still runs, and reap it."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(KILL_WAIT_S)


def handler_raised_lines(log_path: str) -> int:
    """Lines in the worker's log where its loop's isolation caught a handler that raised."""
    return log_tail(log_path, ALL_LOG_LINES).count(LOG_MARK)


def handler_raised_excerpts(log_path: str) -> str:
    """Each isolation line of the worker's log with the traceback that follows it (up to
    EXCERPT_LINES lines, the first MAX_EXCERPTS of them): the frame that raised and where,
    which the log's tail, written on by later frames, no longer shows."""
    lines = log_tail(log_path, ALL_LOG_LINES).splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if LOG_MARK in line][:MAX_EXCERPTS]
    return "".join("".join(lines[i : i + EXCERPT_LINES]) for i in starts)
