"""Shared bits of the conformance tests: paths, the CLI in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DOC = REPO / "docs" / "conformance.md"
SPEC = REPO / "specs" / "protocol.md"


def env() -> dict[str, str]:
    """The environment of a child: this interpreter's bin first on PATH (omni-core, python)."""
    out = dict(os.environ)
    out["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{out.get('PATH', '')}"
    out.pop("PYTEST_ADDOPTS", None)
    return out


def start(args: list[str] | str, cwd: Path, *, shell: bool = False) -> subprocess.Popen:
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=env(),
        shell=shell,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        executable="/bin/bash" if shell else None,
    )


def finish(proc: subprocess.Popen, timeout_s: float = 120) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -9, out + f"\n<killed after {timeout_s} s>"
    return proc.returncode, out


def omni_core(*args: str, cwd: Path, timeout_s: float = 120) -> tuple[int, str]:
    return finish(start([sys.executable, "-m", "omni_core.cli", "conformance", *args], cwd), timeout_s)
