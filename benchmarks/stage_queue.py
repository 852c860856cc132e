"""`python -m benchmarks --stage-queue`: what a queued request costs the stage core.

The stage core runs on the orchestrator's one thread, which serves every stage: a cost per
step that grows with the queue slows every stage's calls. A one-rank stage on the simulator
(`omni_testing.network`) is paused, so every request queues; N requests are submitted, then
100 ticks run over the full queue, then the queue drains by resume. Each phase's wall time is
one sample; the per-request cost should not grow with N.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from benchmarks.control_plane import TARGETS_HEADER, _machine
from omni_core.fsm import StageCore, WorkerCore
from omni_core.fsm import inputs as I
from omni_core.protocol import StageState
from omni_testing.network import Simulator

COUNTS = (1_000, 4_000, 16_000)
TICKS = 100
# Linear cost: the per-request time of 16k queued within this factor of 1k's.
TARGET_PER_REQUEST_RATIO = 2.0


def measure(count: int) -> dict[str, Any]:
    stage = StageCore("queue", 1, queue_limit=count, max_in_flight=count)
    sim = Simulator(stage, record=False, make_worker=lambda rank, epoch: WorkerCore(rank, epoch=epoch))
    sim.start(10.0, hello=True)
    sim.deliver_all()
    now = 1.0
    stage.step(I.PauseCall("pause", "wait", 5.0), now)
    if stage.state is not StageState.PAUSED:
        raise RuntimeError(f"the stage did not pause: {stage.state.value}")
    started = time.perf_counter()
    for i in range(count):
        stage.step(I.Submit(f"r{i}", None, 1e6), now)
    submitted = time.perf_counter()
    for k in range(TICKS):
        stage.step(I.Tick(), now + k * 1e-3)
    ticked = time.perf_counter()
    resumed = stage.step(I.ResumeCall("resume", 5.0), now + 1.0)
    drained = time.perf_counter()
    if len(stage.queue) != 0 or len(resumed.sends) != count:
        raise RuntimeError(f"resume dispatched {len(resumed.sends)} of {count}; {len(stage.queue)} still queued")
    return {
        "queued": count,
        "submit_s": submitted - started,
        "submit_us_per_request": (submitted - started) / count * 1e6,
        "tick_ms": (ticked - submitted) / TICKS * 1e3,
        "drain_s": drained - ticked,
    }


def render_markdown(results: list[dict[str, Any]], machine: dict[str, Any], command: str) -> str:
    lines = [
        "# Stage core: queued requests (sans-IO, one rank on the simulator, stage paused)",
        "",
        f"machine: {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']}; "
        f"commit `{machine['commit']}`; command `{command}`",
        "",
        "| queued | submits s | µs per submit | ms per tick (full queue) | drain by resume s |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['queued']} | {r['submit_s']:.3f} | {r['submit_us_per_request']:.1f} | "
            f"{r['tick_ms']:.3f} | {r['drain_s']:.3f} |"
        )
    first, last = results[0], results[-1]
    ratio = last["submit_us_per_request"] / first["submit_us_per_request"]
    total = last["submit_s"] / first["submit_s"]
    met = "met" if ratio <= TARGET_PER_REQUEST_RATIO else f"missed by {ratio / TARGET_PER_REQUEST_RATIO:.1f}x"
    drain = (last["drain_s"] / last["queued"]) / (first["drain_s"] / first["queued"])
    drain_met = "met" if drain <= TARGET_PER_REQUEST_RATIO else f"missed by {drain / TARGET_PER_REQUEST_RATIO:.1f}x"
    lines += [
        *TARGETS_HEADER,
        f"| per-submit cost at {last['queued']} queued within {TARGET_PER_REQUEST_RATIO}x of "
        f"{first['queued']} (linear) | {ratio:.2f}x (total {total:.1f}x for "
        f"{last['queued'] // first['queued']}x the requests) | {met} |",
        f"| per-dispatch cost of a resume releasing {last['queued']} within {TARGET_PER_REQUEST_RATIO}x of "
        f"{first['queued']} | {drain:.2f}x | {drain_met} |",
    ]
    return "\n".join(lines) + "\n"


def main(out_dir: str | None, command: str, counts: tuple[int, ...] = COUNTS) -> int:
    results = [measure(n) for n in counts]
    text = render_markdown(results, _machine(), command)
    print(text)
    if out_dir:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        payload = {"machine": _machine(), "command": command, "results": results}
        (path / "stage_queue.json").write_text(json.dumps(payload, indent=2) + "\n")
        (path / "stage_queue.md").write_text(text)
        print(f"wrote {path / 'stage_queue.json'} and {path / 'stage_queue.md'}")
    return 0
