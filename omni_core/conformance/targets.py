"""How the suite starts the worker under test.

A *target* names a factory: something called as `factory(address, rank, epoch)` each time
the suite needs a worker process, which must then connect a DEALER socket to `address`
and greet with `Hello(rank=rank, epoch=epoch)`. The factory returns one of:

- a list/tuple of strings: an argv the suite starts (`subprocess.Popen`, own session);
- a string: a shell command the suite starts (`/bin/sh -c`);
- a dict, or a msgspec Struct such as `omni_core.workers.WorkerConfig`: the configuration
  of this project's own worker process, started as `python -m omni_core.workers --config`
  (for a model that plugs into the reference worker as a runner);
- a process it started itself, with `poll()` (subprocess.Popen) or `is_alive()`
  (multiprocessing.Process) and `kill()`: the suite adopts it and kills it when done.

Target strings (CLI `--worker`, pytest `worker = ...`):

- `synthetic` or `reference`: this project's worker, synthetic runner, small sizes,
  portable backend, CPU;
- `cmd:<shell command>` with `{address}`, `{rank}`, `{epoch}` placeholders (replaced
  literally, so other braces, e.g. JSON, stay as they are), for workers in any language;
- `package.module:factory`: a factory as above, imported (the current directory is put on
  `sys.path` first, as pytest and gunicorn do).

The suite imports nothing of the worker besides the factory it is told to use, and talks
to the process over the socket only.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from omni_core.protocol.auth import RANK_SECRET_ENV, new_rank_secret

WorkerFactory = Callable[[str, int, int], Any]

# Small enough that a sleep/wake round trip takes milliseconds on a loaded CPU.
REFERENCE_RUNNER_ARGS: dict[str, Any] = {
    "weights_bytes": 256 << 10,
    "tensor_count": 4,
    "kv_bytes": 64 << 10,
    "hidden": 32,
    "seed": 7,
    "cpu_threads": 1,
}
REFERENCE_PAYLOAD: dict[str, Any] = {"seed": 1, "batch": 1}
BUILTIN_TARGETS = ("synthetic", "reference")
OUTPUT_TAIL_LINES = 15


class TargetError(ValueError):
    """A target string or a factory's return value that the suite cannot start."""


def reference_worker(address: str, rank: int, epoch: int) -> dict[str, Any]:
    """The project's worker: synthetic runner, portable backend, CPU (the `synthetic` target)."""
    return {
        "address": address,
        "rank": rank,
        "epoch": epoch,
        "stage": "conformance",
        "runner": "synthetic",
        "runner_args": dict(REFERENCE_RUNNER_ARGS),
        "backend": "portable",
        "device": "cpu",
        "parent_check_interval_s": 0.5,
    }


def failing_reference_worker(address: str, rank: int, epoch: int) -> dict[str, Any]:
    """The project's worker with a runner that cannot be imported: its start-up fails, so it
    greets in FAILED and refuses everything but Status and Shutdown (P-11)."""
    return {**reference_worker(address, rank, epoch), "runner": "omni_core.conformance.no_such_runner:Runner"}


def needs_reload_reference_worker(address: str, rank: int, epoch: int) -> dict[str, Any]:
    """The project's worker started as a restart under a version floor starts it: its weights
    loaded but not to be served, so it greets NEEDS_RELOAD at version 0 (the worker table's
    `loaded_needs_reload` row)."""
    return {**reference_worker(address, rank, epoch), "start_needs_reload": True}


def needs_reload_factory_for(target: str | WorkerFactory) -> WorkerFactory | None:
    """The NEEDS_RELOAD-greeting counterpart of a built-in target; None for any other (the user
    names one with `--needs-reload-worker`, or the case that needs it is skipped)."""
    if isinstance(target, str) and target.strip() in BUILTIN_TARGETS:
        return needs_reload_reference_worker
    return None


def failing_factory_for(target: str | WorkerFactory) -> WorkerFactory | None:
    """The failing counterpart of a built-in target; None for any other (the user names one
    with `--failing-worker`, or the case that needs it is skipped)."""
    if isinstance(target, str) and target.strip() in BUILTIN_TARGETS:
        return failing_reference_worker
    return None


def command_factory(template: str) -> WorkerFactory:
    """`cmd:` targets: fill the placeholders and run the line through the shell."""
    for needed in ("{address}", "{rank}"):
        if needed not in template:
            raise TargetError(
                f"cmd: target {template!r} lacks the {needed} placeholder; the worker "
                "must learn where to connect and which rank it is"
            )

    def start(address: str, rank: int, epoch: int) -> str:
        # Literal replacement, not str.format: a command line may hold JSON braces. Unquoted:
        # the suite's addresses are ipc:///tmp/omni-conf-<random>/router.sock, shell-safe.
        values = {"{address}": address, "{rank}": str(rank), "{epoch}": str(epoch)}
        return re.sub(r"\{address\}|\{rank\}|\{epoch\}", lambda m: values[m.group(0)], template)

    start.__name__ = f"cmd:{template}"
    return start


