"""What `omni-core serve` says when a stage does not start: one line naming the stage, the
field of its config that is wrong where the rank's error shows it, and what to do, in place
of the engine's traceback (the rank's own log line above it keeps the full traceback)."""

from __future__ import annotations

import re

from omni_core.config import OmniConfig
from omni_core.engine.errors import StageFailedError

_UNEXPECTED = re.compile(r"unexpected keyword argument '([^']+)'")
_MISSING_ARG = re.compile(r"missing \d+ required (?:keyword-only |positional )?arguments?: (.+?)(?:$|\))")
_MISSING_PATH = re.compile(r"(No such file or directory|does not exist|not a directory|is not a local folder)", re.I)
_DEVICE = re.compile(r"(invalid device|CUDA|no CUDA|device ordinal|Torch not compiled with CUDA)", re.I)


def _field_hint(config: OmniConfig, stage: str, reason: str) -> str:
    spec = next((s for s in config.stages if s.name == stage), None)
    runner = spec.runner if spec is not None else "?"
    where = f"[[stages]] name = {stage!r} in {config.path}"
    if found := _UNEXPECTED.search(reason):
        return (
            f"runner_args.{found.group(1)} is not an argument of runner {runner!r}: fix or remove it "
            f"({where}, [stages.runner_args])"
        )
    if found := _MISSING_ARG.search(reason):
        return f"runner {runner!r} needs runner_args {found.group(1)}: add them ({where}, [stages.runner_args])"
    if _MISSING_PATH.search(reason):
        return f"a path the runner opens is missing: check runner_args.model and the other paths ({where})"
    if _DEVICE.search(reason):
        device = spec.device if spec is not None else "?"
        return f"device {device!r} is not usable here: check `device` and `devices` ({where})"
    return f"fix the stage's entry ({where}); the rank's log line above has its traceback"


def start_failure(exc: StageFailedError, config: OmniConfig) -> str:
    """One line: which stage did not start, why (each failed rank's reason), and what to change."""
    reasons = "; ".join(f"rank {rank}: {why}" for rank, why in sorted(exc.failures.items())) or str(exc)
    first = next(iter(sorted(exc.failures.items())), (0, str(exc)))[1]
    line = f"stage {exc.stage!r} did not start ({reasons[:600]}); {_field_hint(config, exc.stage, first)}"
    return " ".join(line.split())  # one line whatever the reasons held
