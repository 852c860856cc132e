"""The engine under fuzz, in a process of its own: `python -m omni_testing.fuzz.engine_host`.

Its own process so that the RSS measured is the engine's (orchestrator thread, ROUTER
socket, stage cores) and not the fuzzer's, and so that frame generation does not compete
with the orchestrator for one GIL. It starts an `Engine` with one small synthetic stage,
takes a reference result, and runs a client thread that keeps calling execute / sleep /
wake / reload_weights and checks every answer. The fuzzer talks to it over stdin/stdout,
one JSON object per line; lines it writes start with `@fz ` (the ranks inherit stdout).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_testing.fuzz.common import peak_rss_bytes, rss_bytes

LINE_PREFIX = "@fz "
STAGE = "fz"
REFERENCE_PAYLOAD = {"seed": 5, "batch": 2}
RUNNER_ARGS = {
    "weights_bytes": 256 << 10,
    "tensor_count": 4,
    "kv_bytes": 64 << 10,
    "hidden": 32,
    "seed": 7,
    "cpu_threads": 1,
}
CLIENT_PAUSE_S = 0.005  # between calls: the client checks correctness, it is not a load test
LIFECYCLE_EVERY_CALLS = 25  # a sleep/wake cycle after this many executes (levels alternate)
MAX_ERRORS_KEPT = 20


@dataclass
class ClientStats:
    executes: int = 0
    executes_ok: int = 0
    lifecycle_calls: int = 0
    lifecycle_ok: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)
    max_call_s: float = 0.0

    def error(self, text: str) -> None:
        self.errors += 1
        if len(self.error_samples) < MAX_ERRORS_KEPT:
            self.error_samples.append(text[:500])


class Client:
    """Calls the engine the way an application would and checks each answer."""

    def __init__(self, engine: Any, reference: Any) -> None:
        self.engine = engine
        self.reference = reference
        self.stats = ClientStats()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fuzz-client", daemon=True)

    def _timed(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            self.stats.max_call_s = max(self.stats.max_call_s, time.monotonic() - started)

    def _run(self) -> None:
        cycle = 0
        while not self.stop.is_set():
            for _ in range(LIFECYCLE_EVERY_CALLS):
                if self.stop.is_set():
                    return
                self._execute()
                time.sleep(CLIENT_PAUSE_S)
            cycle += 1
            self._cycle(cycle, level=1 if cycle % 2 else 2)

    def _execute(self) -> None:
        stats = self.stats
        stats.executes += 1
        try:
            output = self._timed(self.engine.execute, STAGE, REFERENCE_PAYLOAD)
        except Exception as exc:
            stats.error(f"execute: {type(exc).__name__}: {exc}")
            return
        if output == self.reference:
            stats.executes_ok += 1
        else:
            stats.error(f"execute: output differs from the reference: {str(output)[:200]}")

    def _cycle(self, cycle: int, level: int) -> None:
        steps: list[tuple[str, Any, str]] = [
            ("sleep", lambda: self.engine.sleep(STAGE, level=level, task_id=f"fz-sleep-{cycle}"), "SLEEPING"),
            (
                "wake",
                lambda: self.engine.wake(STAGE, task_id=f"fz-wake-{cycle}"),
                "RUNNING" if level == 1 else "NEEDS_RELOAD",
            ),
        ]
        if level == 2:
            steps.append(("reload", lambda: self.engine.reload_weights(STAGE, task_id=f"fz-reload-{cycle}"), "RUNNING"))
        for name, call, expected in steps:
            self.stats.lifecycle_calls += 1
            try:
                report = self._timed(call)
            except Exception as exc:
                self.stats.error(f"{name} (cycle {cycle}): {type(exc).__name__}: {exc}")
                return
            state = getattr(report.state, "value", report.state)
            if state == expected:
                self.stats.lifecycle_ok += 1
            else:
                self.stats.error(f"{name} (cycle {cycle}): state {state}, expected {expected}")
                return


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(LINE_PREFIX + json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def _orchestrator_alive() -> bool:
    return any(t.name == "omni-core-orchestrator" and t.is_alive() for t in threading.enumerate())


def _snapshot(engine: Any, client: Client | None) -> dict[str, Any]:
    started = time.monotonic()
    try:
        status = engine.status()
        error = None
    except Exception as exc:
        status, error = None, f"{type(exc).__name__}: {exc}"
    ranks = status[STAGE]["ranks"] if status else {}
    return {
        "status": status,
        "status_error": error,
        "status_s": round(time.monotonic() - started, 4),
        "client": asdict(client.stats) if client else None,
        "rss_bytes": rss_bytes(os.getpid()),
        "peak_rss_bytes": peak_rss_bytes(os.getpid()),
        "rank_rss_bytes": {str(r): rss_bytes(info["pid"]) for r, info in ranks.items()},
        "orchestrator_alive": _orchestrator_alive(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_testing.fuzz.engine_host", description=__doc__)
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args(argv)
    from omni_core.engine import Engine, StageSpec  # after argparse: --help stays fast

    spec = StageSpec(
        STAGE, runner_args=RUNNER_ARGS, ranks=args.ranks, backend="portable", deadline_s=60.0, request_timeout_s=60.0
    )
    try:
        engine = Engine([spec], transport=args.transport)
    except Exception as exc:
        _emit({"event": "failed", "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        return 1
    client: Client | None = None
    try:
        reference = engine.execute(STAGE, REFERENCE_PAYLOAD)
        status = engine.status()
        _emit(
            {
                "event": "ready",
                "address": engine.address,
                "pid": os.getpid(),
                "epoch": status[STAGE]["epoch"],
                "ranks": {str(r): info["pid"] for r, info in status[STAGE]["ranks"].items()},
            }
        )
        client = Client(engine, reference)
        client.thread.start()
        for line in sys.stdin:
            op = json.loads(line).get("op")
            if op == "status":
                _emit({"event": "status", **_snapshot(engine, client)})
            elif op == "pause":  # the client stops between calls; the fuzzer then reads the final state
                client.stop.set()
                client.thread.join(120)
                _emit({"event": "paused", "client_alive": client.thread.is_alive(), **_snapshot(engine, client)})
            elif op == "stop":
                break
    finally:
        if client is not None:
            client.stop.set()
            client.thread.join(120)
        engine.shutdown()
    _emit({"event": "stopped"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
