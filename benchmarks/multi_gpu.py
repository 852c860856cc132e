"""`python -m benchmarks --multi-gpu`: tensor-parallel stages on two GPUs.

Three parts, each with a fresh Engine, every output compared with the one taken first:

- `tp`: a TP=2 stage (rank r on GPU r) through level-1 sleep/wake, level 2 + reload and a
  partial wake (weights only: a request is refused naming PARTIAL; then the KV cache). Per
  rank: the ACK's own NVML figure (the source is recorded and checked to be NVML on a GPU)
  and sleep/wake GB/s from its weights pool bytes over its own command time; per stage the
  aggregate GB/s (both ranks' bytes over the stage's time: both GPUs' links at once). Runs
  each language-model stage that can run here (`--runners`): `vllm` (real Qwen2 weights, TP
  through vLLM's external_launcher) where vLLM imports, `transformers` (the same checkpoint
  sharded by transformers' own plan; a tiny Qwen2 on CPU), and the synthetic
  tensor-parallel runner (Megatron MLP blocks, all-reduce over NCCL or gloo, output checked
  bit for bit).
- `ray`: the vllm and synthetic stages through `Engine(launcher="ray")`, one actor per rank in a STRICT_PACK
  placement group (one GPU each). Rank 1's actor is killed (`ray.kill`) while the stage
  sleeps: the stage must be FAILED naming rank 1 and its node; a restart brings it back
  RUNNING with the same output. Reports "skipped: ray not importable" where Ray is absent.
- `swap`: two TP=2 stages of synthetic weights on the same two GPUs; `Engine.swap(a, b)`
  (sleep and wake at once) against the sequential sleep a + wake b, alternating, with the
  output of each stage bit-exact after every move. GB/s per GPU: the bytes both stages' ranks
  on that GPU moved over the move's time.

The CPU smoke mode (`--device cpu`, CI) runs the same parts on gloo with small synthetic
weights, and the swap on a SimulatedDevice that cannot hold both stages at once; parts that
need a GPU (the vllm stage) skip and say why.

Writes multi_gpu.json and multi_gpu.md under --out, after every part (a run cut off by its
time limit keeps what it finished).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_core.engine import Engine, LifecycleReport, RequestRejectedError, StageSpec
from omni_core.engine.spec import RayPlacement

PARTS = ("tp", "ray", "swap")
RUNNERS = ("vllm", "transformers", "synthetic")  # the TP stages parts tp and ray may run
GiB = 1 << 30
TP_RUNNER = "omni_core.runners.tensor_parallel:TensorParallelRunner"
LLM_REQUEST = {"prompt_ids": [[17, 42, 101, 7, 300, 5], [250, 33, 98, 411]], "max_new_tokens": 24, "stop_at_eos": False}
TP_PROBE = {"seed": 9, "batch": 4}
REFUSAL_TIMEOUT_S = 30.0
KILL_WAIT_S = 60.0  # for the killed actor's stage to be declared FAILED
POLL_S = 0.001


@dataclass
class Config:
    device: str = "cuda"  # "cuda": two GPUs; "cpu": gloo, portable backend, simulated device
    parts: tuple[str, ...] = PARTS
    runners: tuple[str, ...] = RUNNERS
    models_dir: Path = Path("/tmp/omni-core-models")
    llm_size: str = "1.5b"  # the vllm stage's Qwen2 checkpoint (omni-core models make)
    backend: str = "cumem"  # on CUDA: the allocator backend of every stage
    fraction: float = 0.3  # the vllm stage's gpu_memory_fraction on each GPU
    cycles: int = 2  # level-1 cycles, and swap/sequential moves each way
    attention_backend: str | None = None
    tp_args: dict[str, Any] = field(default_factory=dict)  # synthetic TP stage (part tp, ray)
    swap_args: dict[str, Any] = field(default_factory=dict)  # each swapped stage

    def __post_init__(self) -> None:
        unknown = sorted(set(self.parts) - set(PARTS))
        if unknown:
            raise ValueError(f"unknown part(s) {unknown}; the parts are {list(PARTS)}")
        unknown = sorted(set(self.runners) - set(RUNNERS))
        if unknown:
            raise ValueError(f"unknown runner(s) {unknown}; the TP runners are {list(RUNNERS)}")
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        cuda = self.device == "cuda"
        # On a GPU: 2.1 GB of bf16 weights per rank (tp), 4.3 GB per rank and stage (swap).
        self.tp_args = self.tp_args or (
            {"hidden": 8192, "layers": 16, "dtype": "bfloat16", "kv_rows": 64}
            if cuda
            else {"hidden": 64, "layers": 3, "kv_rows": 16, "cpu_threads": 1}
        )
        self.swap_args = self.swap_args or (
            {"hidden": 8192, "layers": 32, "dtype": "bfloat16", "kv_rows": 64}
            if cuda
            else {"hidden": 256, "layers": 4, "kv_rows": 16, "cpu_threads": 1}
        )


def gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


def digest(output: Any) -> str:
    """One digest for either runner's output: the token ids, or the tensor's own sha256."""
    if isinstance(output, dict) and "sha256" in output:
        return str(output["sha256"])
    tokens = output["token_ids"] if isinstance(output, dict) else output
    return hashlib.sha256(json.dumps(tokens, sort_keys=True).encode()).hexdigest()


class Log:
    """Checks and per-rank lifecycle rows of one part, printed as they happen."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.checks: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.started = time.perf_counter()

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"what": what, "ok": bool(ok), "detail": detail})
        elapsed_s = time.perf_counter() - self.started
        print(f"  [{self.part} {elapsed_s:6.1f}s] {'ok  ' if ok else 'MISS'} {what} {detail}".rstrip(), flush=True)
        return ok

    def lifecycle(self, stage: str, what: str, report: LifecycleReport, expect: str, *, nvml: bool) -> LifecycleReport:
        rows = rank_rows(stage, what, report)
        self.rows.extend(rows)
        total = sum(r["weights_bytes"] for r in rows)
        rates = ", ".join(f"rank {r['rank']} {r['weights_GBps']} GB/s" for r in rows if r["weights_GBps"])
        self.check(
            f"{stage} {what} -> {expect}",
            report.state == expect,
            f"(got {report.state}; {report.duration_s * 1000:.1f} ms; {total / 1e9:.2f} GB weights"
            f"{'; ' + rates if rates else ''})",
        )
        if nvml:
            sources = {r["rank"]: r["process_source"] for r in rows}
            self.check(
                f"{stage} {what}: each rank's ACK carries its own NVML figure",
                all(str(s).startswith("nvml") for s in sources.values())
                and all(r["process_after"] is not None for r in rows),
                f"{sources}",
            )
        return report


