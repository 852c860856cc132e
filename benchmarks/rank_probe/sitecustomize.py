"""Times a rank's steps around each effect, loaded into every Python process started with this
folder first on PYTHONPATH and OMNI_PROBE_TIMINGS naming a file to append to (device runs
only; nothing in omni-core imports it). Used for weight_sync.md's run 5:

    export OMNI_PROBE_TIMINGS=/tmp/probe.txt PYTHONPATH=$PWD/benchmarks/rank_probe:$PYTHONPATH
    python -m benchmarks --weight-sync --ws-parts synthetic --out $OUT/wsp

Each `_perform` appends one line: the effect's type and, for every wrapped method of
`omni_core.workers.process.WorkerProcess` called since the last line, its total time and calls.
A line is written as each effect ends (not at exit: a rank may leave with os._exit)."""

from __future__ import annotations

import builtins
import collections
import functools
import os
import sys
import time
from typing import Any

WRAPPED = ("_figure", "_usage", "_send_all", "_perform", "_apply", "handle")
_spent: dict[str, list[float]] = collections.defaultdict(list)


def _timed(name: str, method: Any) -> Any:
    @functools.wraps(method)
    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            _spent[name].append(time.perf_counter() - started)
            if name == "_perform":
                effect = type(args[0]).__name__ if args else "?"
                totals = ", ".join(f"{n}={sum(v) * 1e3:.3f}ms/{len(v)}" for n, v in _spent.items())
                with open(os.environ["OMNI_PROBE_TIMINGS"], "a") as out:
                    out.write(f"pid {os.getpid()} {effect}: {totals}\n")
                _spent.clear()

    return timed


def _install_when_loaded() -> None:
    real_import = builtins.__import__
    done = False

    def hooked(name: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal done
        module = real_import(name, *args, **kwargs)
        process = sys.modules.get("omni_core.workers.process")
        if not done and process is not None and hasattr(process, "WorkerProcess"):
            done = True
            for attr in WRAPPED:
                setattr(process.WorkerProcess, attr, _timed(attr, getattr(process.WorkerProcess, attr)))
        return module

    builtins.__import__ = hooked


if os.environ.get("OMNI_PROBE_TIMINGS"):
    _install_when_loaded()
