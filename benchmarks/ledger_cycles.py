"""Two omni-core Engines, each in its own process, alternating sleep/wake/swap cycles on one
(simulated) device: the node ledger's run of vLLM #36753 / vLLM-Omni #7290, where two engines
sleeping and waking at once on one GPU livelock or stall.

Each engine has three stages: `keep` (awake throughout: the engine always holds memory) and `x`,
`y`, of which one is awake. The device holds five stages, not six. A cycle, in step across the
two engines (a barrier between phases):

1. both engines swap their awake stage for the asleep one at once, waiting for memory
   (`memory_wait_s`): the incoming wakes of the two engines take the device's incoming lock
   one after the other instead of each mapping half and waiting for the other;
2. one engine (they take turns) wakes its asleep stage: five stages fit;
3. the other engine wakes its asleep stage: six do not, and the wake is refused at once
   (NO_MEMORY), naming the first engine's ranks among the holders (engine pid, stage, rank, pid,
   bytes);
4. the first engine puts its extra stage to sleep again.

Every refusal, of a swap or a wake, must name a holder of the other engine with bytes on the
device (or, for a swap refused at the incoming lock, the other engine's wake holding it); a
livelock would show as swaps that do not complete. CI runs a few cycles
(tests/bench/test_ledger_cycles.py); the results file is from

    python -m benchmarks.ledger_cycles --cycles 1000 --out benchmarks/results/ledger_cycles.md
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

MiB = 1 << 20
RUNNER_ARGS = {"weights_bytes": MiB, "tensor_count": 4, "kv_bytes": MiB // 8, "cpu_threads": 1}
STAGES = ("keep", "x", "y")
MEMORY_WAIT_S = 30.0  # a swap's wait: the other engine's swap holds the lock for milliseconds
START_WAIT_S = 300.0  # the barrier's guard against an engine that died: not a timing bound
# A holder as a refusal names it (simulated_device.Holder.describe).
HOLDER_RE = re.compile(r"stage (?P<stage>[\w.-]+) rank (?P<rank>\d+), pid (?P<pid>\d+) \(engine pid (?P<engine>\d+)\)")
HOLDER_BYTES_RE = re.compile(HOLDER_RE.pattern + r": (?P<nbytes>\d+) bytes")


@dataclass
class EngineTally:
    """What one engine did, sent back to the parent."""

    engine: int
    engine_pid: int
    cycles: int = 0
    swaps: int = 0
    swap_s: list[float] = field(default_factory=list)
    wakes: int = 0
    refusals: list[str] = field(default_factory=list)  # each refusal's text, in full
    unexpected: list[str] = field(default_factory=list)  # what went wrong (a wake refused that should fit, ...)


def stage_bytes() -> int:
    """What one awake stage of RUNNER_ARGS holds on the device: weights plus KV cache."""
    return RUNNER_ARGS["weights_bytes"] + RUNNER_ARGS["kv_bytes"]


def device_capacity_bytes() -> int:
    """Room for five awake stages and a half: the sixth never fits."""
    return int(5.5 * stage_bytes())


def names_other_engine(text: str, other_engine_pid: int) -> bool:
    """Whether a refusal names a holder of the other engine holding bytes, or the other
    engine's wake holding the incoming lock."""
    for match in HOLDER_BYTES_RE.finditer(text):
        if int(match["engine"]) == other_engine_pid and int(match["nbytes"]) > 0:
            return True
    if "incoming lock" in text:
        return any(int(m["engine"]) == other_engine_pid for m in HOLDER_RE.finditer(text))
    return False


def _specs(engine: int, directory: str) -> list[Any]:
    from omni_core.engine import StageSpec
    from omni_core.workers.simulated_device import SimulatedDevice

    device = SimulatedDevice(directory, device_capacity_bytes())
    return [
        StageSpec(
            f"e{engine}-{name}",
            runner_args=dict(RUNNER_ARGS, seed=engine * 10 + i),
            backend="portable",
            simulated_device=device,
            deadline_s=60.0,
            start_deadline_s=300.0,
        )
        for i, name in enumerate(STAGES)
    ]


def run_engine(engine: int, directory: str, cycles: int, barrier: Any, pids: Any, out: Any) -> None:
    """One engine's side of the run (a spawned process); its tally goes to `out`."""
    from omni_core.engine import Engine

    tally = EngineTally(engine, os.getpid())
    try:
        with Engine(_specs(engine, directory)) as handle:
            handle.sleep(f"e{engine}-y")  # x awake, y asleep, keep awake
            pids[engine] = os.getpid()
            barrier.wait(START_WAIT_S)
            other = pids[1 - engine]
            awake, asleep = f"e{engine}-x", f"e{engine}-y"
            for cycle in range(cycles):
                awake, asleep = _cycle(handle, tally, cycle, awake, asleep, other, barrier)
                tally.cycles += 1
    except Exception as exc:  # the parent reports it; a broken barrier ends the other engine too
        tally.unexpected.append(f"{type(exc).__name__}: {exc}")
        barrier.abort()
    out.put(tally)