def rank_rows(stage: str, what: str, report: LifecycleReport) -> list[dict[str, Any]]:
    rows = []
    for rank, rr in sorted(report.ranks.items()):
        weights = max(rr.pool_bytes_before.get("weights", 0), rr.pool_bytes_after.get("weights", 0))
        moves = what.startswith(("sleep L1", "wake L1", "wake weights", "reload", "swap", "sequential"))
        rows.append(
            {
                "stage": stage,
                "what": what,
                "rank": rank,
                "state": rr.state,
                "stage_s": report.duration_s,
                "rank_s": rr.duration_s,
                "weights_bytes": weights,
                "pool_before": rr.pool_bytes_before,
                "pool_after": rr.pool_bytes_after,
                "process_before": rr.process_bytes_before,
                "process_after": rr.process_bytes_after,
                "process_source": rr.process_bytes_source,
                "weights_GBps": gbps(weights, rr.duration_s) if moves else None,
            }
        )
    return rows


def stage_gbps(report: LifecycleReport) -> float | None:
    """Both ranks' weights over the stage's time: the two GPUs' links at once."""
    total = sum(
        max(r.pool_bytes_before.get("weights", 0), r.pool_bytes_after.get("weights", 0)) for r in report.ranks.values()
    )
    return gbps(total, report.duration_s)


