"""What the long-run scripts (chaos_http.py, fuzz_http.py) share: the run's commit and machine
line, the RSS and descriptors of a process, and the end of the markdown report, a table of
targets that sets the exit status."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """The short hash of the checkout's HEAD: the code the run starts with."""
    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip()


def machine_line(commit_hash: str, *versions: str) -> str:
    """The report's line naming the commit, the machine and the versions that ran."""
    python = ", ".join((f"Python {platform.python_version()}", *versions))
    return (
        f"- commit: {commit_hash}; machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs shared, "
        f"{python})"
    )


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) * 1024


def descriptors(pid: int | str = "self") -> int:
    """Open file descriptors of a process, from /proc (Linux)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def finish(lines: list[str], targets: list[tuple[str, str, bool]], out: str | None) -> int:
    """Close the report with its table of targets (name, measured, met), print it, write it to
    `out` when given; the exit status: 0 when every target is met, else 1."""
    report = "\n".join(
        [
            *lines,
            "## Targets",
            "",
            "| target | measured | met |",
            "|---|---|---|",
            *[f"| {name} | {measured} | {'yes' if met else 'no'} |" for name, measured, met in targets],
            "",
        ]
    )
    print(report)
    if out:
        Path(out).write_text(report)
    return 0 if all(met for _, _, met in targets) else 1