def _cycle(handle: Any, tally: EngineTally, cycle: int, awake: str, asleep: str, other: int, barrier: Any):
    from omni_core.engine import NoMemoryError, SwapFailedError

    barrier.wait(START_WAIT_S)  # 1: both swap at once
    started = time.perf_counter()
    try:
        handle.swap(awake, asleep, memory_wait_s=MEMORY_WAIT_S)
        tally.swaps += 1
        tally.swap_s.append(time.perf_counter() - started)
        awake, asleep = asleep, awake
    except SwapFailedError as exc:
        _refused(tally, str(exc), other, f"cycle {cycle}: swap")
        _restore(handle, awake, asleep)
    first = cycle % 2 == tally.engine
    barrier.wait(START_WAIT_S)  # 2: the first engine's extra wake fits
    if first:
        handle.wake(asleep)
        tally.wakes += 1
    barrier.wait(START_WAIT_S)  # 3: the other's does not
    if not first:
        try:
            handle.wake(asleep)
            tally.unexpected.append(f"cycle {cycle}: a sixth stage woke on a device for five and a half")
            handle.sleep(asleep)
        except NoMemoryError as exc:
            _refused(tally, str(exc), other, f"cycle {cycle}: wake")
    barrier.wait(START_WAIT_S)  # 4: the first engine's extra sleeps again
    if first:
        handle.sleep(asleep)
    return awake, asleep


def _refused(tally: EngineTally, text: str, other: int, what: str) -> None:
    tally.refusals.append(text)
    if not names_other_engine(text, other):
        tally.unexpected.append(f"{what} refused without naming engine pid {other}'s holders: {text}")


def _restore(handle: Any, awake: str, asleep: str) -> None:
    """After a refused swap: the outgoing stage slept and the incoming did not wake; wake the
    outgoing again so the cycle's shape holds."""
    status = handle.status()
    if status[awake]["state"] != "RUNNING":
        handle.wake(awake)


def run(cycles: int, directory: str | None = None) -> list[EngineTally]:
    """Both engines' tallies after `cycles` cycles on one simulated device."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="omni-ledger-") as tmp:
        directory = directory or os.path.join(tmp, "gpu0")
        barrier, out = ctx.Barrier(2), ctx.Queue()
        pids = ctx.Array("q", 2)
        procs = [ctx.Process(target=run_engine, args=(i, directory, cycles, barrier, pids, out)) for i in (0, 1)]
        for proc in procs:
            proc.start()
        tallies = [out.get(timeout=START_WAIT_S + cycles * 10.0) for _ in procs]
        for proc in procs:
            proc.join(60)
    return sorted(tallies, key=lambda t: t.engine)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def report(tallies: list[EngineTally], cycles: int, wall_s: float, command: str) -> str:
    swaps = [s for t in tallies for s in t.swap_s]
    refusals = sum(len(t.refusals) for t in tallies)
    unexpected = [u for t in tallies for u in t.unexpected]
    named = refusals - sum("without naming" in u for u in unexpected)
    p50 = statistics.median(swaps) if swaps else float("nan")
    p99 = sorted(swaps)[int(0.99 * (len(swaps) - 1))] if swaps else float("nan")
    done = min(t.cycles for t in tallies)
    rows = [
        f"| cycles completed by both engines: {cycles} | {done} | {'met' if done == cycles else 'missed'} |",
        f"| swaps completed (no livelock): {2 * cycles} | {sum(t.swaps for t in tallies)} | "
        f"{'met' if sum(t.swaps for t in tallies) == 2 * cycles else 'missed'} |",
        f"| refusals naming the other engine's holder: all {refusals} | {named} | "
        f"{'met' if named == refusals and refusals >= cycles else 'missed'} |",
        f"| nothing unexpected: 0 | {len(unexpected)} | {'met' if not unexpected else 'missed'} |",
        "| the same on one GPU, a plain vLLM (omni_fast) as a third engine: 1,000 cycles | not run | "
        "missed: no device this round (omni_fast's membership is tested on CPU doubles) |",
    ]
    lines = [
        "# Two engines, one device: alternating sleep/wake/swap cycles through the node ledger",
        "",
        f"Machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), CPU simulated device "
        f"of {device_capacity_bytes()} bytes (five and a half stages of {stage_bytes()} bytes). Commit {_commit()}.",
        f"Command: `{command}`",
        "",
        f"{cycles} cycles in {wall_s:.1f} s; {len(swaps)} swaps, median {p50 * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms (both engines' swaps at once, their incoming wakes one after the other "
        f"through the device's incoming lock); {refusals} refusals.",
        "",
        "Each engine has three stages (`keep` awake throughout, `x` and `y` taking turns); the device "
        "holds five. Per cycle both engines swap at once, one wakes its asleep stage (five fit), then the "
        "other does and is refused at once (six do not): that refusal must name a holder of the first "
        "engine with bytes on the device (engine pid, stage, rank, pid, bytes).",
        "",
    ]
    if unexpected:
        lines += ["Unexpected:", "", *[f"- {u[:400]}" for u in unexpected[:20]], ""]
    lines += ["## Targets", "", "| target | measured | met |", "|---|---|---|", *rows, ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ledger_cycles", description=__doc__.split("\n")[0])
    parser.add_argument("--cycles", type=int, default=20, help="cycles per engine (1000 for the results file)")
    parser.add_argument("--out", help="write the results (markdown) here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    tallies = run(args.cycles)
    text = report(
        tallies,
        args.cycles,
        time.perf_counter() - started,
        " ".join(["python -m benchmarks.ledger_cycles", *(argv or sys.argv[1:])]),
    )
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if all(not t.unexpected and t.cycles == args.cycles for t in tallies) else 1


if __name__ == "__main__":
    sys.exit(main())
