"""Benchmarks: the memory path (sleep/wake GB/s per backend, on a GPU) and the control
plane (protocol round trips of a stage with N rank processes, on CPU). Run from the root of
a checkout: `python -m benchmarks --help`."""

from __future__ import annotations

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]


def child_env() -> dict[str, str]:
    """The environment of a benchmark's child process. `benchmarks` is not installed with
    omni-core, so a child started with `-m benchmarks.X` finds it through the checkout,
    whatever its working directory."""
    paths = [str(CHECKOUT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