def import_factory(path: str) -> WorkerFactory:
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise TargetError(f"worker target {path!r} is not 'synthetic', 'cmd:<command>' or 'package.module:factory'")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TargetError(f"cannot import {module_name!r} (from target {path!r}): {exc}") from exc
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise TargetError(f"module {module_name!r} has no attribute {attr!r} (target {path!r})") from None
    if not callable(factory):
        raise TargetError(f"target {path!r} is {factory!r}, not a callable factory(address, rank, epoch)")
    return factory


def resolve_target(target: str | WorkerFactory) -> tuple[str, WorkerFactory]:
    """(description, factory) for a target string or a factory callable."""
    if callable(target):
        return getattr(target, "__qualname__", repr(target)), target
    if not isinstance(target, str) or not target.strip():
        raise TargetError(f"worker target must be a non-empty string or a callable, got {target!r}")
    target = target.strip()
    if target in BUILTIN_TARGETS:
        return f"{target} (omni-core reference worker, synthetic runner, portable backend)", reference_worker
    if target.startswith("cmd:"):
        return target, command_factory(target[4:].strip())
    return target, import_factory(target)


@dataclass
class WorkerProcess:
    """A worker process the suite started or adopted: liveness, exit code, output, kill."""

    description: str
    handle: Any  # subprocess.Popen or multiprocessing.Process
    output_path: str | None = None
    own_session: bool = False  # started by us with start_new_session: kill the whole group
    rank_secret: bytes | None = None  # given in its environment (P-14); None: a process we adopted

    @property
    def pid(self) -> int | None:
        return getattr(self.handle, "pid", None)

    def exit_code(self) -> int | None:
        """None while running."""
        if hasattr(self.handle, "poll"):
            return self.handle.poll()
        if self.handle.is_alive():
            return None
        return self.handle.exitcode

    def alive(self) -> bool:
        return self.exit_code() is None

    def wait(self, timeout_s: float) -> int | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.exit_code()
            if code is not None:
                return code
            time.sleep(0.02)
        return self.exit_code()

    def kill(self) -> None:
        if self.own_session and self.pid is not None and self.alive():
            # Our own session (its group id is our child's pid, held while the child lives):
            # the shell and everything it started, nothing else.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
        if self.alive():
            with contextlib.suppress(Exception):
                self.handle.kill()
        self.wait(5.0)
        if hasattr(self.handle, "join"):
            self.handle.join(1.0)

    def output_tail(self, lines: int = OUTPUT_TAIL_LINES) -> str:
        if not self.output_path:
            return ""
        try:
            with open(self.output_path, errors="replace") as f:
                text = f.read()
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


def launch(factory: WorkerFactory, address: str, rank: int, epoch: int, output_path: str) -> WorkerProcess:
    """Call the factory and start (or adopt) what it returns."""
    spec = factory(address, rank, epoch)
    if hasattr(spec, "poll") or hasattr(spec, "is_alive"):
        if not hasattr(spec, "kill"):
            raise TargetError(f"the factory returned {spec!r}, a process without kill()")
        return WorkerProcess(f"process {getattr(spec, 'pid', '?')} started by the factory", spec)
    if isinstance(spec, (Mapping, msgspec.Struct)):
        config = dict(spec) if isinstance(spec, Mapping) else msgspec.to_builtins(spec)
        config.setdefault("address", address)
        config.setdefault("rank", rank)
        config.setdefault("epoch", epoch)
        argv: Sequence[str] | str = [sys.executable, "-m", "omni_core.workers", "--config", json.dumps(config)]
        shell = False
        what = f"python -m omni_core.workers --config <{config.get('runner', 'synthetic')} runner>"
    elif isinstance(spec, str):
        argv, shell, what = spec, True, spec
    elif isinstance(spec, Sequence) and spec and all(isinstance(a, str) for a in spec):
        argv, shell, what = list(spec), False, " ".join(spec)
    else:
        raise TargetError(
            f"the factory returned {spec!r}; return an argv list, a shell command string, "
            "a WorkerConfig/dict, or a started process"
        )
    # Like an engine, the suite hands each worker a rank secret it must prove its Hello with.
    secret = new_rank_secret()
    env = dict(os.environ, **{RANK_SECRET_ENV: secret.hex()})
    with open(output_path, "ab") as out:
        try:
            proc = subprocess.Popen(
                argv,
                shell=shell,
                stdin=subprocess.DEVNULL,
                stdout=out,
                env=env,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise TargetError(f"cannot start {what!r}: {exc}") from exc
    return WorkerProcess(what, proc, output_path=output_path, own_session=True, rank_secret=secret)
