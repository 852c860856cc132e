"""Refit of a rollout asleep at level 1, then its wake (issue 42 item 3, P-17 rule 10).

A trainer in this process holds new weights (on the GPU: CUDA IPC buckets; on CPU: shared
memory); the rollout stage (synthetic runner, `--weights-gib` of weights) sleeps at level 1.
Two ways to bring it up at the new version, each timed and sampled for device memory:

- **refit asleep** (host_refit): `update_weights` while SLEEPING writes the host copy (device to
  host from the trainer's buckets, or host to host), the trainer then releases its buckets, and
  the wake maps the new version;
- **wake, then update** (what a rollout without host_refit does): the wake maps the old version
  while the trainer still holds the new one, then the update copies it in.

Against a plain **wake** of the same stage, and the output after each equal to a runner in
this process holding the new weights. Device memory on a GPU is sampled device-wide every 2 ms
(the machine runs nothing else: the trainer and the rollout are its only processes); on CPU
the rollout's weights pool as its reports give it (the device untouched: 0 bytes through the
refit).

    python -m benchmarks.refit_asleep --device cuda --weights-gib 16 --out benchmarks/results/refit_asleep_gpu.md
    python -m benchmarks.refit_asleep --device cpu --weights-gib 0.25 --out benchmarks/results/refit_asleep.md
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

GiB = 1 << 30
TENSORS = 64
PROBE = {"seed": 3, "batch": 2}
WAKE_TARGET_RATIO = 1.2  # refit + wake against the wake alone
PEAK_SLACK_BYTES = GiB  # over max(trainer, rollout)


@dataclass
class Run:
    name: str
    seconds: float
    peak_bytes: int  # device-wide peak over the phase (GPU), or the rollout's weights pool (CPU)
    equal: bool


class DevicePeak:
    """The device's used bytes, sampled on a thread while a phase runs (GPU only)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.peak_bytes, self._stop = device, 0, threading.Event()

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    @contextmanager
    def sampling(self) -> Iterator[None]:
        self.peak_bytes, self._stop = self._used(), threading.Event()

        def sample() -> None:
            while not self._stop.wait(0.002):
                self.peak_bytes = max(self.peak_bytes, self._used())

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()
            self.peak_bytes = max(self.peak_bytes, self._used())


def _runner_args(weights_bytes: int) -> dict[str, Any]:
    return {"weights_bytes": weights_bytes, "tensor_count": TENSORS, "kv_bytes": 1 << 20, "cpu_threads": 1}


