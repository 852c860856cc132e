"""`python -m benchmarks --swap`: one stage sleeps while another wakes, on one GPU.

A swap is two processes sharing one host link and one device, so each case runs two fresh
stage processes (benchmarks.swap_child), A (outgoing, loaded and awake) and B
(incoming, loaded then put to sleep), and drives them through rounds:

- `limit`: pinned copies of the same bytes, device->host in A and host->device in B: each
  alone, and both at once (duplex, started on a barrier): the link's capacity;
- `vllm-seq`: vLLM's stock CuMemAllocator in both: A sleeps (level 1), then B wakes;
- `omni-seq`: omni-core's `fast` backend in both, A's sleep then B's wake;
- `omni-swap-dirty`: A's sleep and B's wake at the same time, B admitting every allocation
  through a MemoryGate on the device's free memory (so it maps as A releases); A's weights
  are written after each wake, so its sleep copies them;
- `omni-swap-clean`: the same with both stages' weights declared read-only (the host copy is
  made in the background at load; a sleep only unmaps);
- `omni-swap-runs`: `omni-swap-dirty` with touching allocations woken as runs of 512 MiB
  (runs.py): fewer physical allocations for B's maps and A's unmaps;
- `omni-swap-late`, `omni-swap-runs-late`: `omni-swap-dirty` / `omni-swap-runs` with A told
  what B wakes (as Engine.swap tells it: Sleep.incoming_bytes): when the device has room for
  B beside A, A keeps its memory until its last copy and releases it all then; when B must
  wait for A's memory (`+fill`), A releases as its copies land, as before;
- `engine-swap`: `Engine.swap` between two stages of the synthetic runner laid out like the
  workload (its weights are read-only, so this is the clean swap with the protocol's cost).

A pair `A:B` names the two workloads (benchmarks/memory.py's WORKLOADS: "8g", "16g", "mixed"...);
`+fill` adds a third process that takes the device's free memory but (B - A + a margin), so
that B cannot wake until A has released most of its memory: there, every swap is checked for
over-commit (the device's used bytes sampled every ~1 ms from NVML, both processes' own
mapped bytes, the driver's refusals of maps the gate admitted). Every round of a case ends
with a reset (B sleeps, A wakes) so the next starts alike; `--reps` forward rounds (the
first reported apart), then, for the swap methods, rounds with A's sleep and B's wake each
alone, in the same processes. Every wake is checked bit for bit against the seeded bytes.

Writes swap_gpu.json (everything), swap_gpu.md (tables, targets) and swap_timeline.png
(one swap per pair: both directions' GB/s against the link, both processes' mapped bytes
against the device); `--device cpu` runs a smoke version (portable backend, a simulated
device, tiny workloads: swap_cpu.*) that CI runs. `--render swap_gpu.json` redraws both.

On the lent GPU (carry [".device"], built by `bash ../shared/device/bundle.sh`), about 5 min
on an H100 with the defaults (16g:16g and 8g:16g+fill, every method, 4 swaps per case):

    source .device/setup.sh && OMNI_COMMIT=<sha> python3 -m benchmarks --swap --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import child_env
from benchmarks.memory import machine_info
from benchmarks.swap_child import READY_PREFIX, REPLY_PREFIX, SMOKE_WORKLOADS, ChildSpec, workload_of
from benchmarks.swap_report import (
    SWAP_METHODS,
    op_s,
    parse_pair,
    render_markdown,
    render_png,
    round_time_s,
    size_text,
    summarize,
)

MiB = 1 << 20
METHODS = ("limit", "vllm-seq", "omni-seq", *SWAP_METHODS)
DEFAULT_PAIRS = {"cuda": ("16g:16g", "8g:16g+fill"), "cpu": ("4m:4m", "2m:4m+fill")}
# The child process kind of each method, per device; a method missing here is skipped with its reason.
KINDS = {
    "cuda": {
        "limit": "limit",
        "vllm-seq": "vllm",
        "omni-seq": "fast",
        "omni-swap-dirty": "fast",
        "omni-swap-clean": "fast-clean",
        "omni-swap-runs": "fast-runs",
        "omni-swap-late": "fast",
        "omni-swap-runs-late": "fast-runs",
    },
    "cpu": {"omni-seq": "portable", "omni-swap-dirty": "portable", "omni-swap-late": "portable"},
}
CPU_SKIPS = {
    "limit": "the host link's limit is a GPU figure (pinned copies over PCIe/NVLink)",
    "vllm-seq": "vLLM's CuMemAllocator needs CUDA",
    "omni-swap-clean": "clean weights need the fast backend's host arena (CUDA)",
    "omni-swap-runs": "runs map with the CUDA driver",
    "omni-swap-runs-late": "runs map with the CUDA driver",
}
GATED = {  # B's wake waits for free memory
    "omni-swap-dirty",
    "omni-swap-clean",
    "omni-swap-runs",
    "omni-swap-late",
    "omni-swap-runs-late",
}
SWAP_ROUNDS = {"limit", *GATED}  # forward rounds start A and B together
TOLD = {"omni-swap-late", "omni-swap-runs-late"}  # A's sleep is told what B wakes (Sleep.incoming_bytes)
ALONE_ROUNDS = 2  # A's sleep and B's wake each alone, after the swaps, in the same processes
SEEDS = {"a": 1_000, "b": 2_000_000}  # distinct bytes per stage
BARRIER_LEAD_S = 0.3  # both commands are sent, then both start at the same instant
SAMPLE_PERIOD_S = 0.001
MAX_SAMPLES = 20_000  # per round: 20 s of samples; a longer round keeps its first ones and its max
CPU_FILL_MARGIN_BYTES = 256 * 1024
PROBE = {"seed": 3, "batch": 2}


class CaseError(RuntimeError):
    """A case could not finish (a process failed, said nothing in time, or refused)."""


# ---------------------------------------------------------------------- child processes


class Child:
    """A stage (or filler) process, driven by JSON lines; its stderr goes to a log file."""

    def __init__(self, spec: ChildSpec, log_dir: Path) -> None:
        self.spec = spec
        self.name = f"{spec.role} ({spec.kind}, {spec.workload})"
        self.log_path = log_dir / f"{spec.role}-{spec.kind}-{spec.workload}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        cmd = [sys.executable, "-m", "benchmarks.swap_child", spec.to_json()]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1, env=child_env()
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, name=f"swap-bench-{spec.role}", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith((READY_PREFIX, REPLY_PREFIX)):
                self._lines.put(line)
        self._lines.put(None)

    def stderr_tail(self, nbytes: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-nbytes:]
        except OSError:
            return ""

    def _next(self, prefix: str, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise CaseError(
                f"{self.name} said nothing for {timeout_s:.0f} s; its stderr ends: {self.stderr_tail(600)!r}"
            ) from None
        if line is None:
            raise CaseError(f"{self.name} exited (code {self.proc.poll()}); its stderr ends: {self.stderr_tail(600)!r}")
        if not line.startswith(prefix):
            raise CaseError(f"{self.name} answered out of turn: {line[:200]!r}")
        payload = json.loads(line[len(prefix) :])
        if payload.get("error"):
            raise CaseError(f"{self.name}: {payload['error']}")
        if payload.get("refused"):
            raise CaseError(f"{self.name}: the wake was refused: {payload['refused']}")
        return payload

    def ready(self, timeout_s: float) -> dict[str, Any]:
        return self._next(READY_PREFIX, timeout_s)

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as exc:
            raise CaseError(f"{self.name} is gone ({exc}); its stderr ends: {self.stderr_tail(600)!r}") from None

    def reply(self, timeout_s: float) -> dict[str, Any]:
        return self._next(REPLY_PREFIX, timeout_s)

    def ask(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.send(cmd)
        return self.reply(timeout_s)

    def close(self) -> None:
        with contextlib.suppress(CaseError):
            self.send({"op": "exit"})
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait(timeout=30)
        self._log.close()


# ---------------------------------------------------------------------- device sampling


class NvmlDevice:
    """The device's used and total bytes from NVML, read in this (CUDA-free) process."""

    def __init__(self) -> None:
        import pynvml

        from omni_core.workers.accounting import PynvmlApi, parse_cuda_visible_devices, resolve_physical_device

        self.api = PynvmlApi()
        self.physical = resolve_physical_device(
            parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")), 0, self.api
        )
        self._info = pynvml.nvmlDeviceGetMemoryInfo
        self.total_bytes = int(self._info(self.physical.handle).total)

    def used_bytes(self) -> int:
        return int(self._info(self.physical.handle).used)

    def processes(self) -> dict[int, int]:
        return self.api.process_bytes(self.physical.handle)


