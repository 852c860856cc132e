"""The package as a user gets it: a wheel built from this checkout, installed in a fresh
environment outside it, run from a folder outside it.

The fresh venv gets only the wheel (`--no-deps --no-index`); its dependencies come from the
test's own environment through a `.pth` line (what `--system-site-packages` does for a base
interpreter), so the test needs no network and takes seconds to install. That environment's
editable omni-core is not activated there (a `.pth` folder's own `.pth` files are not run), and
the test checks that `omni-core` runs from the wheel's copy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from omni_core.formal.tlc import TlcNotFoundError, find_jar, find_java
from omni_core.resources import SHIPPED

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "omni_core", *SHIPPED)
SERVE_START_S = 90.0  # every rank of two stages starts on a shared two-core machine


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
    said = f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}\n{said}"
    return done


def _copy_sources(tmp: Path) -> Path:
    """A copy, so a build leaves no build/ or egg-info in the checkout."""
    source = tmp / "source"
    source.mkdir()
    for name in SOURCES:
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, source / name)
    return source


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the fresh venv's bin folder, a work folder outside the checkout, its environment)."""
    tmp = tmp_path_factory.mktemp("wheel")
    source = _copy_sources(tmp)
    dist = tmp / "dist"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    wheels = sorted(dist.glob("omni_core-*.whl"))
    if build.returncode != 0 or not wheels:
        pytest.skip(
            f"the wheel could not be built here (pip wheel exited {build.returncode}; setuptools>=77 and "
            f"wheel are needed without build isolation): {build.stderr[-500:]}"
        )
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp, dict(os.environ))
    python = venv / "bin" / "python"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheels[0]),
        ],
        tmp,
        dict(os.environ),
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "omni_core_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv / "bin", work, env


def test_the_wheel_carries_the_spec_the_schemas_and_the_examples(installed) -> None:
    bin_dir, work, env = installed
    code = (
        "import json, omni_core.resources as r, omni_core\n"
        "print(json.dumps({'package': omni_core.__file__, **{n: str(r.data_dir(n)) for n in r.SHIPPED}}))"
    )
    where = json.loads(_run([str(bin_dir / "python"), "-c", code], work, env).stdout)
    package = Path(where.pop("package")).parent
    assert not package.is_relative_to(ROOT), f"omni_core was imported from the checkout: {package}"
    for name, path in where.items():
        assert Path(path) == package / "_data" / name, (name, path)
    for relative in (
        "tla/manifest.json",
        "tla/trace/OmniTrace.tla",
        "specs/protocol.md",
        "specs/messages.schema.json",
        "specs/openapi.json",
        "examples/two_stages.toml",
    ):
        assert (package / "_data" / relative).is_file(), relative
    assert (package / "py.typed").is_file()
    assert "omni-core 0.1.0" in _run([str(bin_dir / "omni-core"), "--version"], work, env).stdout


@pytest.mark.slow
def test_check_trace_from_the_installed_wheel(installed) -> None:
    try:
        find_java(), find_jar()
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))
    bin_dir, work, env = installed
    trace = work / "demo.jsonl"
    _run([str(bin_dir / "omni-core"), "demo", "--synthetic", "--weights-mib", "1", "--trace", str(trace)], work, env)
    # One stage keeps the TLC part short; the whole trace is checked by scripts/test.sh.
    done = _run(
        [str(bin_dir / "omni-core"), "check", "--trace", str(trace), "--stage", "decoder", "--json", "-"], work, env
    )
    assert "decoder" in done.stderr and "0 diverged" in done.stderr, done.stderr  # the text, beside the JSON
    report = json.loads(done.stdout)
    assert report["accepted"] is True and [v["stage"] for v in report["verdicts"]] == ["decoder"], report
    listed = _run([str(bin_dir / "omni-core"), "check", "--list"], work, env).stdout
    assert listed.startswith("happy ") or "\nhappy " in listed, listed  # rc 0: not refused as stale or missing


@pytest.mark.slow
def test_conformance_from_the_installed_wheel(installed) -> None:
    bin_dir, work, env = installed
    out = _run([str(bin_dir / "omni-core"), "conformance", "--worker", "synthetic", "--only", "P-1"], work, env).stdout
    assert "P-1   PASS" in out and "PASSED" in out, out


@pytest.mark.slow
def test_serve_from_the_installed_wheel_answers_health(installed) -> None:
    bin_dir, work, env = installed
    config = work / "stages.toml"
    config.write_text(_run([str(bin_dir / "omni-core"), "examples", "two_stages"], work, env).stdout)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [str(bin_dir / "omni-core"), "serve", "--config", str(config), "--port", str(port)]
    server = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        health = None
        deadline = time.monotonic() + SERVE_START_S
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    health = (response.status, json.loads(response.read()))
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):  # a loaded machine: not up yet
                time.sleep(0.5)
        assert health is not None, f"serve never answered /health (exit {server.poll()})"
        assert health[0] == 200, health
    finally:
        server.send_signal(signal.SIGINT)
        try:
            output, _ = server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            output, _ = server.communicate()
    assert server.returncode == 0, output[-3000:]


def test_the_sdist_carries_what_the_wheel_copies_in(tmp_path) -> None:
    """`python -m build` makes the wheel from the sdist: the shipped folders must be in it."""
    source = _copy_sources(tmp_path)
    code = f"from setuptools import build_meta; print(build_meta.build_sdist({str(tmp_path / 'dist')!r}))"
    name = _run([sys.executable, "-c", code], source, dict(os.environ)).stdout.strip().splitlines()[-1]
    with tarfile.open(tmp_path / "dist" / name) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for relative in (
        "setup.py",
        "omni_core/py.typed",
        "tla/manifest.json",
        "tla/trace/OmniTrace.tla",
        "specs/protocol.md",
        "examples/two_stages.toml",
    ):
        assert relative in names, relative
