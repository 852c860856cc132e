"""A request across two stages (P-22): `Engine.pipeline` moving the intermediate by a transfer,
against the caller chaining the same two stages by hand, on CPU with tiny real models.

The stages: `text`, the `transformers` runner on a tiny seeded Qwen2 (`omni-core models make
qwen2 tiny`), exporting its prompt's `prompt_embeds`; `image`, the `diffusers` runner on a tiny
Stable Diffusion whose UNet attends to a 64-wide text (`sd tiny-64`), rendering from them.

- (a) pipeline: `engine.pipeline([text exports prompt_embeds, image])`: TransferOut on `text`
  (the tensors into its shm buckets), the consumer's state read from its stage core (no round
  trip), TransferIn on `image` (the buckets copied into its inbox), the request (whose end
  drops the landing on `image`'s rank), TransferRelease on `text`;
- (b) by hand: `engine.execute("text", {"prompt", "export": [...]})` (the tensors in the
  result, msgpack over ZeroMQ into this process), then `engine.execute("image",
  {"conditioning": that})`.

Per request, both paths in turn (the order alternates, so drift in the machine's load falls on
both), warm-up excluded; every pair's images must be equal byte for byte. The pipeline's own
calls are timed as it makes them (the engine's lifecycle, status and execute calls, and the
pipeline's releases, sent together and waited for together, wrapped), which says where its
extra time goes.

    python -m benchmarks.pipeline --out benchmarks/results/pipeline.md
    python -m benchmarks --pipeline --out benchmarks/results/pipeline.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.control_plane import TARGETS_HEADER, _machine, _percentile
from omni_core.engine import Engine, PipelineStage, StageSpec
from omni_core.engine import pipeline as pipeline_module

STEPS = (1, 8)  # the image stage's denoising steps: a second stage of about a transfer's cost, and longer
EXPORT = ("prompt_embeds",)
TARGET_RATIO = 1.0  # pipeline p50 over by-hand p50: the engine's hop costs no more than the caller's
REQUESTS, WARMUP = 40, 5


def make_models(root: Path) -> tuple[Path, Path]:
    """The tiny Qwen2 and the tiny SD of its width (seeded, `omni_core.models`, as the tests
    make them), made in `root` on first use and reused after, as the demo's are."""
    from omni_core.demo_real import cached_checkpoint

    return cached_checkpoint(root, "qwen2", "tiny")[0], cached_checkpoint(root, "sd", "tiny-64")[0]


def specs(llm: Path, sd: Path) -> list[StageSpec]:
    common: dict[str, Any] = {"backend": "portable", "deadline_s": 120.0, "start_deadline_s": 300.0}
    return [
        StageSpec("text", runner="transformers", runner_args={"model": str(llm), "cpu_threads": 1}, **common),
        StageSpec("image", runner="diffusers", runner_args={"model": str(sd), "cpu_threads": 1}, **common),
    ]


def _prompt(i: int) -> str:
    return f"a watercolor painting of fox number {i} in the snow"


def _image(steps: int, i: int) -> dict[str, Any]:
    return {"seed": i, "steps": steps, "guidance_scale": 1.0}  # unguided: one row of conditioning


def by_hand(engine: Engine, steps: int, i: int) -> Any:
    """(b): the text stage's tensors out in its result, through this process, into the image's."""
    conditioning = engine.execute("text", {"prompt": _prompt(i), "export": list(EXPORT)})
    return engine.execute("image", {**_image(steps, i), "conditioning": conditioning})


def through_pipeline(engine: Engine, steps: int, i: int) -> Any:
    """(a): the engine moves the intermediate by a transfer."""
    stages = [PipelineStage("text", {"prompt": _prompt(i)}, export=EXPORT), PipelineStage("image", _image(steps, i))]
    return engine.pipeline(stages).output


