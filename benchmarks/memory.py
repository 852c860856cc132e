"""`python -m benchmarks`: sleep/wake of the memory path, every method side by side on one GPU.

One invocation measures, on the same workloads and the same machine:

- `limit`: the host link itself, one pinned (cudaHostAlloc) buffer copied device->host
  and back in one call each way; nothing faster is possible over this link;
- `vllm`: vLLM's stock `CuMemAllocator.sleep(offload_tags=("weights",))` / `wake_up()`;
- `tms`: torch_memory_saver (when installed): weights in a region with CPU backup, KV
  without, `pause()` / `resume()`;
- `cumem` and `fast`: omni-core's backends, called as the worker calls them
  (`backend.sleep(offload, discard)` / `backend.wake(tags)`); `fast` with its defaults
  (runs of 512 MiB where they can be made), `fast:run_mib=0` without runs.

Each (method, workload) runs in a fresh process, so a "first sleep" is really the process's
first (vLLM's is slow precisely because nothing is pinned yet) and no method inherits
another's pinned cache or allocator state. In that process: allocate the workload in the
method's pools, fill the weights with seeded random bytes, then `reps` level-1 cycles
(sleep timed from the call until the memory is released and the call returned, i.e. the
moment a worker would ACK; wake until the bytes are on the device), each wake checked
bit for bit against the seeded bytes, then one level-2 sleep and wake (everything
discarded). GB/s = bytes of the weights' allocations / seconds (decimal GB, as the design's
anchors). Host bytes = the drop of MemAvailable between the loaded state (before any
arena) and the first sleep, i.e. whatever the method pinned or copied into.

Writes memory.json (everything), memory.md (the tables and the targets) and
memory.png (when matplotlib is importable; `--render memory.json` redraws both later).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import child_env
from omni_core.provenance import git_commit, git_dirty, run_quietly

MiB, GiB = 1 << 20, 1 << 30
SEED = 20_240_607
TARGET_GBPS = 50.0
TARGET_HOST_RATIO = 1.05
TARGET_L2_MS = 100.0
CHILD_TIMEOUT_S = 420
RESULT_PREFIX = "BENCH-RESULT "


@dataclass(frozen=True)
class Workload:
    name: str
    weights: tuple[int, ...]  # bytes per weight tensor (bfloat16, so even)
    kv_bytes: int
    description: str

    @property
    def weights_bytes(self) -> int:
        return sum(self.weights)


def _mixed() -> tuple[int, ...]:
    small = tuple((128 * 1024, 1 * MiB, 3 * MiB)[i % 3] for i in range(1536))
    return small + (1536 * MiB,) * 4


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("1g", (32 * MiB,) * 32, 512 * MiB, "1 GiB weights (32 x 32 MiB) + 0.5 GiB KV"),
        Workload("8g", (32 * MiB,) * 256, 4 * GiB, "8 GiB weights (256 x 32 MiB, bf16 4096x4096) + 4 GiB KV"),
        Workload("16g", (32 * MiB,) * 512, 4 * GiB, "16 GiB weights (512 x 32 MiB) + 4 GiB KV"),
        Workload("32g", (32 * MiB,) * 1024, 4 * GiB, "32 GiB weights (1024 x 32 MiB) + 4 GiB KV"),
        Workload("mixed", _mixed(), 4 * GiB, "8.06 GiB: 1536 small (128 KiB/1 MiB/3 MiB) + 4 x 1.5 GiB; 4 GiB KV"),
    )
}
METHODS = ("limit", "vllm", "tms", "cumem", "fast")
DEFAULT_WORKLOADS = ("1g", "8g", "32g", "mixed")


def parse_method(spec: str) -> tuple[str, dict[str, str]]:
    """'fast' or 'fast:chunk_mib=64,streams=1' -> ('fast', {...}); '+' separates options too,
    for a --methods list, which commas cut into methods: 'fast:clean=1+run_mib=512'."""
    name, _, rest = spec.partition(":")
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {list(METHODS)} (options after ':')")
    options = {}
    for item in filter(None, rest.replace("+", ",").split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"method option {item!r} in {spec!r} is not key=value")
        options[key] = value
    return name, options


# ---------------------------------------------------------------------- methods (child process)


class NotApplicable(Exception):
    """This method has no such operation (e.g. torch_memory_saver's level 2)."""


class _Method:
    reported: dict[str, Any]

    def __init__(self, device: Any, options: dict[str, str]) -> None:
        self.device = device
        self.options = options
        self.reported = {}

    def pool(self, tag: str) -> Any:
        return nullcontext()

    def loaded(self, weights: list[Any]) -> None:
        pass

    def pool_bytes(self, tag: str, tensors: list[Any]) -> tuple[int, int]:
        """(bytes, allocations) of `tag`: the allocator's own figure where it has one."""
        return sum(t.numel() * t.element_size() for t in tensors), len(tensors)

    def sleep(self, level: int) -> None:
        raise NotImplementedError

    def wake(self) -> None:
        raise NotImplementedError


class _VllmStock(_Method):
    def __init__(self, device: Any, options: dict[str, str]) -> None:
        super().__init__(device, options)
        from vllm.device_allocator.cumem import CuMemAllocator

        self.allocator = CuMemAllocator.get_instance()

    def pool(self, tag: str) -> Any:
        return self.allocator.use_memory_pool(tag=tag)

    def pool_bytes(self, tag: str, tensors: list[Any]) -> tuple[int, int]:
        sizes = [d.handle[1] for d in self.allocator.pointer_to_data.values() if d.tag == tag]
        return sum(sizes), len(sizes)

    def sleep(self, level: int) -> None:
        self.allocator.sleep(offload_tags=("weights",) if level == 1 else ())

    def wake(self) -> None:
        self.allocator.wake_up()


class _Omni(_Method):
    def __init__(self, device: Any, options: dict[str, str], name: str) -> None:
        super().__init__(device, options)
        if name == "fast":
            from omni_core.workers.backends.fast import FastBackend

            chunk = int(options["chunk_mib"]) * MiB if "chunk_mib" in options else None
            runs = int(options["run_mib"]) * MiB if "run_mib" in options else None
            self.backend = FastBackend(
                device,
                chunk_bytes=chunk,
                prepare=options.get("prepare", "load"),
                map_with=options.get("map", "driver"),
                run_bytes=runs,
            )
            if "touch" in options:
                self.backend.path.touch = options["touch"] not in ("0", "false", "no")
            if options.get("clean") not in (None, "0", "false", "no"):
                # Inference weights: copied into the arena once at load, a sleep only unmaps.
                self.backend.declare_read_only({"weights"})
            if "streams" in options:
                from omni_core.workers.backends.cuda_ops import CudaOps

                self.backend.path.ops = CudaOps(self.backend.device, int(options["streams"]))
        else:
            from omni_core.workers.backends.cumem import CumemBackend

            self.backend = CumemBackend(device)

    def pool(self, tag: str) -> Any:
        return self.backend.pool(tag)

    def loaded(self, weights: list[Any]) -> None:
        self.backend.track("weights", weights)

    def pool_bytes(self, tag: str, tensors: list[Any]) -> tuple[int, int]:
        sizes = [d.handle[1] for _, d in self.backend._allocations({tag})]
        return sum(sizes), len(sizes)

    def sleep(self, level: int) -> None:
        if level == 1:
            self.backend.sleep({"weights"}, {"kv_cache"})
        else:
            self.backend.sleep(set(), {"weights", "kv_cache"})
        stats = getattr(self.backend, "stats", None)
        if stats is not None:
            self.reported = stats()

    def wake(self) -> None:
        self.backend.wake({"weights", "kv_cache"})
        stats = getattr(self.backend, "stats", None)
        if stats is not None:
            self.reported["last_wake"] = stats()["last"]


class _Tms(_Method):
    def __init__(self, device: Any, options: dict[str, str]) -> None:
        super().__init__(device, options)
        from torch_memory_saver import torch_memory_saver

        torch_memory_saver.hook_mode = options.get("hook_mode", "torch")
        self.tms = torch_memory_saver

    def pool(self, tag: str) -> Any:
        return self.tms.region(tag=tag, enable_cpu_backup=tag == "weights")

    def sleep(self, level: int) -> None:
        if level != 1:
            raise NotApplicable("torch_memory_saver fixes the CPU backup per region at allocation time")
        self.tms.pause()

    def wake(self) -> None:
        self.tms.resume()


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def fill_seeded(tensors: list[Any], torch: Any, seed: int = SEED) -> None:
    """Seeded random bytes in each tensor (`bit_exact` regenerates them to compare)."""
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device).manual_seed(seed + i)
        t.view(torch.uint8).random_(0, 256, generator=gen)


