"""benchmarks/refit_asleep.py in CI: a small rollout on CPU refitted asleep, then woken, serves
the new version with its weights pool untouched by the refit; the wake-then-update way maps it."""

from __future__ import annotations

import torch

from benchmarks.refit_asleep import GiB, measure, render


def test_the_refit_asleep_benchmark_runs_small_on_cpu() -> None:
    weights_bytes = 4 << 20
    runs, extra = measure(torch.device("cpu"), weights_bytes)
    wake, refit, baseline = runs
    assert all(r.equal for r in runs), runs
    assert refit.peak_bytes == 0 and baseline.peak_bytes >= weights_bytes  # the weights pool after each update
    text = render(runs, torch.device("cpu"), weights_bytes, "test", extra)
    assert text.rstrip().splitlines()[-1].startswith("| outputs equal") and "## Targets" in text
    assert wake.seconds > 0 and weights_bytes < GiB