# ---------------------------------------------------------------------- stages


@dataclass(frozen=True)
class StagePlan:
    """A TP=2 stage to drive: its spec and its probe request."""

    kind: str  # "vllm" | "transformers" | "synthetic"
    spec: StageSpec
    probe: dict[str, Any]


def vllm_problem(cfg: Config) -> str | None:
    if cfg.device != "cuda":
        return "the vllm runner needs CUDA (--device cuda)"
    try:
        import vllm  # noqa: F401
    except Exception as exc:
        return f"vllm not importable ({type(exc).__name__}: {exc})"
    return None


def common_args(cfg: Config) -> dict[str, Any]:
    return {
        "ranks": 2,
        "device": cfg.device,
        "backend": cfg.backend if cfg.device == "cuda" else "portable",
        "admission": "reject",
        "deadline_s": 300.0,
        "start_deadline_s": 600.0,
        "request_timeout_s": 300.0,
    }


def two_rank_spec(cfg: Config, name: str, runner: str, args: dict[str, Any], **extra: Any) -> StageSpec:
    """A TP=2 stage with the common arguments: rank r on GPU r (unless Ray places it)."""
    devices = ("0", "1") if cfg.device == "cuda" and "placement" not in extra else None
    return StageSpec(name, runner=runner, runner_args=args, devices=devices, **{**common_args(cfg), **extra})


def synthetic_plan(cfg: Config, name: str, args: dict[str, Any], **extra: Any) -> StagePlan:
    return StagePlan("synthetic", two_rank_spec(cfg, name, TP_RUNNER, args, **extra), TP_PROBE)


def vllm_plan(cfg: Config, name: str, model: Path, **extra: Any) -> StagePlan:
    args: dict[str, Any] = {
        "model": str(model),
        "max_model_len": 1024,
        "max_num_seqs": 4,
        # Each rank sees only its own GPU: vLLM's custom all-reduce maps its
        # peer's memory over CUDA IPC, which needs the peer visible; NCCL does not.
        "engine_args": {"disable_custom_all_reduce": True},
    }
    if cfg.attention_backend:
        args["attention_backend"] = cfg.attention_backend
    devices = ("0", "1") if "placement" not in extra else None
    spec = StageSpec(
        name,
        runner="vllm",
        runner_args=args,
        devices=devices,
        gpu_memory_fraction=cfg.fraction,
        **{**common_args(cfg), "backend": cfg.backend, **extra},
    )
    return StagePlan("vllm", spec, LLM_REQUEST)


def transformers_plan(cfg: Config, name: str, model: Path, **extra: Any) -> StagePlan:
    args: dict[str, Any] = {
        "model": str(model),
        "max_batch": 2,
        "max_seq_len": 256,
        **({"dtype": "bfloat16"} if cfg.device == "cuda" else {"cpu_threads": 1}),
    }
    return StagePlan("transformers", two_rank_spec(cfg, name, "transformers", args, **extra), LLM_REQUEST)


def llm_checkpoint(cfg: Config, size: str | None = None) -> Path:
    from omni_core.demo_real import cached_checkpoint

    size = size or cfg.llm_size
    path, made_s = cached_checkpoint(cfg.models_dir, "qwen2", size, log=lambda m: print(m, flush=True))
    print(f"qwen2 {size}: {path} ({f'made in {made_s:.1f} s' if made_s else 'cached'})", flush=True)
    return path