def bit_exact(tensors: list[Any], torch: Any, seed: int = SEED) -> bool:
    """True when every tensor still holds the bytes `fill_seeded(tensors, torch, seed)` wrote."""
    for i, t in enumerate(tensors):
        gen = torch.Generator(device=t.device).manual_seed(seed + i)
        expected = torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=t.device)
        expected.random_(0, 256, generator=gen)
        if not torch.equal(t.view(torch.uint8), expected):
            return False
    return True


def make_method(name: str, device: Any, options: dict[str, str]) -> _Method:
    """The method `name` ("vllm", "tms", "cumem", "fast") on `device`, in this process."""
    if name == "vllm":
        return _VllmStock(device, options)
    if name == "tms":
        return _Tms(device, options)
    if name in ("cumem", "fast"):
        return _Omni(device, options, name)
    raise ValueError(f"no sleep/wake method {name!r}; choose from {[m for m in METHODS if m != 'limit']}")


def run_case(spec: str, workload_name: str, reps: int) -> dict[str, Any]:
    import torch

    name, options = parse_method(spec)
    workload = WORKLOADS[workload_name]
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.init()
    result: dict[str, Any] = {
        "method": spec,
        "workload": workload_name,
        "reps": reps,
        "weights_tensor_bytes": workload.weights_bytes,
        "tensors": len(workload.weights),
    }
    if name == "limit":
        return _run_limit(result, workload, reps, torch, device)
    method = make_method(name, device, options)
    with method.pool("weights"):
        weights = [torch.empty(n // 2, dtype=torch.bfloat16, device=device) for n in workload.weights]
    fill_seeded(weights, torch)
    with method.pool("kv_cache"):
        kv = torch.zeros(workload.kv_bytes // 2, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    offloaded, allocations = method.pool_bytes("weights", weights)
    kv_pool, kv_allocations = method.pool_bytes("kv_cache", [kv])
    result.update(offloaded_bytes=offloaded, allocations=allocations, kv_bytes=kv_pool, kv_allocations=kv_allocations)
    available_loaded = _mem_available()
    started = time.perf_counter()
    method.loaded(weights)
    result["prepare_s"] = time.perf_counter() - started
    sleeps, wakes, freed, exact = [], [], [], []
    for rep in range(reps):
        free_before = torch.cuda.mem_get_info(device)[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        method.sleep(1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        freed.append(torch.cuda.mem_get_info(device)[0] - free_before)
        if rep == 0:
            result["host_bytes"] = available_loaded - _mem_available()
            result["reported_first_sleep"] = dict(method.reported)
        t2 = time.perf_counter()
        method.wake()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        sleeps.append(t1 - t0)
        wakes.append(t3 - t2)
        exact.append(bit_exact(weights, torch))
        kv.fill_(1)  # mapped again and writable
    result.update(sleep_s=sleeps, wake_s=wakes, freed_bytes=freed, bit_exact=exact, reported=dict(method.reported))
    try:
        free_before = torch.cuda.mem_get_info(device)[0]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        method.sleep(2)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        l2_freed = torch.cuda.mem_get_info(device)[0] - free_before
        method.wake()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        kv.fill_(1)
        result.update(l2_sleep_s=t1 - t0, l2_wake_s=t2 - t1, l2_freed_bytes=l2_freed, l2_bytes=offloaded + kv_pool)
    except NotApplicable as exc:
        result["l2_note"] = str(exc)
    return result


def _run_limit(result: dict[str, Any], workload: Workload, reps: int, torch: Any, device: Any) -> dict[str, Any]:
    nbytes = workload.weights_bytes
    available = _mem_available()
    started = time.perf_counter()
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    result["prepare_s"] = time.perf_counter() - started  # cudaHostAlloc of the whole buffer
    result["host_bytes"] = available - _mem_available()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    fill_seeded([dev], torch)
    sleeps, wakes, exact = [], [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        dev.zero_()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        sleeps.append(t1 - t0)
        wakes.append(t3 - t2)
        exact.append(bit_exact([dev], torch))
    result.update(
        offloaded_bytes=nbytes,
        allocations=1,
        kv_bytes=0,
        sleep_s=sleeps,
        wake_s=wakes,
        bit_exact=exact,
        l2_note="a copy, not a sleep",
    )
    return result


def _child(argv: list[str]) -> int:
    spec, workload, reps = argv[0], argv[1], int(argv[2])
    try:
        result = run_case(spec, workload, reps)
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result = {"method": spec, "workload": workload, "error": f"{type(exc).__name__}: {exc}"[:2000]}
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    # vLLM's and torch_memory_saver's pools can abort in interpreter teardown
    # (pytorch/pytorch#145168); the result is out, the driver reclaims the rest.
    os._exit(0)


# ---------------------------------------------------------------------- parent: run, summarize


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def summarize(r: dict[str, Any]) -> dict[str, Any]:
    """Derived figures of one case (GB/s first/later, medians, ratios)."""
    if r.get("error") or not r.get("sleep_s"):
        return {}
    n = r["offloaded_bytes"]
    sleep = [_gbps(n, s) for s in r["sleep_s"]]
    wake = [_gbps(n, s) for s in r["wake_s"]]
    later = sleep[1:] or sleep
    out = {
        "first_sleep_GBps": sleep[0],
        "first_sleep_s": r["sleep_s"][0],
        "later_sleep_GBps_median": statistics.median(later),
        "later_sleep_GBps_min": min(later),
        "later_sleep_GBps_max": max(later),
        "first_wake_GBps": wake[0],
        "wake_GBps_median": statistics.median(wake),
        "wake_GBps_min": min(wake),
        "wake_GBps_max": max(wake),
        "bit_exact": all(r.get("bit_exact", [False])),
        "host_ratio": r["host_bytes"] / n if r.get("host_bytes") is not None and n else None,
    }
    reported = r.get("reported_first_sleep") or {}
    if "arena_bytes" in reported and n:
        out["arena_ratio"] = reported["arena_bytes"] / n
    if "l2_sleep_s" in r:
        out["l2_sleep_ms"] = r["l2_sleep_s"] * 1e3
        out["l2_wake_ms"] = r["l2_wake_s"] * 1e3
    if r.get("freed_bytes"):
        total = r["offloaded_bytes"] + r.get("kv_bytes", 0)
        out["freed_ratio_min"] = min(r["freed_bytes"]) / total if total else None
    return out


def targets(results: list[dict[str, Any]], method: str = "fast") -> list[dict[str, Any]]:
    """The targets for `method`, per workload: met, or missed by how much."""
    rows = []
    for r in results:
        if parse_method(r["method"])[0] != method or r.get("error"):
            continue
        s = summarize(r)
        if not s:
            continue
        checks = [
            ("L1 first sleep >= 50 GB/s", s["first_sleep_GBps"], TARGET_GBPS, ">="),
            ("L1 later sleeps (each) >= 50 GB/s", s["later_sleep_GBps_min"], TARGET_GBPS, ">="),
            ("L1 wake (each) >= 50 GB/s", s["wake_GBps_min"], TARGET_GBPS, ">="),
            ("host bytes <= 1.05 x offloaded", s.get("arena_ratio", s.get("host_ratio")), TARGET_HOST_RATIO, "<="),
        ]
        if "l2_sleep_ms" in s:
            gib = r["l2_bytes"] / GiB
            checks.append((f"L2 sleep of {gib:.1f} GiB < 100 ms", s["l2_sleep_ms"], TARGET_L2_MS, "<"))
        checks.append(("bit-exact after every wake", 1.0 if s["bit_exact"] else 0.0, 1.0, ">="))
        for label, value, bound, op in checks:
            if value is None:
                rows.append(
                    {
                        "workload": r["workload"],
                        "method": r["method"],
                        "target": label,
                        "value": None,
                        "met": False,
                        "by": "not measured",
                    }
                )
                continue
            met = {"<=": value <= bound, ">=": value >= bound, "<": value < bound}[op]
            by = "" if met else f"{abs(value - bound):.3g} ({abs(value - bound) / bound:.0%})"
            rows.append(
                {
                    "workload": r["workload"],
                    "method": r["method"],
                    "target": label,
                    "value": value,
                    "met": met,
                    "by": by,
                }
            )
    return rows


def _run_child(spec: str, workload: str, reps: int, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.memory", "--child", spec, workload, str(reps)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=child_env())
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-1500:]
        return {
            "method": spec,
            "workload": workload,
            "error": f"timed out after {timeout_s} s",
            "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
        }
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if not lines:
        return {
            "method": spec,
            "workload": workload,
            "error": f"exit code {proc.returncode}, no result",
            "stderr_tail": proc.stderr[-1500:],
        }
    result = json.loads(lines[-1][len(RESULT_PREFIX) :])
    result["process_s"] = time.perf_counter() - started
    if result.get("error"):
        result["stderr_tail"] = proc.stderr[-1500:]
    return result


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": git_commit(),
        "dirty": git_dirty(),
    }
    info["gpu"] = run_quietly(
        [
            "nvidia-smi",
            "--query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max",
            "--format=csv,noheader",
        ]
    )
    try:
        with open("/proc/meminfo") as f:
            info["host_memory_GiB"] = round(int(f.readline().split()[1]) / 2**20, 1)
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            info["thp"] = f.read().strip()
    except OSError:
        pass
    for module in ("torch", "vllm", "torch_memory_saver"):
        try:
            from importlib.metadata import version

            info[module] = version(module.replace("_", "-"))
        except Exception:
            try:
                info[module] = getattr(__import__(module), "__version__", "present")
            except Exception:
                info[module] = None
    return info


# ---------------------------------------------------------------------- rendering

LABELS = {
    "limit": "host-link limit (pinned copy)",
    "vllm": "vLLM CuMemAllocator (stock)",
    "tms": "torch_memory_saver",
    "cumem": "omni-core cumem",
    "fast": "omni-core fast",
}


def _label(spec: str) -> str:
    name, options = parse_method(spec)
    return LABELS[name] + (f" ({', '.join(f'{k}={v}' for k, v in options.items())})" if options else "")


def _f(value: Any, fmt: str = "{:.1f}") -> str:
    return "-" if value is None else fmt.format(value)


def render_markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    lines = [
        "# Sleep/wake of the memory path: every method side by side (issue 7)",
        "",
        f"GPU: {m.get('gpu') or '?'}; {m.get('cpus')} CPUs, {m.get('host_memory_GiB')} GiB host memory, "
        f"THP `{m.get('thp', '?')}`; torch {m.get('torch')}, vLLM {m.get('vllm')}, torch_memory_saver "
        f"{m.get('torch_memory_saver')}; commit `{m.get('commit')}`"
        f"{' (+ uncommitted changes)' if m.get('dirty') else ''}.",
        f"Command: `{data['command']}` ({data['reps']} level-1 cycles per case; every case in a fresh process; "
        f"whole run {data.get('wall_s', 0):.0f} s).",
        "",
        "GB/s = bytes of the weights' allocations / seconds (1 GB = 1e9 B), from the sleep/wake call to the "
        "state a worker would ACK (memory released and the call returned / bytes back on the device), "
        "map/unmap included. Sleep = level 1 (weights offloaded, KV discarded). Later sleeps and wakes: "
        "median [min-max]. Host = MemAvailable drop from the loaded state to the first sleep, over the "
        "offloaded bytes (fast: its arena, exactly sized, in brackets).",
        "",
    ]
    for name in data["workloads"]:
        w = WORKLOADS.get(name)
        rows = [r for r in data["results"] if r["workload"] == name]
        if not rows:
            continue
        lines += [f"## {name}: {w.description if w else name}", ""]
        lines += [
            "| method | first L1 sleep GB/s (s) | later L1 sleeps GB/s | L1 wake GB/s | L2 sleep ms | "
            "L2 wake ms | host / offloaded | bit-exact | allocations | notes |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            s = summarize(r)
            if not s:
                lines.append(f"| {_label(r['method'])} | error: {r.get('error', 'no figures')} ||||||||| ")
                continue
            host = _f(s.get("host_ratio"), "{:.3f}")
            if "arena_ratio" in s:
                host += f" [{s['arena_ratio']:.3f}]"
            notes = []
            if r.get("prepare_s") and parse_method(r["method"])[0] in ("fast", "limit"):
                what = "arena prepared at load" if parse_method(r["method"])[0] == "fast" else "cudaHostAlloc"
                notes.append(f"{what}: {r['prepare_s']:.2f} s")
            if r.get("l2_note"):
                notes.append(f"L2: {r['l2_note']}")
            lines.append(
                f"| {_label(r['method'])} | {s['first_sleep_GBps']:.1f} ({s['first_sleep_s']:.3f}) | "
                f"{s['later_sleep_GBps_median']:.1f} "
                f"[{s['later_sleep_GBps_min']:.1f}-{s['later_sleep_GBps_max']:.1f}] | "
                f"{s['wake_GBps_median']:.1f} [{s['wake_GBps_min']:.1f}-{s['wake_GBps_max']:.1f}] | "
                f"{_f(s.get('l2_sleep_ms'))} | {_f(s.get('l2_wake_ms'))} | {host} | "
                f"{'yes' if s['bit_exact'] else '**NO**'} | {r.get('allocations', '')} | {'; '.join(notes)} |"
            )
        lines.append("")
    rows = targets(data["results"])
    if rows:
        lines += ["## Targets (omni-core fast)", "", "| workload | target | measured | met |", "|---|---|---|---|"]
        for t in rows:
            value = _f(t["value"], "{:.3f}" if t["target"].startswith("host") else "{:.3g}")
            if t["target"].startswith("bit-exact"):
                value = "yes" if t["value"] else "no"
            met = "yes" if t["met"] else "missed by " + t["by"]
            lines.append(f"| {t['workload']} | {t['target']} | {value} | {met} |")
        lines.append("")
    if data.get("notes"):
        lines += ["## Notes", "", *data["notes"], ""]
    return "\n".join(lines)


def render_png(data: dict[str, Any], path: Path) -> str | None:
    """Bars of GB/s per method and workload (first sleep, later sleeps, wake), the link
    limit of each workload drawn as a line. None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no PNG (pip install -e '.[bench]'; then --render memory.json)"
    workloads = [w for w in data["workloads"] if any(r["workload"] == w for r in data["results"])]
    methods = [m for m in dict.fromkeys(r["method"] for r in data["results"]) if parse_method(m)[0] != "limit"]
    panels = (
        ("first L1 sleep", "first_sleep_GBps"),
        ("later L1 sleeps (median)", "later_sleep_GBps_median"),
        ("L1 wake (median)", "wake_GBps_median"),
    )
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.2), sharey=True)
    width = 0.8 / max(1, len(methods))
    for ax, (title, key) in zip(axes, panels, strict=True):
        for j, method in enumerate(methods):
            values = []
            for w in workloads:
                r = next((r for r in data["results"] if r["workload"] == w and r["method"] == method), None)
                values.append((summarize(r) or {}).get(key, 0.0) if r else 0.0)
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(workloads))]
            bars = ax.bar(xs, values, width, label=_label(method))
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        for i, w in enumerate(workloads):
            r = next(
                (r for r in data["results"] if r["workload"] == w and parse_method(r["method"])[0] == "limit"), None
            )
            s = summarize(r) if r else {}
            if s:
                limit = s["wake_GBps_median"] if "wake" in key else s["later_sleep_GBps_median"]
                ax.hlines(
                    limit,
                    i - 0.45,
                    i + 0.45,
                    colors="black",
                    linewidth=2,
                    label="host-link limit (pinned copy)" if i == 0 else None,
                )
        ax.axhline(TARGET_GBPS, color="red", linestyle="--", linewidth=1, label="target 50 GB/s")
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GB/s (weights bytes / end-to-end time)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"Sleep/wake GB/s per method and workload — {data['machine'].get('gpu', '').split(',')[0]}")
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def write_outputs(data: dict[str, Any], out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    (out / "memory.md").write_text(render_markdown(data))
    written = [str(out / "memory.json"), str(out / "memory.md")]
    problem = render_png(data, out / "memory.png")
    if problem:
        print(problem, file=sys.stderr)
    else:
        written.append(str(out / "memory.png"))
    return written


def _cuda_problem() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not importable"
    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} sees no CUDA device; the memory benchmark runs on a GPU "
            "(`python -m benchmarks --control-plane` runs on CPU)"
        )
    return None


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or "bench-results")
    if getattr(args, "render", None):
        data = json.loads(Path(args.render).read_text())
        for path in write_outputs(data, out):
            print(f"wrote {path}")
        return 0
    methods = [m for group in (args.methods or [",".join(METHODS)]) for m in group.split(",") if m]
    workloads = [w for group in (args.workloads or [",".join(DEFAULT_WORKLOADS)]) for w in group.split(",") if w]
    for m in methods:
        parse_method(m)
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        print(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}", file=sys.stderr)
        return 2
    problem = _cuda_problem()
    if problem:
        print(f"python -m benchmarks: {problem}", file=sys.stderr)
        return 2
    reps = args.reps or (2 if args.short else 4)
    started = time.perf_counter()
    results = []
    for workload in workloads:
        for method in methods:
            if parse_method(method)[0] == "tms" and not _importable("torch_memory_saver"):
                results.append({"method": method, "workload": workload, "error": "torch_memory_saver is not installed"})
                continue
            r = _run_child(method, workload, reps, args.case_timeout_s)
            results.append(r)
            partial = {
                "command": " ".join(["omni-core", *sys.argv[1:]]),
                "machine": {},
                "reps": reps,
                "workloads": workloads,
                "methods": methods,
                "results": results,
                "partial": True,
            }
            out.mkdir(parents=True, exist_ok=True)
            (out / "memory.json").write_text(json.dumps(partial, indent=1, sort_keys=True) + "\n")
            s = summarize(r)
            print(
                f"{workload:>6} {method:<28} "
                + (
                    f"first {s['first_sleep_GBps']:6.1f}  later {s['later_sleep_GBps_median']:6.1f}  "
                    f"wake {s['wake_GBps_median']:6.1f} GB/s  L2 {_f(s.get('l2_sleep_ms'))} ms  "
                    f"host x{_f(s.get('host_ratio'), '{:.3f}')}  exact {s['bit_exact']}"
                    if s
                    else f"error: {r.get('error')}"
                ),
                flush=True,
            )
    data = {
        "command": " ".join(["omni-core", *sys.argv[1:]]),
        "machine": machine_info(),
        "reps": reps,
        "workloads": workloads,
        "methods": methods,
        "results": results,
        "wall_s": time.perf_counter() - started,
    }
    for path in write_outputs(data, out):
        print(f"wrote {path}")
    broken = [r for r in results if r.get("error") and "not installed" not in r["error"]]
    inexact = [r for r in results if summarize(r) and not summarize(r)["bit_exact"]]
    return 1 if broken or inexact else 0


def _importable(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


if __name__ == "__main__":
    # Only as the benchmark's own child process; people run `python -m benchmarks` (which
    # imports this module, so this module does not import it back).
    if len(sys.argv) < 2 or sys.argv[1] != "--child":
        raise SystemExit("this module runs as the benchmark's child process; run `python -m benchmarks` instead")
    _child(sys.argv[2:])
