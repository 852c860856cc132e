"""Two rank processes of one stage on CPU (gloo), for the diffusers runner's parallel modes:
each runs `target(rank, port, args)` with RANK, WORLD_SIZE and MASTER_* set and returns what
it saw as plain data (bytes, not tensors: a tensor in a queue would outlive its process)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from typing import Any

import torch

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(target: Callable[..., dict[str, Any]], rank: int, port: int, args: Any, out: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        out.put((rank, target(rank, args)))
    except Exception as exc:  # the parent reports it
        import traceback

        out.put((rank, f"{exc!r}\n{traceback.format_exc()}"))


def run_ranks(target: Callable[..., dict[str, Any]], args: Any, timeout_s: float = 240.0) -> dict[int, dict[str, Any]]:
    """Each rank's result; a rank that raised fails the caller's assertion with its traceback."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_entry, args=(target, r, port, args, out), daemon=True) for r in range(WORLD)]
    for process in processes:
        process.start()
    try:
        results = dict(out.get(timeout=timeout_s) for _ in processes)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    failed = {rank: seen for rank, seen in results.items() if isinstance(seen, str)}
    assert not failed, failed
    return results