def tp_plans(cfg: Config, log: Log, runners: tuple[str, ...] | None = None, **extra: Any) -> list[StagePlan]:
    wanted = [r for r in cfg.runners if runners is None or r in runners]
    plans = []
    if "vllm" in wanted:
        problem = vllm_problem(cfg)
        if problem is None:
            plans.append(vllm_plan(cfg, "llm", llm_checkpoint(cfg), **extra))
        else:
            log.check("vllm TP=2 stage skipped", True, f"({problem})")
    if "transformers" in wanted:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            log.check("transformers TP=2 stage skipped", True, f"(transformers not importable: {exc})")
        else:  # the real 1.5B on GPUs; on CPU a tiny one, which runs in seconds
            size = cfg.llm_size if cfg.device == "cuda" else "tiny"
            plans.append(transformers_plan(cfg, "hf", llm_checkpoint(cfg, size), **extra))
    if "synthetic" in wanted:
        plans.append(synthetic_plan(cfg, "tp", cfg.tp_args, **extra))
    return plans


# ---------------------------------------------------------------------- part tp


def refused(engine: Engine, plan: StagePlan, state: str, log: Log) -> bool:
    try:
        engine.execute(plan.spec.name, plan.probe, timeout_s=REFUSAL_TIMEOUT_S)
    except RequestRejectedError as exc:
        return log.check(
            f"{plan.spec.name} in {state} refuses a request naming {state}", state in str(exc), f"({str(exc)[:120]})"
        )
    return log.check(f"{plan.spec.name} in {state} refuses a request naming {state}", False, "(it was served)")


def drive_tp(engine: Engine, plan: StagePlan, log: Log, cfg: Config) -> dict[str, Any]:
    """Every lifecycle of one TP=2 stage, the output compared with the first after each."""
    name, nvml = plan.spec.name, cfg.device == "cuda"
    started = time.perf_counter()
    reference = digest(engine.execute(name, plan.probe))
    result: dict[str, Any] = {
        "stage": name,
        "kind": plan.kind,
        "reference": reference,
        "request_s": round(time.perf_counter() - started, 3),
        "stage_GBps": [],
    }

    def same(what: str) -> bool:
        got = digest(engine.execute(name, plan.probe))
        return log.check(f"{name} output {what} identical", got == reference, f"({got[:12]})")

    def step(what: str, call: Callable[[], LifecycleReport], expect: str) -> LifecycleReport:
        report = log.lifecycle(name, what, call(), expect, nvml=nvml)
        result["stage_GBps"].append({"what": what, "GBps": stage_gbps(report), "stage_s": report.duration_s})
        return report

    for cycle in range(cfg.cycles):
        label = " (first)" if cycle == 0 else ""
        step(f"sleep L1{label}", lambda: engine.sleep(name, level=1), "SLEEPING")
        step(f"wake L1{label}", lambda: engine.wake(name), "RUNNING")
        same(f"after L1 cycle {cycle + 1}")
    step("sleep L2", lambda: engine.sleep(name, level=2), "SLEEPING")
    step("wake L2", lambda: engine.wake(name), "NEEDS_RELOAD")
    refused(engine, plan, "NEEDS_RELOAD", log)
    step("reload", lambda: engine.reload_weights(name), "RUNNING")
    same("after L2 + reload")
    step("sleep L1 (partial)", lambda: engine.sleep(name, level=1), "SLEEPING")
    step("wake weights", lambda: engine.wake(name, tags=["weights"]), "PARTIAL")
    refused(engine, plan, "PARTIAL", log)
    step("wake kv_cache", lambda: engine.wake(name, tags=["kv_cache"]), "RUNNING")
    same("after partial wake")
    return result


def part_tp(cfg: Config) -> dict[str, Any]:
    log = Log("tp")
    stages = []
    for plan in tp_plans(cfg, log):
        print(f"tp: stage {plan.spec.name} ({plan.kind}, 2 ranks, {cfg.device})", flush=True)
        stages.append(run_engine(log, [plan.spec], lambda e, p=plan: drive_tp(e, p, log, cfg)))
    return {"checks": log.checks, "lifecycle": log.rows, "stages": stages}