class SimulatedDeviceReader:
    def __init__(self, device: Any) -> None:
        self.device = device
        self.total_bytes = device.capacity_bytes

    def used_bytes(self) -> int:
        return self.device.used_bytes()

    def processes(self) -> dict[int, int]:
        return {h.pid: h.nbytes for h in self.device.read()[0]}


class Sampler:
    """Reads the device's used bytes every ~1 ms on a thread while a round runs (and each
    process's bytes every tenth read): the over-commit check's device-side evidence."""

    def __init__(self, reader: Any, period_s: float = SAMPLE_PERIOD_S) -> None:
        self.reader, self.period_s = reader, period_s
        self.series: list[tuple[float, int]] = []
        self.max_used = 0
        self.count = 0
        self.process_max: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swap-bench-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self.reader.used_bytes()
            self.max_used = max(self.max_used, used)
            if len(self.series) < MAX_SAMPLES:
                self.series.append((time.monotonic(), used))
            if self.count % 10 == 0:
                for pid, nbytes in self.reader.processes().items():
                    self.process_max[pid] = max(self.process_max.get(pid, 0), nbytes)
            self.count += 1
            self._stop.wait(self.period_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def summary(self, window: tuple[float, float] | None = None) -> dict[str, Any]:
        """Max over every read; the series kept within `window` (the round's operations)."""
        series = self.series
        if window is not None:
            lo, hi = window[0] - 0.005, window[1] + 0.005
            series = [s for s in series if lo <= s[0] <= hi]
        span = (self.series[-1][0] - self.series[0][0]) if len(self.series) > 1 else 0.0
        return {
            "count": self.count,
            "max_used": self.max_used,
            "total": self.reader.total_bytes,
            "period_ms": span / (len(self.series) - 1) * 1e3 if len(self.series) > 1 else None,
            "process_max": {str(k): v for k, v in self.process_max.items()},
            "series": [[round(t, 6), u] for t, u in series],
        }


# ---------------------------------------------------------------------- configuration


class Config:
    def __init__(
        self,
        device: str,
        pairs: list[str],
        methods: list[str],
        reps: int,
        memory_wait_s: float,
        load_timeout_s: float,
        op_timeout_s: float,
        work_dir: Path,
    ) -> None:
        self.device, self.pairs, self.methods, self.reps = device, pairs, methods, reps
        self.memory_wait_s, self.load_timeout_s, self.op_timeout_s = memory_wait_s, load_timeout_s, op_timeout_s
        self.work_dir = work_dir
        self._cases = 0

    def case_dir(self, pair: str, method: str) -> Path:
        self._cases += 1
        path = self.work_dir / f"{self._cases:02d}-{pair.replace(':', '_').replace('+', '_')}-{method}"
        path.mkdir(parents=True)
        return path


def stage_bytes(name: str) -> int:
    w = workload_of(name)
    return w.weights_bytes + w.kv_bytes


def fill_leave_bytes(a: str, b: str, device: str) -> int:
    """What the filler leaves free: B's bytes less A's plus a margin, so that B wakes only
    once A has released most of its memory, and fits once A has released all of it."""
    from omni_core.workers.device_memory import CUDA_RESERVE_BYTES

    a_bytes, b_bytes = stage_bytes(a), stage_bytes(b)
    margin = a_bytes // 8 + (CUDA_RESERVE_BYTES if device == "cuda" else 0)
    return max(0, b_bytes - a_bytes) + margin


def simulated_device(case_dir: Path, a: str, b: str) -> Any:
    """The CPU stand-in for the GPU: both stages loaded fit, and B once more, so that A sees
    room for B beside it whatever B mapped already (the GPU of 16g:16g holds 40 GB of 80);
    a `+fill` pair's filler takes that room."""
    from omni_core.workers.simulated_device import SimulatedDevice

    capacity = stage_bytes(a) + 2 * stage_bytes(b) + CPU_FILL_MARGIN_BYTES
    return SimulatedDevice(str(case_dir / "device"), capacity)


def device_reader(cfg: Config, sim: Any) -> Any:
    return SimulatedDeviceReader(sim) if sim is not None else NvmlDevice()


# ---------------------------------------------------------------------- rounds of stage processes


def _at(lead_s: float = BARRIER_LEAD_S) -> float:
    return time.monotonic() + lead_s


def _swap_round(
    a: Child, b: Child, gate_wait_s: float | None, reader: Any, timeout_s: float, incoming_bytes: int = 0
) -> dict[str, Any]:
    with Sampler(reader) as sampler:
        at = _at()
        a.send({"op": "sleep", "at": at, "incoming_bytes": incoming_bytes})
        b.send({"op": "wake", "at": at, "gate_wait_s": gate_wait_s})
        ra, rb = a.reply(timeout_s), b.reply(timeout_s)
    window = (min(ra["start_s"], rb["start_s"]), max(ra["end_s"], rb["end_s"]))
    return {"kind": "swap", "a": ra, "b": rb, "samples": sampler.summary(window)}


def _seq_round(a: Child, b: Child, reader: Any, timeout_s: float, kind: str = "seq") -> dict[str, Any]:
    with Sampler(reader) as sampler:
        ra = a.ask({"op": "sleep", "at": _at(0.01)}, timeout_s)
        rb = b.ask({"op": "wake", "at": _at(0.01), "gate_wait_s": None}, timeout_s)
    return {"kind": kind, "a": ra, "b": rb, "samples": sampler.summary((ra["start_s"], rb["end_s"]))}


def _reset(a: Child, b: Child, timeout_s: float) -> list[dict[str, Any]]:
    """Back to the starting point: B sleeps, then A wakes (and is checked)."""
    rb = b.ask({"op": "sleep", "at": _at(0.0)}, timeout_s)
    ra = a.ask({"op": "wake", "at": _at(0.0), "gate_wait_s": None}, timeout_s)
    for reply in (rb, ra):
        reply.pop("timeline", None)  # not drawn; keeps the JSON small
    return [rb, ra]


def _progress(started: float, pair: str, method: str, text: str) -> None:
    print(f"[{time.monotonic() - started:7.1f} s] {pair:>14} {method:<16} {text}", flush=True)


def _round_text(rnd: dict[str, Any]) -> str:
    t = round_time_s(rnd)
    exact = [w.get("exact") for w in (rnd.get("b"), *rnd.get("reset", [])) if w and "exact" in w]
    a_s, b_s = op_s(rnd["a"]), op_s(rnd["b"])
    extra = ""
    if rnd["kind"] == "swap" and "time_s" not in rnd:
        extra = f" (A {a_s:.3f} s, B {b_s:.3f} s)"
    elif rnd["kind"] in ("seq", "alone"):
        extra = f" (A sleep {a_s:.3f} s + B wake {b_s:.3f} s)"
    return f"{rnd['kind']:<5} {t:.3f} s{extra} exact {all(exact) if exact else '-'}"


def run_stage_case(pair: str, method: str, cfg: Config, started: float) -> dict[str, Any]:
    a_name, b_name, fill = parse_pair(pair)
    kind = KINDS[cfg.device][method]
    case_dir = cfg.case_dir(pair, method)
    sim = simulated_device(case_dir, a_name, b_name) if cfg.device == "cpu" else None
    common = {
        "kind": kind,
        "device": cfg.device,
        "dirty": kind != "fast-clean",
        "sim_directory": sim.directory if sim else None,
        "sim_capacity_bytes": sim.capacity_bytes if sim else 0,
    }
    specs = [
        ChildSpec("a", workload=a_name, seed=SEEDS["a"], **common),
        ChildSpec("b", workload=b_name, seed=SEEDS["b"], start_asleep=True, **common),
    ]
    fill_here = fill and method != "limit"  # the limit's copies allocate nothing during a round
    if fill_here:
        specs.append(
            ChildSpec(
                "filler",
                "filler",
                b_name,
                cfg.device,
                sim_directory=common["sim_directory"],
                sim_capacity_bytes=common["sim_capacity_bytes"],
            )
        )
    case: dict[str, Any] = {"pair": pair, "method": method, "kind": kind, "rounds": [], "notes": []}
    if fill and not fill_here:
        case["notes"].append("no filler: pinned copies allocate nothing during a round")
    children: list[Child] = []
    try:
        children = [Child(s, case_dir) for s in specs]
        t0 = time.monotonic()
        case["ready"] = [c.ready(cfg.load_timeout_s) for c in children]
        _progress(started, pair, method, f"{len(children)} processes ready in {time.monotonic() - t0:.1f} s")
        a, b = children[0], children[1]
        reader = device_reader(cfg, sim)
        if fill_here:
            leave = fill_leave_bytes(a_name, b_name, cfg.device)
            case["fill"] = children[2].ask({"op": "fill", "leave_free_bytes": leave}, cfg.op_timeout_s)
            case["fill"]["leave_free_bytes"] = leave
            _progress(
                started,
                pair,
                method,
                f"filler holds {size_text(case['fill']['filled_bytes'])}; "
                f"{size_text(case['fill']['free_after'])} free for B's {size_text(stage_bytes(b_name))}",
            )
        gate = cfg.memory_wait_s if method in GATED else None
        for rep in range(cfg.reps):
            if method in SWAP_ROUNDS:
                told = stage_bytes(b_name) if method in TOLD else 0
                rnd = _swap_round(a, b, gate, reader, cfg.op_timeout_s, told)
            else:
                rnd = _seq_round(a, b, reader, cfg.op_timeout_s)
            rnd["rep"] = rep
            rnd["reset"] = _reset(a, b, cfg.op_timeout_s)
            case["rounds"].append(rnd)
            _progress(started, pair, method, f"rep {rep}: {_round_text(rnd)}")
        if method in SWAP_ROUNDS:
            for rep in range(ALONE_ROUNDS):
                rnd = _seq_round(a, b, reader, cfg.op_timeout_s, kind="alone")
                rnd["rep"] = rep
                rnd["reset"] = _reset(a, b, cfg.op_timeout_s)
                case["rounds"].append(rnd)
                _progress(started, pair, method, f"alone {rep}: {_round_text(rnd)}")
    except CaseError as exc:
        case["error"] = str(exc)[:3000]
        _progress(started, pair, method, f"error: {str(exc)[:400]}")
    finally:
        for child in children:
            child.close()
    return case


# ---------------------------------------------------------------------- Engine.swap


def synthetic_args(name: str, seed: int, device: str) -> dict[str, Any] | str:
    """The synthetic runner laid out like workload `name` (equal matrices), or why it cannot be."""
    w = workload_of(name)
    sizes = set(w.weights)
    if len(sizes) != 1:
        return f"workload {name} mixes {len(sizes)} tensor sizes; the synthetic runner's weights are equal matrices"
    size, hidden = sizes.pop(), 4096
    while hidden > 1 and size % (2 * hidden):
        hidden //= 2
    args: dict[str, Any] = {
        "weights_bytes": w.weights_bytes,
        "tensor_count": len(w.weights),
        "hidden": hidden,
        "dtype": "bfloat16",
        "kv_bytes": w.kv_bytes,
        "seed": seed,
    }
    if device == "cpu":
        args["cpu_threads"] = 1
    return args


def run_engine_case(pair: str, cfg: Config, started: float) -> dict[str, Any]:
    from omni_core.engine import Engine, OmniCoreError, StageSpec

    a_name, b_name, fill = parse_pair(pair)
    case: dict[str, Any] = {
        "pair": pair,
        "method": "engine-swap",
        "kind": "engine",
        "rounds": [],
        "notes": [
            "synthetic runner: weights read-only, so A's sleeps copy nothing (the clean swap, through the protocol)"
        ],
    }
    args = {role: synthetic_args(name, SEEDS[role], cfg.device) for role, name in (("a", a_name), ("b", b_name))}
    reasons = [v for v in args.values() if isinstance(v, str)]
    if reasons:
        case["skipped"] = reasons[0]
        return case
    case_dir = cfg.case_dir(pair, "engine-swap")
    sim = simulated_device(case_dir, a_name, b_name) if cfg.device == "cpu" else None
    backend = "fast" if cfg.device == "cuda" else "portable"
    specs = [
        StageSpec(
            f"swap-{role}",
            runner="synthetic",
            runner_args=args[role],
            device=cfg.device,
            backend=backend,
            deadline_s=max(300.0, 2 * cfg.memory_wait_s),
            start_deadline_s=cfg.load_timeout_s,
            request_timeout_s=cfg.op_timeout_s,
            simulated_device=sim,
        )
        for role in ("a", "b")
    ]
    filler: Child | None = None
    try:
        t0 = time.monotonic()
        with Engine(specs) as engine:
            _progress(started, pair, "engine-swap", f"two stages started in {time.monotonic() - t0:.1f} s")
            reference = {s.name: engine.execute(s.name, PROBE)["sha256"] for s in specs}

            def same(stage: str) -> bool:
                return engine.execute(stage, PROBE)["sha256"] == reference[stage]

            def reset() -> list[dict[str, Any]]:
                slept = engine.sleep("swap-b")
                woke = engine.wake("swap-a")
                return [_half(slept, "sleep"), {**_half(woke, "wake"), "exact": same("swap-a")}]

            engine.sleep("swap-b")
            reader = device_reader(cfg, sim)
            if fill:
                filler = Child(
                    ChildSpec(
                        "filler",
                        "filler",
                        b_name,
                        cfg.device,
                        sim_directory=sim.directory if sim else None,
                        sim_capacity_bytes=sim.capacity_bytes if sim else 0,
                    ),
                    case_dir,
                )
                filler.ready(cfg.load_timeout_s)
                leave = fill_leave_bytes(a_name, b_name, cfg.device)
                case["fill"] = {
                    **filler.ask({"op": "fill", "leave_free_bytes": leave}, cfg.op_timeout_s),
                    "leave_free_bytes": leave,
                }
            for rep in range(cfg.reps):
                with Sampler(reader) as sampler:
                    t = time.monotonic()
                    report = engine.swap(
                        "swap-a", "swap-b", task_id=f"bench-swap-{rep}", memory_wait_s=cfg.memory_wait_s
                    )
                    window = (t, time.monotonic())
                rnd = {
                    "kind": "swap",
                    "rep": rep,
                    "time_s": report.duration_s,
                    "a": _half(report.outgoing, "sleep"),
                    "b": {**_half(report.incoming, "wake"), "exact": same("swap-b")},
                    "samples": sampler.summary(window),
                }
                rnd["reset"] = reset()
                case["rounds"].append(rnd)
                _progress(started, pair, "engine-swap", f"rep {rep}: {_round_text(rnd)}")
            for rep in range(ALONE_ROUNDS):
                a_half = _half(engine.sleep("swap-a"), "sleep")
                b_half = {**_half(engine.wake("swap-b"), "wake"), "exact": same("swap-b")}
                rnd = {"kind": "alone", "rep": rep, "a": a_half, "b": b_half, "reset": reset()}
                case["rounds"].append(rnd)
                _progress(started, pair, "engine-swap", f"alone {rep}: {_round_text(rnd)}")
    except (OmniCoreError, CaseError) as exc:
        case["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        _progress(started, pair, "engine-swap", f"error: {case['error'][:400]}")
    finally:
        if filler is not None:
            filler.close()
    return case


def _half(report: Any, op: str) -> dict[str, Any]:
    """One stage's part of a lifecycle call, shaped like a stage process's reply (the rank's
    own duration; copied bytes: the weights that moved, none for a clean sleep)."""
    rank = report.ranks[0]
    weights = rank.pool_bytes_after.get("weights", 0) if op == "wake" else 0
    return {
        "op": op,
        "start_s": 0.0,
        "end_s": rank.duration_s,
        "stage_s": report.duration_s,
        "copied_bytes": weights,
        "state": report.state,
    }


# ---------------------------------------------------------------------- main


def skip_reason(method: str, device: str) -> str | None:
    if device == "cpu" and method in CPU_SKIPS:
        return CPU_SKIPS[method]
    if method == "vllm-seq" and importlib.util.find_spec("vllm") is None:
        return "vllm is not importable (install vllm, or on the device `source .device/setup.sh`)"
    return None


def outputs(device: str) -> tuple[str, str, str]:
    tag = "gpu" if device == "cuda" else "cpu"
    return f"swap_{tag}.json", f"swap_{tag}.md", "swap_timeline.png" if tag == "gpu" else "swap_timeline_cpu.png"


def write_outputs(data: dict[str, Any], out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    js, md, png = outputs(data["device"])
    (out / js).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    (out / md).write_text(render_markdown(data))
    written = [str(out / js), str(out / md)]
    problem = render_png(data, out / png)
    if problem:
        print(problem, file=sys.stderr)
    else:
        written.append(str(out / png))
    return written


def _split(groups: list[str] | None, default: tuple[str, ...]) -> list[str]:
    return [x for g in (groups or [",".join(default)]) for x in g.split(",") if x]


def _problem(pairs: list[str], methods: list[str], device: str) -> str | None:
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        return f"unknown swap method(s) {unknown}; choose from {list(METHODS)}"
    for pair in pairs:
        try:
            for name in parse_pair(pair)[:2]:
                workload_of(name)
        except ValueError as exc:
            return str(exc)
    if device == "cuda":
        from benchmarks.memory import _cuda_problem

        return _cuda_problem()
    small = [p for p in pairs if any(n not in SMOKE_WORKLOADS for n in parse_pair(p)[:2])]
    if small:
        return f"--device cpu runs the smoke workloads {list(SMOKE_WORKLOADS)} only (got {small})"
    return None


def main(args: argparse.Namespace) -> int:
    device = getattr(args, "device", None) or "cuda"
    out = Path(args.out or "bench-results")
    if args.render:
        data = json.loads(Path(args.render).read_text())
        for path in write_outputs(data, out):
            print(f"wrote {path}")
        return 0
    pairs = _split(args.workloads, DEFAULT_PAIRS[device])
    methods = _split(args.methods, METHODS)
    problem = _problem(pairs, methods, device)
    if problem:
        print(f"python -m benchmarks --swap: {problem}", file=sys.stderr)
        return 2
    reps = args.reps or (2 if args.short else 4)
    command = " ".join(["omni-core", *sys.argv[1:]])
    work_dir = Path(tempfile.mkdtemp(prefix="omni-swap-bench-"))
    cfg = Config(
        device,
        pairs,
        methods,
        reps,
        args.memory_wait_s,
        min(args.case_timeout_s, 600.0),
        min(args.case_timeout_s, 180.0),
        work_dir,
    )
    started = time.monotonic()
    results: list[dict[str, Any]] = []
    data: dict[str, Any] = {
        "command": command,
        "device": device,
        "machine": {},
        "reps": reps,
        "pairs": pairs,
        "methods": methods,
        "results": results,
        "memory_wait_s": args.memory_wait_s,
        "workloads": {n: workload_of(n).description for p in pairs for n in parse_pair(p)[:2]},
        "partial": True,
    }
    js = outputs(device)[0]
    for pair in pairs:
        for method in methods:
            reason = skip_reason(method, device)
            if reason:
                case: dict[str, Any] = {"pair": pair, "method": method, "skipped": reason, "rounds": []}
            elif method == "engine-swap":
                case = run_engine_case(pair, cfg, started)
            else:
                case = run_stage_case(pair, method, cfg, started)
            results.append(case)
            s = summarize(case)
            _progress(
                started,
                pair,
                method,
                (case.get("skipped") and f"skipped: {case['skipped']}")
                or (
                    f"first {s['first_s']:.3f} s, later {s['later_s']:.3f} s, exact {s['bit_exact']}"
                    if s
                    else f"error: {case.get('error', 'no rounds')[:200]}"
                ),
            )
            out.mkdir(parents=True, exist_ok=True)
            (out / js).write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    data.update(machine=machine_info(), wall_s=time.monotonic() - started, partial=False)
    for path in write_outputs(data, out):
        print(f"wrote {path}")
    failed = [c for c in results if c.get("error")]
    bad = [
        c
        for c in results
        if (s := summarize(c)) and (not s["bit_exact"] or not s.get("overcommit", {"ok": True})["ok"])
    ]
    if not failed and not bad:
        shutil.rmtree(work_dir, ignore_errors=True)
    else:
        print(f"child logs kept in {work_dir}", file=sys.stderr)
    return 1 if failed or bad else 0
