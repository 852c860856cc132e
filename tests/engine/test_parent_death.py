"""Ranks end with the engine's process from any state, a blocked weight-group join included:
SIGKILL the engine while every rank waits in a rendezvous that never answers, and the ranks
are gone within 10 s (polled for; their join alone would hold them for a minute)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GONE_WITHIN_S = 10.0
JOIN_CALL_S = 240.0  # the join may take half: far longer than the bound asserted
START_WAIT_S = 120.0

ENGINE = """
import json, sys
from omni_core.engine import Engine
from tests.engine.conftest import small_spec
engine = Engine([small_spec("r", ranks=2)])
pids = [info["pid"] for info in engine.status()["r"]["ranks"].values()]
print(json.dumps(pids), flush=True)
engine.init_weight_group("r", address="127.0.0.1", port=int(sys.argv[1]), world_size=3, timeout_s=float(sys.argv[2]))
"""

ORPHAN = """
import os, sys, time
from omni_core.workers.parent_watch import watch_parent
watch_parent(os.getppid(), 0.1, "orphan", 3)
print(os.getpid(), flush=True)
time.sleep(600)  # blocked, never back in a loop that checks its parent
"""

MIDDLE = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(child.stdout.readline().strip(), flush=True)
child.wait()
"""


def _gone(pid: int) -> bool:
    """Exited (no such process, or a zombie waiting for a reaper that may never come)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def _wait_gone(pids: list[int]) -> float:
    started = time.monotonic()
    while time.monotonic() - started < GONE_WITHIN_S:
        if all(_gone(pid) for pid in pids):
            return time.monotonic() - started
        time.sleep(0.05)
    alive = [pid for pid in pids if not _gone(pid)]
    for pid in alive:
        os.kill(pid, signal.SIGKILL)  # leave nothing behind for the next test
    raise AssertionError(f"ranks {alive} still alive {GONE_WITHIN_S} s after their parent was killed")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def test_ranks_blocked_in_a_join_end_when_the_engine_is_killed() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(START_WAIT_S)
    port = listener.getsockname()[1]
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(port), str(JOIN_CALL_S)], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        pids = json.loads(engine.stdout.readline())
        held = [listener.accept()[0] for _ in pids]  # every rank is now inside the rendezvous
        engine.kill()
        engine.wait(30)
        took_s = _wait_gone(pids)
        print(f"ranks gone {took_s:.2f} s after SIGKILL of the engine during a join")
        for conn in held:
            conn.close()
    finally:
        if engine.poll() is None:
            engine.kill()
        listener.close()


def test_the_watchdog_ends_a_blocked_process_whose_parent_died_without_a_death_signal() -> None:
    # The portable half alone: no PR_SET_PDEATHSIG, a main thread that never checks.
    middle = subprocess.Popen([sys.executable, "-c", MIDDLE, ORPHAN], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        orphan = int(middle.stdout.readline())
        middle.kill()
        middle.wait(30)
        _wait_gone([orphan])
    finally:
        if middle.poll() is None:
            middle.kill()