def run_engine(
    log: Log, specs: list[StageSpec], body: Callable[[Engine], dict[str, Any]], **engine_args: Any
) -> dict[str, Any]:
    """One Engine around `body`; an exception becomes a failed check with its traceback."""
    started = time.perf_counter()
    try:
        with Engine(specs, **engine_args) as engine:
            start_s = round(time.perf_counter() - started, 2)
            log.check(f"engine started ({', '.join(s.name for s in specs)})", True, f"({start_s} s)")
            return {**body(engine), "start_s": start_s, "wall_s": round(time.perf_counter() - started, 2)}
    except Exception as exc:
        log.check(f"engine of {[s.name for s in specs]} ran to the end", False, f"{type(exc).__name__}: {exc}")
        return {
            "stages": [s.name for s in specs],
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": traceback.format_exc()[-4000:],
        }


# ---------------------------------------------------------------------- part ray


def kill_during_sleep(engine: Engine, name: str, rank: int, log: Log) -> dict[str, Any]:
    """Start a level-1 sleep and kill `rank`'s actor as soon as the stage has left RUNNING."""
    import ray

    outcome: dict[str, Any] = {}

    def sleeper() -> None:
        try:
            outcome["report"] = engine.sleep(name, level=1)
        except Exception as exc:
            outcome["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=sleeper, daemon=True)
    actor = engine._orch._stages[name].procs[rank]  # the RayRank: its actor and node
    thread.start()
    seen = "RUNNING"
    while thread.is_alive() and seen == "RUNNING":
        seen = engine.status()[name]["state"]
        time.sleep(POLL_S)
    ray.kill(actor.actor, no_restart=True)
    thread.join(KILL_WAIT_S)
    deadline_at = time.monotonic() + KILL_WAIT_S
    while engine.status()[name]["state"] != "FAILED" and time.monotonic() < deadline_at:
        time.sleep(0.05)
    status = engine.status()[name]
    failure = str(status.get("failure") or "")
    log.check(
        f"{name} rank {rank} killed while the stage was {seen}",
        True,
        f"(sleep call: {outcome.get('error', 'completed')[:160]})",
    )
    log.check(
        f"{name} FAILED naming rank {rank} and its node",
        status["state"] == "FAILED" and f"rank {rank}" in failure and actor.node in failure,
        f"({failure[:200]})",
    )
    return {
        "state_at_kill": seen,
        "sleep_outcome": outcome.get("error", "completed"),
        "failure": failure,
        "node": actor.node,
    }


def drive_ray(engine: Engine, plan: StagePlan, log: Log, cfg: Config) -> dict[str, Any]:
    name = plan.spec.name
    reference = digest(engine.execute(name, plan.probe))
    nodes = {r.rank: r.node for r in engine._orch._stages[name].procs}
    log.check(f"{name}: one actor per rank", len(nodes) == 2, f"({nodes})")
    sleep = log.lifecycle(name, "sleep L1", engine.sleep(name, level=1), "SLEEPING", nvml=cfg.device == "cuda")
    log.lifecycle(name, "wake L1", engine.wake(name), "RUNNING", nvml=cfg.device == "cuda")
    log.check(f"{name} output after L1 identical", digest(engine.execute(name, plan.probe)) == reference)
    killed = kill_during_sleep(engine, name, 1, log)
    epoch = engine.status()[name]["epoch"]
    started = time.perf_counter()
    engine.restart(name)
    restart_s = round(time.perf_counter() - started, 2)
    status = engine.status()[name]
    log.check(
        f"{name} restarted -> RUNNING in a new epoch",
        status["state"] == "RUNNING" and status["epoch"] == epoch + 1,
        f"({status['state']}, epoch {status['epoch']}, {restart_s} s)",
    )
    log.check(f"{name} output after the restart identical", digest(engine.execute(name, plan.probe)) == reference)
    return {
        "stage": name,
        "kind": plan.kind,
        "reference": reference,
        "nodes": nodes,
        "restart_s": restart_s,
        "sleep_GBps": stage_gbps(sleep),
        **killed,
    }


def part_ray(cfg: Config) -> dict[str, Any]:
    log = Log("ray")
    try:
        import ray
    except Exception as exc:
        return {"skipped": f"ray not importable ({type(exc).__name__}: {exc})"}
    placement = RayPlacement(num_cpus=1, num_gpus=1 if cfg.device == "cuda" else 0, strategy="STRICT_PACK")
    own = not ray.is_initialized()
    if own:  # a one-node cluster of this machine's GPUs
        ray.init(
            num_cpus=4,
            num_gpus=2 if cfg.device == "cuda" else 0,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=200 << 20,
        )
    try:
        stages = []
        # The Ray run committed in benchmarks/results/multi_gpu_ray is of these two.
        for plan in tp_plans(cfg, log, runners=("vllm", "synthetic"), placement=placement):
            print(f"ray: stage {plan.spec.name} ({plan.kind}, 2 actors, STRICT_PACK)", flush=True)
            stages.append(run_engine(log, [plan.spec], lambda e, p=plan: drive_ray(e, p, log, cfg), launcher="ray"))
    finally:
        if own:
            ray.shutdown()
    return {"checks": log.checks, "lifecycle": log.rows, "stages": stages, "ray": ray.__version__}


# ---------------------------------------------------------------------- part swap


def drive_swap(engine: Engine, log: Log, cfg: Config) -> dict[str, Any]:
    probe = TP_PROBE
    reference = {s: digest(engine.execute(s, probe)) for s in ("a", "b")}
    log.lifecycle("b", "sleep L1 (setup)", engine.sleep("b", level=1), "SLEEPING", nvml=False)
    moves: list[dict[str, Any]] = []
    awake = "a"
    for cycle in range(cfg.cycles):
        for how in ("sequential", "swap"):
            out, into = awake, "b" if awake == "a" else "a"
            started = time.perf_counter()
            if how == "swap":
                report = engine.swap(out, into)
                halves = (report.outgoing, report.incoming)
            else:
                halves = (engine.sleep(out, level=1), engine.wake(into))
            wall_s = time.perf_counter() - started
            log.lifecycle(out, f"{how} out", halves[0], "SLEEPING", nvml=False)
            log.lifecycle(into, f"{how} in", halves[1], "RUNNING", nvml=False)
            got = digest(engine.execute(into, probe))
            log.check(f"{into} output after {how} #{cycle + 1} bit-exact", got == reference[into], f"({got[:12]})")
            moves.append(move_figures(how, out, into, halves, wall_s))
            awake = into
    return {"reference": reference, "moves": moves, "summary": summarize_moves(moves)}


def move_figures(
    how: str, out: str, into: str, halves: tuple[LifecycleReport, LifecycleReport], wall_s: float
) -> dict[str, Any]:
    """Per GPU (= rank index: rank r of both stages is on GPU r): the bytes both stages'
    ranks there moved (out to host, in to device) over the whole move's time."""
    per_gpu = {}
    for rank in sorted(halves[0].ranks):
        moved = sum(
            max(h.ranks[rank].pool_bytes_before.get("weights", 0), h.ranks[rank].pool_bytes_after.get("weights", 0))
            for h in halves
        )
        per_gpu[rank] = {"bytes": moved, "GBps": gbps(moved, wall_s)}
    return {
        "how": how,
        "out": out,
        "in": into,
        "wall_s": round(wall_s, 4),
        "out_s": halves[0].duration_s,
        "in_s": halves[1].duration_s,
        "per_gpu": per_gpu,
    }


def summarize_moves(moves: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for how in ("sequential", "swap"):
        rows = [m for m in moves if m["how"] == how]
        if not rows:
            continue
        gpus = sorted(rows[0]["per_gpu"])
        out[how] = {
            "median_s": round(statistics.median(m["wall_s"] for m in rows), 4),
            "GBps_per_gpu": {g: round(statistics.median(m["per_gpu"][g]["GBps"] or 0 for m in rows), 2) for g in gpus},
        }
    if "swap" in out and "sequential" in out and out["swap"]["median_s"] > 0:
        out["speedup"] = round(out["sequential"]["median_s"] / out["swap"]["median_s"], 2)
    return out


def part_swap(cfg: Config) -> dict[str, Any]:
    log = Log("swap")
    extra: dict[str, Any] = {}
    workdir = None
    if cfg.device == "cpu":
        from omni_core.workers.simulated_device import SimulatedDevice

        # One simulated device for all four ranks, room for one stage and a half: the
        # incoming stage maps only what the outgoing one has released.
        workdir = tempfile.mkdtemp(prefix="omni-multigpu-")
        hidden, layers = cfg.swap_args["hidden"], cfg.swap_args["layers"]
        stage_bytes = 2 * layers * 2 * hidden * hidden // 2 * 4 + 2 * cfg.swap_args["kv_rows"] * hidden * 4
        extra["simulated_device"] = SimulatedDevice(str(Path(workdir) / "gpu"), int(1.5 * stage_bytes))
    plans = [
        synthetic_plan(cfg, name, {**cfg.swap_args, "seed": seed}, **extra) for name, seed in (("a", 11), ("b", 12))
    ]
    print(f"swap: stages a and b (synthetic TP=2 each, {cfg.device})", flush=True)
    result = run_engine(log, [p.spec for p in plans], lambda e: drive_swap(e, log, cfg))
    return {"checks": log.checks, "lifecycle": log.rows, **result}


# ---------------------------------------------------------------------- output


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "vllm", "ray"):
        try:
            out[name] = str(getattr(__import__(name), "__version__", "present"))
        except Exception:
            out[name] = None
    return out


def gpus() -> list[str]:
    try:
        import torch

        return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        return []


def verdict(data: dict[str, Any]) -> str:
    ran = [p for p in data["parts"].values() if "checks" in p]
    if any(not c["ok"] for p in ran for c in p["checks"]) or any(
        "error" in s for p in ran for s in p.get("stages", [p])
    ):
        return "FAIL"
    if len(data["parts"]) < len(data["config"]["parts"]):
        return "INCOMPLETE"
    return "PASS" if ran else "NOTHING RAN"


def render_markdown(data: dict[str, Any]) -> str:
    m, parts = data["machine"], data["parts"]
    lines = [
        "# Tensor-parallel stages on two GPUs (issue 18)",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {m.get('host')}; GPUs: {', '.join(data['gpus']) or 'none'}; {m.get('cpus')} CPUs |",
        f"| versions | {', '.join(f'{k} {v}' for k, v in data['versions'].items())} |",
        f"| commit | `{m.get('commit')}`{' (+ uncommitted changes)' if m.get('dirty') else ''} |",
        f"| command | `{data['command']}` |",
        f"| device | {data['config']['device']} |",
        f"| wall | {data['wall_s']} s |",
        f"| verdict | {data['verdict']} |",
        "",
    ]
    for name, part in parts.items():
        lines += [f"## {name}", ""]
        if "skipped" in part:
            lines += [f"skipped: {part['skipped']}", ""]
            continue
        missed = [c["what"] for c in part["checks"] if not c["ok"]]
        lines += [
            f"checks: {len(part['checks']) - len(missed)}/{len(part['checks'])} ok; missed: "
            f"{'; '.join(missed) or 'none'}",
            "",
        ]
        for stage in part.get("stages", []):
            if "error" in stage:
                lines += [f"error: `{stage['error']}`", ""]
        if name in ("tp", "ray"):
            lines += [
                "| stage | step | rank | state | rank s | weights GB | GB/s | process before -> after GiB | source |",
                "|---|---|---|---|---|---|---|---|---|",
            ]
            for r in part["lifecycle"]:
                lines.append(
                    f"| {r['stage']} | {r['what']} | {r['rank']} | {r['state']} | {r['rank_s']:.4f} | "
                    f"{r['weights_bytes'] / 1e9:.2f} | {r['weights_GBps'] or '-'} | "
                    f"{_gib(r['process_before'])} -> {_gib(r['process_after'])} | "
                    f"{str(r['process_source']).split(':')[0]} |"
                )
            for stage in part.get("stages", []):
                for s in stage.get("stage_GBps", []):
                    if s["GBps"] and s["what"].startswith(("sleep L1", "wake L1")):
                        lines.append(
                            f"\n{stage['stage']} {s['what']}: both ranks together {s['GBps']} GB/s "
                            f"({s['stage_s'] * 1000:.1f} ms)"
                        )
            for stage in part.get("stages", []):
                if "failure" in stage:
                    lines += [
                        "",
                        f"{stage['stage']}: killed rank 1 while {stage['state_at_kill']}; "
                        f"failure: `{stage['failure'][:300]}`; restart {stage['restart_s']} s",
                    ]
        if name == "swap" and "summary" in part:
            lines += [
                "| how | out -> in | wall s | out s | in s | GB/s GPU 0 | GB/s GPU 1 |",
                "|---|---|---|---|---|---|---|",
            ]
            for mv in part["moves"]:
                g = mv["per_gpu"]
                lines.append(
                    f"| {mv['how']} | {mv['out']} -> {mv['in']} | {mv['wall_s']} | {mv['out_s']:.4f} | "
                    f"{mv['in_s']:.4f} | {g.get(0, g.get('0', {})).get('GBps')} | "
                    f"{g.get(1, g.get('1', {})).get('GBps')} |"
                )
            lines += ["", f"summary: `{json.dumps(part['summary'])}`"]
        lines.append("")
    return "\n".join(lines)


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def write_outputs(data: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "multi_gpu.json", out / "multi_gpu.md"]
    paths[0].write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    paths[1].write_text(render_markdown(data))
    return paths


RUNS: dict[str, Callable[[Config], dict[str, Any]]] = {"tp": part_tp, "ray": part_ray, "swap": part_swap}


def run_bench(cfg: Config, command: str, out: Path | None = None) -> dict[str, Any]:
    from benchmarks.memory import machine_info

    started = time.perf_counter()
    data: dict[str, Any] = {
        "command": command,
        "machine": machine_info(),
        "gpus": gpus(),
        "versions": versions(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "parts": {},
    }
    for part in cfg.parts:
        part_started = time.perf_counter()
        print(f"part {part}:", flush=True)
        try:
            data["parts"][part] = RUNS[part](cfg)
        except Exception as exc:
            data["parts"][part] = {
                "checks": [{"what": f"part {part} ran", "ok": False, "detail": str(exc)}],
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        data["parts"][part]["wall_s"] = round(time.perf_counter() - part_started, 2)
        data["wall_s"] = round(time.perf_counter() - started, 1)
        data["verdict"] = verdict(data)
        print(f"part {part}: {data['parts'][part]['wall_s']} s", flush=True)
        if out is not None:
            write_outputs(data, out)
    data["wall_s"] = round(time.perf_counter() - started, 1)
    data["verdict"] = verdict(data)
    return data


def main(args: argparse.Namespace) -> int:
    device = getattr(args, "device", None) or "cuda"
    parts = tuple(p for p in (args.parts or ",".join(PARTS)).split(",") if p)
    runners = tuple(r for r in (getattr(args, "runners", None) or ",".join(RUNNERS)).split(",") if r)
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            print(
                f"python -m benchmarks --multi-gpu: {torch.cuda.device_count()} CUDA device(s) visible; this needs "
                "two GPUs (or --device cpu for the CPU smoke run)",
                file=sys.stderr,
            )
            return 2
    cfg = Config(
        device=device,
        parts=parts,
        runners=runners,
        models_dir=Path(args.models_dir),
        attention_backend=os.environ.get("VLLM_BUNDLE_ATTN_BACKEND"),
        cycles=getattr(args, "reps", None) or 2,
    )
    out = Path(args.out or "multi-gpu-results")
    data = run_bench(cfg, " ".join(["omni-core", *sys.argv[1:]]), out)
    for path in write_outputs(data, out):
        print(f"wrote {path}")
    print(f"verdict: {data['verdict']}", flush=True)
    return 0 if data["verdict"] == "PASS" else 1