def _new_weights(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], device: torch.device, seed: int) -> dict:
    """The trainer's weights of `seed`, the same bytes at every call."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return {n: torch.randn(s, generator=gen, dtype=d, device=device) * 0.05 for n, (s, d) in specs.items()}


def _timed(peak: DevicePeak | None, step: Callable[[], None]) -> tuple[float, int]:
    started = time.perf_counter()
    if peak is None:
        step()
        return time.perf_counter() - started, 0
    with peak.sampling():
        step()
    return time.perf_counter() - started, peak.peak_bytes


def _expected(device: torch.device, weights_bytes: int, versions: tuple[int, ...]) -> tuple[dict, dict[int, str]]:
    """The probe's digest for each version's weights from a runner in this process, which is
    gone (its memory too) before the stage is measured."""
    from omni_core.runners.synthetic import SyntheticRunner

    runner = SyntheticRunner(device, **_runner_args(weights_bytes))
    runner.load_weights()
    runner.allocate_caches()
    specs = dict(runner.weight_specs())
    digests = {}
    for version in versions:
        runner.update_weights(_new_weights(specs, device, version).items())
        digests[version] = runner.execute(PROBE)["sha256"]
    del runner
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return specs, digests


def measure(device: torch.device, weights_bytes: int) -> tuple[list[Run], dict[str, Any]]:
    from omni_core.engine import Engine, StageSpec

    backend = "cumem" if device.type == "cuda" else "portable"
    specs, expected = _expected(device, weights_bytes, (1, 2))
    spec = StageSpec(
        "rollout", runner_args=_runner_args(weights_bytes), backend=backend, device=device.type, deadline_s=600.0
    )
    peak = DevicePeak(device) if device.type == "cuda" else None
    with Engine([spec]) as engine:
        engine.sleep("rollout", 1)
        wake_s, wake_peak = _timed(peak, lambda: engine.wake("rollout"))
        runs = [Run("wake alone", wake_s, wake_peak, True)]
        for version, asleep in ((1, True), (2, False)):
            runs.append(
                _one_refit(engine, peak, _new_weights(specs, device, version), version, asleep, expected[version])
            )
    return runs, {"backend": backend}


def _one_refit(engine: Any, peak: DevicePeak | None, new: dict, version: int, asleep: bool, expected: str) -> Run:
    """Refit asleep (or wake, then update) to `version`; the trainer's buckets go before the
    wake of a refit asleep, after the update of the other way."""
    from omni_core.weights_sender import WeightSender

    engine.sleep("rollout", 1)
    pool_bytes = [0]
    with WeightSender(bucket_bytes=256 << 20) as sender:
        source = sender.share(new)
        new.clear()  # the trainer holds its buckets only
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

        def refit() -> None:
            if asleep:
                report = engine.update_weights("rollout", source, version=version)
                pool_bytes[0] = report.ranks[0].pool_bytes_after.get("weights", 0)
                sender.release()  # the trainer lets go of its copy before the rollout wakes
                engine.wake("rollout")
            else:
                engine.wake("rollout")
                report = engine.update_weights("rollout", source, version=version)
                pool_bytes[0] = report.ranks[0].pool_bytes_after.get("weights", 0)

        seconds, peak_bytes = _timed(peak, refit)
    served = engine.execute("rollout", PROBE, with_version=True)
    equal = served.output["sha256"] == expected and served.weights_version == version
    name = "refit asleep, then wake" if asleep else "wake, then update"
    return Run(name, seconds, peak_bytes if peak is not None else pool_bytes[0], equal)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def render(runs: list[Run], device: torch.device, weights_bytes: int, command: str, extra: dict[str, Any]) -> str:
    wake, refit, _baseline = runs
    machine = f"{platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads)"
    if device.type == "cuda":
        machine += f", {torch.cuda.get_device_name(device)}"
    ratio = refit.seconds / wake.seconds if wake.seconds else float("inf")
    trainer = rollout = weights_bytes
    bound = max(trainer, rollout) + PEAK_SLACK_BYTES
    lines = [
        "# Refit of a rollout asleep at level 1, then its wake",
        "",
        f"Machine: {machine}. Device: {device} (backend {extra['backend']}). Commit {_commit()}.",
        f"Command: `{command}`",
        "",
        f"Weights: {weights_bytes / GiB:.3f} GiB in {TENSORS} tensors (synthetic runner).",
        "",
        "| phase | seconds | peak bytes | output equal to the new version |",
        "|---|---|---|---|",
        *(f"| {r.name} | {r.seconds:.3f} | {r.peak_bytes} | {r.equal} |" for r in runs),
        "",
        "Peak bytes: on a GPU the device's used bytes, sampled every 2 ms through the phase; on CPU",
        "the rollout's weights pool after the update (0: the refit wrote the host copy only).",
        "",
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| refit + wake <= {WAKE_TARGET_RATIO}x the wake alone | {ratio:.2f}x | "
        + ("met" if ratio <= WAKE_TARGET_RATIO else f"missed by {ratio / WAKE_TARGET_RATIO:.2f}x: {_why_slow(device)}")
        + " |",
        _peak_row(device, refit, bound),
        f"| outputs equal to the reference for the new version | {refit.equal} | "
        + ("met" if refit.equal else "missed")
        + " |",
        "",
    ]
    return "\n".join(lines)


def _why_slow(device: torch.device) -> str:
    if device.type == "cuda":
        return (
            "the refit copies every byte device to host before the wake copies it back; "
            "overlapping the two is not built"
        )
    return "on CPU the refit and the wake are both a memcpy of every byte, so the pair takes about twice one"


def _peak_row(device: torch.device, refit: Run, bound: int) -> str:
    if device.type != "cuda":
        met = "met" if refit.peak_bytes == 0 else "missed"
        return f"| device untouched by the refit (CPU: weights pool 0 bytes) | {refit.peak_bytes} bytes | {met} |"
    met = "met" if refit.peak_bytes <= bound else f"missed by {(refit.peak_bytes - bound) / GiB:.2f} GiB"
    return f"| peak device memory <= max(trainer, rollout) + 1 GiB ({bound} bytes) | {refit.peak_bytes} | {met} |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.refit_asleep", description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--weights-gib", type=float, default=None, help="default: 16 on cuda, 0.25 on cpu")
    parser.add_argument("--out", default=None, help="write the results file here (else print it)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    weights_gib = args.weights_gib if args.weights_gib is not None else (16.0 if device.type == "cuda" else 0.25)
    weights_bytes = int(weights_gib * GiB) // TENSORS * TENSORS
    runs, extra = measure(device, weights_bytes)
    command = " ".join(["python -m benchmarks.refit_asleep", *(argv if argv is not None else sys.argv[1:])])
    text = render(runs, device, weights_bytes, command, extra)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    return 0 if all(r.equal for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
