"""`omni_core.protocol` and `omni_core.fsm` are sans-IO (the etcd-raft core): importing them
pulls in no torch, no sockets, no engine; and their source imports nothing that reads a
clock, the environment, randomness or the network, so the same input gives the same output."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "omni_core"
SANS_IO_DIRS = (PACKAGE / "protocol", PACKAGE / "fsm")

FORBIDDEN_MODULES = ("torch", "zmq", "socket", "asyncio", "time", "threading", "os", "random")
FORBIDDEN_LOADED = ("torch", "zmq", "socket", "asyncio", "omni_core.workers", "omni_core.engine", "omni_core.transport")


def test_importing_the_cores_loads_no_io_modules() -> None:
    code = "import json, sys\nimport omni_core.protocol, omni_core.fsm\nprint(json.dumps(sorted(sys.modules)))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    offenders = sorted(m for m in loaded for bad in FORBIDDEN_LOADED if m == bad or m.startswith(bad + "."))
    assert not offenders, f"importing omni_core.protocol/fsm loaded {offenders}"
    assert "omni_core.fsm" in loaded and "omni_core.protocol" in loaded


def _sources() -> list[Path]:
    files = sorted(p for d in SANS_IO_DIRS for p in d.rglob("*.py"))
    assert files, "no sources found"
    return files


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.append((node.lineno, str(node.args[0].value)))
    return found


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_io_imports_in_the_cores(path: Path) -> None:
    bad = [
        f"line {line}: import {name}"
        for line, name in _imports(path)
        if name.split(".")[0] in FORBIDDEN_MODULES
        or name.startswith(("omni_core.workers", "omni_core.engine", "omni_core.transport"))
    ]
    assert not bad, f"{path.relative_to(PACKAGE.parent)} is sans-IO but has {bad}"


def test_the_static_check_sees_imports() -> None:
    """The checker itself: it must catch each spelling of an import."""
    import tempfile

    text = "import os\nfrom time import monotonic\nimport zmq.asyncio as z\nx = __import__('random')\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(text)
    names = [name for _, name in _imports(Path(f.name))]
    Path(f.name).unlink()
    assert names == ["os", "time", "zmq.asyncio", "random"]