@contextmanager
def timed_calls(engine: Engine, parts: dict[str, list[float]]) -> Iterator[None]:
    """Each lifecycle command (by its class), status and execute call (by stage) made on the
    engine inside the block, and each request's releases (`TransferRelease`: all of them, sent
    together), timed into `parts` (seconds)."""
    originals = {name: getattr(engine, name) for name in ("_lifecycle", "status", "execute")}
    release_hops = pipeline_module._release_hops

    def wrap(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                label = name
                if name == "_lifecycle":
                    label = type(args[1].command).__name__
                elif name == "execute":
                    label = f"execute {args[0]}"
                parts[label].append(time.perf_counter() - started)

        return timed

    for name, call in originals.items():
        setattr(engine, name, wrap(name, call))
    pipeline_module._release_hops = wrap("TransferRelease", release_hops)  # type: ignore[assignment]
    try:
        yield
    finally:
        for name in originals:
            delattr(engine, name)  # the class's methods again
        pipeline_module._release_hops = release_hops  # type: ignore[assignment]


def measure(engine: Engine, steps: int, requests: int, warmup: int) -> dict[str, Any]:
    """Both paths for `requests` requests after `warmup`; raises if a pair's images differ."""
    paths = {"pipeline": through_pipeline, "hand": by_hand}
    total_s: dict[str, list[float]] = {path: [] for path in paths}
    parts: dict[str, dict[str, list[float]]] = {path: defaultdict(list) for path in paths}
    for i in range(warmup + requests):
        kept = i >= warmup
        outputs = {}
        for path in ("pipeline", "hand") if i % 2 == 0 else ("hand", "pipeline"):
            started = time.perf_counter()
            with timed_calls(engine, parts[path] if kept else defaultdict(list)):
                outputs[path] = paths[path](engine, steps, i)
            if kept:
                total_s[path].append(time.perf_counter() - started)
        a, b = outputs["pipeline"], outputs["hand"]
        if bytes(a["png"]) != bytes(b["png"]) or a["sha256"] != b["sha256"]:
            raise AssertionError(f"request {i} at {steps} steps: the pipeline's image differs from the one by hand")
    conditioning = engine.execute("text", {"prompt": _prompt(0), "export": list(EXPORT)})
    exported_bytes = sum(len(t["data"]) for t in conditioning.values())
    return {
        "steps": steps,
        "requests": requests,
        "pipeline_ms": [s * 1e3 for s in total_s["pipeline"]],
        "hand_ms": [s * 1e3 for s in total_s["hand"]],
        "parts_ms": {
            path: {label: sum(ts) * 1e3 / max(1, requests) for label, ts in timed.items()}
            for path, timed in parts.items()
        },
        "exported_bytes": exported_bytes,
    }


def run(models_dir: Path | None, steps: Sequence[int], requests: int, warmup: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="omni-pipeline-bench-") as tmp:
        llm, sd = make_models(models_dir or Path(tmp))
        with Engine(specs(llm, sd)) as engine:
            return [measure(engine, s, requests, warmup) for s in steps]


def _stats(ms: list[float]) -> tuple[float, float]:
    ordered = sorted(ms)
    return _percentile(ordered, 0.5), _percentile(ordered, 0.95)


def render_markdown(
    results: list[dict[str, Any]], machine: dict[str, Any], command: str, load: float | None = None
) -> str:
    lines = [
        "# A request across two stages: Engine.pipeline (a transfer) against the caller chaining them",
        "",
        f"machine: {machine['host']}, {machine['cpus']} CPUs, {machine['platform']}, Python {machine['python']}; "
        f"commit `{machine['commit']}`; command `{command}`"
        + ("" if load is None else f"; load average {load:.1f} at the start (the machine is shared)"),
        "",
        "Stages: `text` (transformers, tiny Qwen2) exports `prompt_embeds` of the prompt "
        f"({results[0]['exported_bytes']} bytes); `image` (diffusers, tiny SD `tiny-64`, unguided) renders from "
        "them. One rank each, portable backend, one CPU thread each. Per request both paths in turn (alternating "
        "order), warm-up excluded; every pair of images equal byte for byte.",
        "",
        "| image steps | requests | pipeline p50 | p95 | by hand p50 | p95 | pipeline / by hand (p50) "
        "| paired difference p50 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        (p50, p95), (h50, h95) = _stats(r["pipeline_ms"]), _stats(r["hand_ms"])
        lines.append(
            f"| {r['steps']} | {r['requests']} | {p50:.1f} ms | {p95:.1f} ms | {h50:.1f} ms | {h95:.1f} ms "
            f"| {p50 / h50:.2f}x | {paired_ms(r):+.1f} ms |"
        )
    lines += ["", "Each path's engine calls, mean ms per request (timed as the path makes them):", ""]
    labels = sorted({label for r in results for timed in r["parts_ms"].values() for label in timed})
    lines += ["| image steps | path | " + " | ".join(labels) + " |", "|---" * (len(labels) + 2) + "|"]
    for r in results:
        for path, timed in r["parts_ms"].items():
            cells = " | ".join(f"{timed[x]:.2f}" if x in timed else "-" for x in labels)
            lines.append(f"| {r['steps']} | {path} | {cells} |")
    lines += _targets(results)
    return "\n".join(lines) + "\n"


def paired_ms(result: dict[str, Any]) -> float:
    """The median, over requests, of pipeline minus by hand for the same request (run back to
    back, so a slow moment of the shared machine falls on both)."""
    ordered = sorted(a - b for a, b in zip(result["pipeline_ms"], result["hand_ms"], strict=True))
    return _percentile(ordered, 0.5)


def _why(result: dict[str, Any]) -> str:
    """Where the pipeline's extra time goes, from its timed calls against by hand's."""
    ours, theirs = result["parts_ms"]["pipeline"], result["parts_ms"]["hand"]
    extra = {k: ours.get(k, 0.0) for k in ("TransferIn", "TransferRelease")}
    export_ms = ours.get("TransferOut", 0.0) - theirs.get("execute text", 0.0)
    request_ms = ours.get("execute image", 0.0) - theirs.get("execute image", 0.0)
    paired = paired_ms(result)
    rest = paired - sum(extra.values()) - export_ms - request_ms
    return (
        f"{paired:.1f} ms a request (paired). By hand is two round trips, the export in a result and the "
        f"request; the pipeline makes the same two (its TransferOut {export_ms:+.1f} ms against the export "
        f"result, its request {request_ms:+.1f} ms) plus the landing and the producer's release, "
        f"{sum(extra.values()):.1f} ms (TransferIn {extra['TransferIn']:.1f}, TransferRelease "
        f"{extra['TransferRelease']:.1f}); {rest:+.1f} ms is the rest (run_pipeline's own Python, the shared "
        f"machine). With {result['exported_bytes']} bytes in flight, no copy the transfer saves pays for a round "
        "trip: what is left is the landing's round trip and the release's, which would go off the request's "
        "path only by releasing the producer while the consumer runs (a TRANSFER_TRANSITIONS change)"
    )


def _targets(results: list[dict[str, Any]]) -> list[str]:
    rows = list(TARGETS_HEADER)
    for r in results:
        (p50, _), (h50, _) = _stats(r["pipeline_ms"]), _stats(r["hand_ms"])
        ratio = p50 / h50
        met = "met" if ratio <= TARGET_RATIO else f"missed by {ratio / TARGET_RATIO:.2f}x: " + _why(r)
        rows.append(
            f"| pipeline p50 <= {TARGET_RATIO:.1f}x by-hand p50, image at {r['steps']} steps "
            f"| {p50:.1f} ms vs {h50:.1f} ms ({ratio:.2f}x) | {met} |"
        )
    rows.append(
        "| pipeline and by-hand images equal byte for byte | every pair of "
        f"{sum(r['requests'] for r in results)} requests | met |"
    )
    return rows


def main(argv: Sequence[str] | None = None, command: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/pipeline.md"))
    parser.add_argument("--requests", type=int, default=REQUESTS, help="timed requests per step count")
    parser.add_argument("--warmup", type=int, default=WARMUP, help="requests before the timed ones")
    parser.add_argument("--steps", type=int, action="append", help=f"image denoising steps (default {STEPS})")
    parser.add_argument("--models", type=Path, default=None, help="where to make the tiny models (else a temp dir)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    load = os.getloadavg()[0]
    results = run(args.models, args.steps or STEPS, args.requests, args.warmup)
    line = command or " ".join(["python -m benchmarks.pipeline", *sys.argv[1:]])
    text = render_markdown(results, _machine(), line, load)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
