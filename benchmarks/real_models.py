"""`python -m benchmarks --real-models`: a real LLM stage and a real DiT stage co-located on one GPU.

Two stages of one rank each share one GPU, each under its own
`gpu_memory_fraction`: `llm` (the `transformers` runner, Qwen2 1.5B in bfloat16, its KV cache
sized by the fraction) and `dit` (the `diffusers` runner, a 600M-parameter class-conditional
DiT pipeline in float32, step-wise requests in a pool of their own). For each memory backend
(`cumem`, `fast`) a fresh Engine goes through every lifecycle, and after each one the stage's
output is taken again and compared with the first: the token ids (and their sha256), and the
sha256 of the DiT's raw output tensor.

    level-1 cycles of each stage while the other serves (the first sleep is timed apart:
      cumem pins its host copies then)
    level 2 + reload of each stage (a request in between must be refused)
    partial wake of the LLM (weights only: refuses work; then the KV cache)
    a step-wise DiT request interrupted by a level-1 sleep
    both stages asleep at once (level 1, then level 2): what stays in use on the device

Memory figures are each rank's own (NVML, its pid; the source is recorded) before and after
every sleep and wake: the full-cycle audit active -> sleeping -> active. GB/s count the
bytes of the `weights` pool over the rank's own command time (received to ACK ready); decimal
GB, as the design's anchors. The checkpoints are made with `omni-core models make` (seeded
random weights; no hub) or given as directories.

Writes real_models.json (everything) and real_models.md (the tables) under --out.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_core.demo import fmt_bytes
from omni_core.engine import Engine, LifecycleReport, RequestRejectedError, StageSpec

GiB = 1 << 30
BACKENDS = ("cumem", "fast")
SIZES = {"large": ("1.5b", "600m"), "tiny": ("tiny", "tiny")}
# Seeded sampling: a weight that came back wrong changes the drawn tokens even where the
# argmax would survive it. A batch of two prompts: the KV cache's rows both matter.
# Ids below 512, the tiny models' vocabulary, so the same request runs at every size.
LLM_REQUEST = {
    "prompt_ids": [[17, 42, 101, 7, 300, 5], [250, 33, 98, 411]],
    "max_new_tokens": 32,
    "stop_at_eos": False,
    "sampling": {"temperature": 0.8, "seed": 1},
}
DIT_SCHEDULER = "DPMSolverMultistepScheduler"  # keeps past outputs: step-wise state beyond the latents
DIT_CLASS, DIT_SEED = 207, 3
# The weights pool must hold the checkpoint's bytes (safetensors headers aside): weights left
# outside it stay resident through every sleep, and the outputs then agree for no merit.
MIN_POOL_OVER_CHECKPOINT = 0.98
REFUSAL_TIMEOUT_S = 30.0
AT_ONCE_BOUND_S = REFUSAL_TIMEOUT_S / 10


@dataclass
class Config:
    backends: tuple[str, ...] = BACKENDS
    size: str = "large"
    llm_model: Path | None = None  # a local transformers directory; None: made in models_dir
    dit_model: Path | None = None  # a local diffusers directory; None: made in models_dir
    models_dir: Path = Path("/tmp/omni-core-models")
    llm_fraction: float = 0.30
    dit_fraction: float = 0.20
    cycles: int = 3  # level-1 cycles per stage: the first and the later ones
    dit_steps: int = 20
    llm_max_batch: int = 2
    device: str = "cuda"


def _gbps(nbytes: int, seconds: float) -> float | None:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else None


def _sha(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def device_used_bytes() -> int | None:
    """Device-wide used bytes of the GPU this process would call cuda:0, from NVML (this
    process holds no CUDA context: the figure is the ranks' and anyone else's)."""
    try:
        import os

        from omni_core.workers.accounting import PynvmlApi, parse_cuda_visible_devices, resolve_physical_device

        api = PynvmlApi()
        device = resolve_physical_device(parse_cuda_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")), 0, api)
        return int(api._nvml.nvmlDeviceGetMemoryInfo(device.handle).used)
    except Exception:
        return None


@dataclass
class BackendRun:
    """One Engine with both stages on one backend, and everything it observed."""

    backend: str
    cfg: Config
    checkpoint_bytes: dict[str, int] = field(default_factory=dict)  # stage -> safetensors bytes
    engine: Engine | None = None
    checks: list[dict[str, Any]] = field(default_factory=list)
    lifecycle: list[dict[str, Any]] = field(default_factory=list)
    audit: list[dict[str, Any]] = field(default_factory=list)
    asleep_together: list[dict[str, Any]] = field(default_factory=list)
    reference: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ helpers

    def check(self, what: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"what": what, "ok": bool(ok), "detail": detail})
        print(f"  [{self.backend}] {'ok  ' if ok else 'MISS'} {what} {detail}".rstrip(), flush=True)
        return ok

    def lifecycle_call(self, stage: str, what: str, fn: Callable[[], LifecycleReport], expect: str) -> LifecycleReport:
        report = fn()
        self.check(f"{stage} {what} -> {expect}", report.state == expect, f"(got {report.state})")
        for rank, rr in report.ranks.items():
            weights = max(rr.pool_bytes_before.get("weights", 0), rr.pool_bytes_after.get("weights", 0))
            self.lifecycle.append(
                {
                    "stage": stage,
                    "what": what,
                    "rank": rank,
                    "state": report.state,
                    "stage_s": report.duration_s,
                    "rank_s": rr.duration_s,
                    "weights_bytes": weights,
                    "pool_before": rr.pool_bytes_before,
                    "pool_after": rr.pool_bytes_after,
                    "process_before": rr.process_bytes_before,
                    "process_after": rr.process_bytes_after,
                    "process_source": rr.process_bytes_source,
                    "weights_GBps": _gbps(weights, rr.duration_s)
                    if what.startswith(("sleep L1", "wake", "reload"))
                    else None,
                }
            )
        return report

    def tokens(self, what: str) -> bool:
        assert self.engine is not None
        out = self.engine.execute("llm", LLM_REQUEST)
        digest = _sha(out["token_ids"])
        if "tokens" not in self.reference:
            self.reference["tokens"], self.reference["tokens_sha256"] = out["token_ids"], digest
            return True
        return self.check(f"llm tokens {what}", digest == self.reference["tokens_sha256"], f"sha256 {digest[:12]}")

    def image(self, what: str, payload: dict[str, Any] | None = None) -> bool:
        assert self.engine is not None
        out = self.engine.execute("dit", payload or self.dit_request())
        digest = str(out["sha256"])
        if "image_sha256" not in self.reference:
            self.reference["image_sha256"], self.reference["image_shape"] = digest, out["shape"]
            self.reference["png_bytes"] = len(out["png"])
            return True
        return self.check(f"dit image {what}", digest == self.reference["image_sha256"], f"sha256 {digest[:12]}")

    def dit_request(self) -> dict[str, Any]:
        return {"class_label": DIT_CLASS, "seed": DIT_SEED, "steps": self.cfg.dit_steps}

    def refused(self, stage: str, state: str) -> bool:
        assert self.engine is not None
        payload = LLM_REQUEST if stage == "llm" else self.dit_request()
        started = time.perf_counter()
        try:
            self.engine.execute(stage, payload, timeout_s=REFUSAL_TIMEOUT_S)
        except RequestRejectedError as exc:
            elapsed_s = time.perf_counter() - started
            return self.check(
                f"{stage} in {state} refuses a request at once",
                state in str(exc) and elapsed_s < AT_ONCE_BOUND_S,
                f"({elapsed_s * 1000:.1f} ms)",
            )
        return self.check(f"{stage} in {state} refuses a request at once", False, "(it was served)")

    def audit_cycle(
        self,
        stage: str,
        level: int,
        sleep: LifecycleReport,
        wake: LifecycleReport,
        reload: LifecycleReport | None = None,
    ) -> None:
        """active -> sleeping -> active, per rank, from the ranks' own NVML figures."""
        back = reload or wake
        for rank, s in sleep.ranks.items():
            w = back.ranks[rank]
            freed = s.freed_bytes
            drop = (
                s.process_bytes_before - s.process_bytes_after
                if s.process_bytes_before is not None and s.process_bytes_after is not None
                else None
            )
            self.audit.append(
                {
                    "stage": stage,
                    "level": level,
                    "rank": rank,
                    "active_before": s.process_bytes_before,
                    "sleeping": s.process_bytes_after,
                    "active_after": w.process_bytes_after,
                    "pool_before": s.pool_bytes_before,
                    "pool_asleep": s.pool_bytes_after,
                    "pool_after": w.pool_bytes_after,
                    "pool_freed": freed,
                    "process_drop": drop,
                    "drop_over_freed": round(drop / freed, 3) if drop is not None and freed > 0 else None,
                    "source": s.process_bytes_source,
                }
            )

    # ------------------------------------------------------------------ the run

    def specs(self, llm_dir: Path, dit_dir: Path) -> list[StageSpec]:
        cuda = self.cfg.device == "cuda"
        common: dict[str, Any] = {
            "device": self.cfg.device,
            "backend": self.backend,
            "admission": "reject",
            "deadline_s": 300.0,
            "start_deadline_s": 600.0,
            "request_timeout_s": 300.0,
        }
        llm_args: dict[str, Any] = {
            "model": str(llm_dir),
            "max_batch": self.cfg.llm_max_batch,
            "max_seq_len": "auto" if cuda else 128,
        }
        dit_args: dict[str, Any] = {"model": str(dit_dir), "scheduler": DIT_SCHEDULER, "max_requests": 2}
        return [
            StageSpec(
                "llm",
                runner="transformers",
                runner_args=llm_args,
                gpu_memory_fraction=self.cfg.llm_fraction if cuda else None,
                **common,
            ),
            StageSpec(
                "dit",
                runner="diffusers",
                runner_args=dit_args,
                tags=("weights", "kv_cache", "requests"),
                gpu_memory_fraction=self.cfg.dit_fraction if cuda else None,
                **common,
            ),
        ]

    def run(self, llm_dir: Path, dit_dir: Path) -> dict[str, Any]:
        result: dict[str, Any] = {"backend": self.backend}
        device_before = device_used_bytes()
        started = time.perf_counter()
        try:
            with Engine(self.specs(llm_dir, dit_dir)) as engine:
                self.engine = engine
                result["start_s"] = round(time.perf_counter() - started, 2)
                result["device_used_loaded"] = device_used_bytes()
                self.scenario(result)
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()[-4000:]
            print(f"  [{self.backend}] ERROR {result['error']}", flush=True)
        finally:
            self.engine = None
        result.update(
            wall_s=round(time.perf_counter() - started, 2),
            device_used_before=device_before,
            checks=self.checks,
            lifecycle=self.lifecycle,
            audit=self.audit,
            asleep_together=self.asleep_together,
            reference=self.reference,
        )
        result["bit_exact"] = bool(self.checks) and all(c["ok"] for c in self.checks) and "error" not in result
        return result

    def scenario(self, result: dict[str, Any]) -> None:
        engine = self.engine
        assert engine is not None
        t0 = time.perf_counter()
        self.tokens("reference")
        result["llm_request_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        self.image("reference")
        result["dit_request_s"] = round(time.perf_counter() - t0, 3)

        # Level 1, each stage in turn while the other serves.
        for stage, other in (("llm", "dit"), ("dit", "llm")):
            for cycle in range(self.cfg.cycles):
                label = "sleep L1 (first)" if cycle == 0 else "sleep L1"
                sleep = self.lifecycle_call(stage, label, lambda s=stage: engine.sleep(s, level=1), "SLEEPING")
                if cycle == 0 and stage in self.checkpoint_bytes:
                    pool = sleep.ranks[0].pool_bytes_before.get("weights", 0)
                    self.check(
                        f"{stage} weights pool holds the checkpoint",
                        pool >= MIN_POOL_OVER_CHECKPOINT * self.checkpoint_bytes[stage],
                        f"({fmt_bytes(pool)} in the pool, {fmt_bytes(self.checkpoint_bytes[stage])} of "
                        "tensors in the checkpoint)",
                    )
                if other == "dit":
                    self.image(f"while llm sleeps (cycle {cycle + 1})")
                else:
                    self.tokens(f"while dit sleeps (cycle {cycle + 1})")
                wake = self.lifecycle_call(stage, "wake L1", lambda s=stage: engine.wake(s), "RUNNING")
                self.audit_cycle(stage, 1, sleep, wake)
                if stage == "llm":
                    self.tokens(f"after L1 cycle {cycle + 1}")
                else:
                    self.image(f"after L1 cycle {cycle + 1}")

        # Level 2 + reload.
        for stage in ("llm", "dit"):
            sleep = self.lifecycle_call(stage, "sleep L2", lambda s=stage: engine.sleep(s, level=2), "SLEEPING")
            wake = self.lifecycle_call(stage, "wake L2", lambda s=stage: engine.wake(s), "NEEDS_RELOAD")
            self.refused(stage, "NEEDS_RELOAD")
            reload = self.lifecycle_call(stage, "reload", lambda s=stage: engine.reload_weights(s), "RUNNING")
            self.audit_cycle(stage, 2, sleep, reload)
            if stage == "llm":
                self.tokens("after L2 + reload")
            else:
                self.image("after L2 + reload")

        # Partial wake: weights back, KV cache not: no execution until it is.
        self.lifecycle_call("llm", "sleep L1 (partial)", lambda: engine.sleep("llm", level=1), "SLEEPING")
        self.lifecycle_call("llm", "wake weights", lambda: engine.wake("llm", tags=["weights"]), "PARTIAL")
        self.refused("llm", "PARTIAL")
        self.lifecycle_call("llm", "wake kv_cache", lambda: engine.wake("llm", tags=["kv_cache"]), "RUNNING")
        self.tokens("after partial wake")

        # A step-wise request across a level-1 sleep.
        begun = engine.execute("dit", {"op": "start", **self.dit_request()})
        engine.execute("dit", {"op": "step", "request_id": begun["request_id"], "steps": self.cfg.dit_steps // 2})
        sleep = self.lifecycle_call("dit", "sleep L1 (step-wise)", lambda: engine.sleep("dit", level=1), "SLEEPING")
        held = sleep.ranks[0].pool_bytes_before.get("requests", 0)
        self.check("step-wise request state in the 'requests' pool at the sleep", held > 0, f"({held} bytes)")
        self.tokens("while dit sleeps mid-request")
        self.lifecycle_call("dit", "wake L1 (step-wise)", lambda: engine.wake("dit"), "RUNNING")
        self.image("step-wise request interrupted by L1", {"op": "finish", "request_id": begun["request_id"]})

        # Both asleep at once: what stays in use on the device.
        for level in (1, 2):
            reports = {
                s: self.lifecycle_call(
                    s, f"sleep L{level} (both)", lambda s=s, lv=level: engine.sleep(s, level=lv), "SLEEPING"
                )
                for s in ("llm", "dit")
            }
            self.asleep_together.append(
                {
                    "level": level,
                    "device_used": device_used_bytes(),
                    "ranks": {
                        s: {"process_asleep": r.ranks[0].process_bytes_after, "source": r.ranks[0].process_bytes_source}
                        for s, r in reports.items()
                    },
                }
            )
            for s in ("llm", "dit"):
                self.lifecycle_call(
                    s, f"wake L{level} (both)", lambda s=s: engine.wake(s), "RUNNING" if level == 1 else "NEEDS_RELOAD"
                )
                if level == 2:
                    self.lifecycle_call(s, "reload (both)", lambda s=s: engine.reload_weights(s), "RUNNING")
        self.tokens("after both slept (L1, L2)")
        self.image("after both slept (L1, L2)")
        result["device_used_end"] = device_used_bytes()


# ---------------------------------------------------------------------- summary and rendering


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """GB/s per stage: first level-1 sleep, later ones, wakes, level-2 sleep, reload."""
    out: dict[str, Any] = {}
    for stage in ("llm", "dit"):
        rows = [r for r in run.get("lifecycle", []) if r["stage"] == stage]

        def pick(what: str, rows: list[dict[str, Any]] = rows) -> list[dict[str, Any]]:
            return [r for r in rows if r["what"] == what]

        first, later, wakes = pick("sleep L1 (first)"), pick("sleep L1"), pick("wake L1")
        l2, reload = pick("sleep L2"), pick("reload")
        weights = max((r["weights_bytes"] for r in rows), default=0)
        pools = first[0]["pool_before"] if first else {}
        med = statistics.median
        out[stage] = {
            "weights_GiB": round(weights / GiB, 3),
            # Discarded at level 1 (not copied): the KV cache, and the DiT's request slots.
            "discarded_GiB": round(sum(v for k, v in pools.items() if k != "weights") / GiB, 3),
            "first_sleep_s": first[0]["rank_s"] if first else None,
            "first_sleep_GBps": first[0]["weights_GBps"] if first else None,
            "later_sleep_GBps": round(med([r["weights_GBps"] for r in later]), 2) if later else None,
            "wake_GBps": round(med([r["weights_GBps"] for r in wakes]), 2) if wakes else None,
            "wake_s": round(med([r["rank_s"] for r in wakes]), 4) if wakes else None,
            "l2_sleep_ms": round(l2[0]["rank_s"] * 1000, 1) if l2 else None,
            "reload_GBps": reload[0]["weights_GBps"] if reload else None,
        }
    return out


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _v(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def render_markdown(data: dict[str, Any]) -> str:
    m = data["machine"]
    cfg = data["config"]
    lines = [
        "# Real models co-located on one GPU: Qwen2 LLM + DiT, every lifecycle bit for bit (issue 12, item 6)",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {m.get('gpu') or '?'}; {m.get('cpus')} CPUs, {m.get('host_memory_GiB')} GiB host memory; "
        f"torch {m.get('torch')}, transformers {m.get('transformers')}, diffusers {m.get('diffusers')}, "
        f"vLLM allocator {m.get('vllm')} |",
        f"| commit | `{m.get('commit')}`{' (+ uncommitted changes)' if m.get('dirty') else ''} |",
        f"| command | `{data['command']}` |",
        f"| models | LLM `{cfg['llm_model']}` ({data['models'].get('llm', '')}); DiT `{cfg['dit_model']}` "
        f"({data['models'].get('dit', '')}) |",
        f"| stages | `llm`: transformers runner, max_batch {cfg['llm_max_batch']}, KV cache sized by "
        f"gpu_memory_fraction={cfg['llm_fraction']}; `dit`: diffusers runner, {DIT_SCHEDULER}, {cfg['dit_steps']} "
        f"steps, tags weights/kv_cache/requests, gpu_memory_fraction={cfg['dit_fraction']}; one rank each, "
        "one GPU |",
        f"| verdict | {data['verdict']} |",
        "",
        "## Bit-identical through every lifecycle",
        "",
        "| backend | checks | misses | start | tokens sha256 | image tensor sha256 | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        checks = run.get("checks", [])
        missed = [c["what"] for c in checks if not c["ok"]]
        ref = run.get("reference", {})
        lines.append(
            f"| {run['backend']} | {len(checks) - len(missed)}/{len(checks)} | "
            f"{'; '.join(missed) or 'none'} | {_v(run.get('start_s'), '{:.1f} s')} | "
            f"`{ref.get('tokens_sha256', '-')[:16]}` | `{ref.get('image_sha256', '-')[:16]}` | "
            f"{run.get('error', '') or '-'} |"
        )
    if data.get("cross_backend"):
        lines += ["", data["cross_backend"]]
    lines += [
        "",
        "## Sleep and wake per stage (weights pool bytes over the rank's own command time; GB = 1e9 B)",
        "",
        "| backend | stage | weights GiB | other pools GiB (discarded) | first L1 sleep | later L1 sleeps | "
        "L1 wake | L2 sleep | reload from safetensors |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        for stage, s in summarize(run).items():
            lines.append(
                f"| {run['backend']} | {stage} | {s['weights_GiB']} | {s['discarded_GiB']} | "
                f"{_v(s['first_sleep_s'], '{:.3f} s')} ({_v(s['first_sleep_GBps'])} GB/s) | "
                f"{_v(s['later_sleep_GBps'])} GB/s | {_v(s['wake_GBps'])} GB/s "
                f"({_v(s['wake_s'], '{:.3f} s')}) | {_v(s['l2_sleep_ms'])} ms | "
                f"{_v(s['reload_GBps'])} GB/s |"
            )
    lines += [
        "",
        "## Full-cycle memory audit (each rank's own GPU memory, GiB: active -> sleeping -> active)",
        "",
        "| backend | stage | level | active | sleeping | active again | pool freed | process drop | "
        "drop / freed | source |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        seen: set[tuple[str, int]] = set()
        for a in run.get("audit", []):
            key = (a["stage"], a["level"])
            if key in seen:  # one row per stage and level: the later cycles read the same
                continue
            seen.add(key)
            lines.append(
                f"| {run['backend']} | {a['stage']} | L{a['level']} | {_gib(a['active_before'])} | "
                f"{_gib(a['sleeping'])} | {_gib(a['active_after'])} | {_gib(a['pool_freed'])} | "
                f"{_gib(a['process_drop'])} | {_v(a['drop_over_freed'])} | {a['source'].split(':')[0]} |"
            )
    lines += [
        "",
        "## Memory left in use while asleep",
        "",
        "| backend | both asleep at | llm rank | dit rank | device used (NVML, all processes) | "
        "device used, both active |",
        "|---|---|---|---|---|---|",
    ]
    for run in data["runs"]:
        for t in run.get("asleep_together", []):
            lines.append(
                f"| {run['backend']} | L{t['level']} | {_gib(t['ranks']['llm']['process_asleep'])} | "
                f"{_gib(t['ranks']['dit']['process_asleep'])} | {_gib(t['device_used'])} | "
                f"{_gib(run.get('device_used_loaded'))} |"
            )
    lines += [
        "",
        "Every check, per backend, in order: `real_models.json` (`runs[].checks`); every lifecycle call "
        "with its per-rank pool and NVML figures: `runs[].lifecycle`.",
        "",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------- entry points


def _versions() -> dict[str, str | None]:
    from importlib.metadata import version

    out: dict[str, str | None] = {}
    for name in ("transformers", "diffusers", "safetensors", "accelerate"):
        try:
            out[name] = version(name)
        except Exception:
            out[name] = None
    return out


def resolve_models(cfg: Config, log: Callable[[str], None] = print) -> tuple[Path, Path, dict[str, str]]:
    from omni_core.demo_real import cached_checkpoint

    llm_size, dit_size = SIZES[cfg.size]
    notes: dict[str, str] = {}
    paths = []
    for family, size, given, key in (
        ("qwen2", llm_size, cfg.llm_model, "llm"),
        ("dit", dit_size, cfg.dit_model, "dit"),
    ):
        if given is not None:
            paths.append(Path(given))
            notes[key] = "given"
        else:
            path, made_s = cached_checkpoint(cfg.models_dir, family, size, log=log)
            paths.append(path)
            notes[key] = f"{family} {size}, made in {made_s:.1f} s" if made_s else f"{family} {size}, cached"
    return paths[0], paths[1], notes


def run_bench(
    cfg: Config, command: str = "", progress: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Every backend in turn; `progress` gets the results so far after each one (a run cut
    off by a time limit still leaves the backends it finished)."""
    llm_dir, dit_dir, made = resolve_models(cfg)
    cfg.llm_model, cfg.dit_model = llm_dir, dit_dir
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    data: dict[str, Any] = {}
    for backend in cfg.backends:
        print(f"backend {backend}:", flush=True)
        sizes = {"llm": _safetensors_bytes(llm_dir), "dit": _safetensors_bytes(dit_dir)}
        runs.append(BackendRun(backend, cfg, checkpoint_bytes=sizes).run(llm_dir, dit_dir))
        data = _collect(cfg, command, llm_dir, dit_dir, made, runs, time.perf_counter() - started)
        if progress is not None:
            progress(data)
    return data


def _collect(
    cfg: Config,
    command: str,
    llm_dir: Path,
    dit_dir: Path,
    made: dict[str, str],
    runs: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    from benchmarks.memory import machine_info

    data: dict[str, Any] = {
        "command": command,
        "machine": {**machine_info(), **_versions()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()},
        "models": {key: f"{made[key]}; {_describe(path)}" for key, path in (("llm", llm_dir), ("dit", dit_dir))},
        "runs": list(runs),
        "backends_planned": list(cfg.backends),
        "wall_s": round(wall_s, 1),
    }
    ok = [r for r in runs if r["bit_exact"]]
    complete = len(runs) == len(cfg.backends)
    data["verdict"] = (
        "PASS" if runs and len(ok) == len(runs) and complete else "FAIL" if len(ok) < len(runs) else "INCOMPLETE"
    )
    refs = {(r["reference"].get("tokens_sha256"), r["reference"].get("image_sha256")) for r in ok}
    if len(ok) > 1:
        data["cross_backend"] = (
            "The backends agree with each other too: the same token and image digests."
            if len(refs) == 1
            else f"The backends' reference outputs differ from each other ({len(refs)} distinct "
            "digest pairs); each is bit-exact through its own lifecycles."
        )
    return data


def _safetensors_bytes(directory: Path) -> int:
    """Tensor data bytes of a checkpoint: each file less its 8-byte length and JSON header."""
    total = 0
    for path in directory.rglob("*.safetensors"):
        with path.open("rb") as f:
            header_bytes = int.from_bytes(f.read(8), "little")
        total += path.stat().st_size - 8 - header_bytes
    return total


def _describe(directory: Path) -> str:
    files = list(directory.rglob("*.safetensors"))
    return f"{_safetensors_bytes(directory) / GiB:.2f} GiB of safetensors in {len(files)} files"


def write_outputs(data: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "real_models.json", out / "real_models.md"]
    paths[0].write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")
    paths[1].write_text(render_markdown(data))
    return paths


def main(args: argparse.Namespace) -> int:
    out = Path(args.out or "bench-results")
    if getattr(args, "render", None):
        data = json.loads(Path(args.render).read_text())
        (out / "real_models.md").parent.mkdir(parents=True, exist_ok=True)
        (out / "real_models.md").write_text(render_markdown(data))
        print(f"wrote {out / 'real_models.md'}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            f"python -m benchmarks --real-models: torch {torch.__version__} sees no CUDA device; this benchmark runs "
            "on a GPU (the CPU lifecycle tests are in tests/runners)",
            file=sys.stderr,
        )
        return 2
    backends = tuple(b for group in (args.methods or [",".join(BACKENDS)]) for b in group.split(",") if b)
    cfg = Config(
        backends=backends,
        size=args.real_size,
        llm_model=Path(args.llm_model) if args.llm_model else None,
        dit_model=Path(args.dit_model) if args.dit_model else None,
        models_dir=Path(args.models_dir),
        cycles=args.reps or 3,
    )
    data = run_bench(cfg, " ".join(["omni-core", *sys.argv[1:]]), progress=lambda d: write_outputs(d, out))
    for path in write_outputs(data, out):
        print(f"wrote {path}")
    print(f"verdict: {data['verdict']}")
    return 0 if data["verdict"] == "PASS" else 1
