"""`omni-core demo`: the main job on real models.

Two stages share one device, as a thinker and a diffusion decoder do in vLLM-Omni: `llm`
(the `transformers` runner, a Qwen2 causal LM) writes tokens for a prompt, and `dit` (the
`diffusers` runner, a class-conditional DiT pipeline) renders the image of the class those
tokens choose (`class_label_of`). The checkpoints are made on the fly with seeded random
weights (`omni_core.models`) into a cache folder and reused on later runs; nothing is
downloaded.

The stages take turns on the device and go through every lifecycle: level 1, level 2 +
reload (a request in between is refused at once), a partial wake (refuses work), and a
step-wise diffusion request interrupted by a level-1 sleep. After every sleep the stage's
output is taken again and compared with the first one: the same token ids, and the same
image, written to the output folder as PNG and compared byte for byte. Prints the lifecycle
table with per-rank memory and a verdict; exits non-zero on any mismatch.

    omni-core demo                                   # CPU, tiny models: seconds
    omni-core demo --device cuda --size large        # Qwen2 1.5B + DiT 600M on one GPU
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypedDict

import msgspec

from omni_core.demo import fmt_bytes, write_table
from omni_core.demo_pipeline import SD_FAMILY, SD_SIZES, pipeline_scene
from omni_core.engine import AdmissionPolicy, Engine, LifecycleReport, RequestRejectedError, StageSpec

# (LLM size, DiT size) of `omni-core models make`, by --size.
SIZES = {"tiny": ("tiny", "tiny"), "large": ("1.5b", "600m")}
LLM_FAMILY, DIT_FAMILY = "qwen2", "dit"
LLM_RUNNERS = ("transformers", "vllm")
VLLM_FRACTION = 0.3  # the vllm stage's share of the GPU (its KV cache is sized to it)
SEED = 0  # of the checkpoints' weights
DIT_CLASSES = 1000  # DiT's class-label embedding rows (num_embeds_ada_norm) at every size
PROMPT = "a watercolor painting of a fox in the snow"
# Seeded sampling rather than greedy: a weight that came back wrong changes the drawn tokens
# even where it would not change the argmax.
LLM_REQUEST = {
    "prompt": PROMPT,
    "max_new_tokens": 12,
    "stop_at_eos": False,
    "sampling": {"temperature": 0.8, "seed": 1},
}
# DPM-Solver keeps past model outputs between steps: a step-wise request interrupted by a
# sleep must bring those back too, not only its latents.
DIT_SCHEDULER = "DPMSolverMultistepScheduler"
DIT_STEPS = {"tiny": 8, "large": 20}
DIT_SEED = 7
# A refused request carries this long a deadline of its own; a refusal "at once" must come
# within a tenth of it (milliseconds in practice, still met on a loaded 2-core machine).
REFUSAL_PROBE_TIMEOUT_S = 30.0
AT_ONCE_BOUND_S = REFUSAL_PROBE_TIMEOUT_S / 10
# The images are a few pixels wide at the tiny size; the contact sheet scales them up to
# at least this many pixels, nearest neighbour (the pixels stay the model's).
SHEET_MIN_PX = 160
SHEET_GAP_PX = 8
SHEET_CAPTION_PX = 18  # room under each image for its file name
MARKER = "omni-core-checkpoint.json"  # beside each cached checkpoint: it was written whole


def default_models_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "omni-core" / "models"


def class_label_of(token_ids: list[int]) -> int:
    """The image's class, chosen by the LLM's tokens (their sum, mod the class count): any
    change in the tokens moves it, so the diffusion stage depends on the language stage."""
    return sum(token_ids) % DIT_CLASSES


def cached_checkpoint(
    models_dir: Path, family: str, size: str, *, seed: int = SEED, log: Callable[[str], object] = lambda _: None
) -> tuple[Path, float]:
    """The checkpoint directory of FAMILY at SIZE under `models_dir`, made on first use.
    Returns (path, seconds spent making it: 0 when reused)."""
    from omni_core.models import make_checkpoint

    target = models_dir / f"{family}-{size}-seed{seed}"
    marker = models_dir / f"{target.name}.{MARKER}"
    expected = {"family": family, "size": size, "seed": seed}
    if target.is_dir() and marker.is_file():
        try:
            recorded = json.loads(marker.read_text())
        except ValueError:
            recorded = {}
        if {k: recorded.get(k) for k in expected} == expected:
            return target, 0.0
    log(f"making {family} {size} (seeded random weights) in {target} ...")
    # force: a directory without its marker is what an interrupted earlier run left.
    from omni_core.progress import Progress

    with Progress(f"making {family} {size}", unit="M params", scale=1e6) as progress:  # a terminal only
        info = make_checkpoint(family, size, target, seed=seed, force=True, progress=progress)
    # The marker goes last and outside the checkpoint, so loaders never see it and a
    # directory without one is never taken for complete.
    marker.write_text(json.dumps({**expected, "params": info.params, "file_bytes": info.file_bytes}))
    return target, info.duration_s


def memory_text(report: LifecycleReport, *, over_link: bool = False) -> str:
    """Per rank: pool bytes freed (or restored) and, where measured, the process's own GPU
    memory before -> after (NVML, this pid only). `over_link`: the weights crossed the host
    link (a level-1 sleep, or the wake after one), so their rate is shown too."""
    parts = []
    for r, rr in report.ranks.items():
        moved_bytes = abs(rr.pool_bytes_before.get("weights", 0) - rr.pool_bytes_after.get("weights", 0))
        if report.command == "ReloadWeights":  # frees nothing: it writes into the mapped weights
            text = f"r{r}: {fmt_bytes(rr.pool_bytes_after.get('weights', 0))} of weights refilled from the checkpoint"
        else:
            verb, moved = (
                ("restored", rr.restored_bytes) if rr.restored_bytes > rr.freed_bytes else ("freed", rr.freed_bytes)
            )
            text = f"r{r}: {verb} {fmt_bytes(moved)}"
            if over_link and moved_bytes and rr.duration_s > 0:
                # A clean sleep (the host copy made at load still stands) only unmaps: its rate
                # is effective, not the link's.
                text += f" (weights {fmt_bytes(moved_bytes)}, {moved_bytes / rr.duration_s / 1e9:.1f} GB/s)"
        if rr.process_bytes_before is not None and rr.process_bytes_after is not None:
            source = rr.process_bytes_source.split(":")[0]
            text += f", process {fmt_bytes(rr.process_bytes_before)} -> {fmt_bytes(rr.process_bytes_after)} ({source})"
        parts.append(text)
    return "; ".join(parts) or "-"


class _Common(TypedDict):
    """The StageSpec fields both stages share."""

    device: str
    backend: str
    admission: AdmissionPolicy
    deadline_s: float
    start_deadline_s: float
    request_timeout_s: float


@dataclass
class Row:
    step: str
    stage: str
    state: str
    duration_s: float
    what: str


@dataclass
class Image:
    name: str  # file name in the output folder
    png: bytes
    sha256: str  # of the raw output tensor (the runner's digest), not of the PNG


@dataclass
class RealDemo:
    device: str = "cpu"
    backend: str | None = None
    size: str = "tiny"
    out_dir: Path = Path("omni-core-demo-out")
    models_dir: Path = field(default_factory=default_models_dir)
    trace_path: str | None = None
    llm_runner: str = "transformers"  # or "vllm" (a GPU, the large size)
    out: TextIO = sys.stdout
    rows: list[Row] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    images: list[Image] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"size {self.size!r} is not one of {sorted(SIZES)}")
        self.backend = self.backend or ("portable" if self.device == "cpu" else "auto")
        problem = llm_runner_problem(self.llm_runner, self.device, self.size)
        if problem:
            raise ValueError(problem)
        self.out_dir, self.models_dir = Path(self.out_dir), Path(self.models_dir)
        encoding = getattr(self.out, "encoding", None) or "utf-8"
        try:
            "✓✗".encode(encoding)
            self.tick, self.cross = "✓", "✗"
        except (UnicodeEncodeError, LookupError):
            self.tick, self.cross = "ok", "MISMATCH"

    # ------------------------------------------------------------------ set-up

    def specs(self, llm_dir: Path, dit_dir: Path, sd_dir: Path | None = None) -> list[StageSpec]:
        large = self.size != "tiny"
        # One thread per rank on a CPU: the two ranks and the orchestrator share the machine.
        threads = {"cpu_threads": 1} if self.device == "cpu" else {}
        llm_args = {"model": str(llm_dir), "max_seq_len": 256 if large else 64, **threads}
        dit_args = {"model": str(dit_dir), "scheduler": DIT_SCHEDULER, "max_requests": 2, **threads}
        # reject: a request to a stage that cannot serve is refused at once rather than queued,
        # so the table shows the refusal.
        assert self.backend is not None  # __post_init__ chose it
        common: _Common = {
            "device": self.device,
            "backend": self.backend,
            "admission": AdmissionPolicy.REJECT,
            "deadline_s": 300.0 if large else 60.0,
            "start_deadline_s": 600.0 if large else 240.0,
            "request_timeout_s": 300.0 if large else 60.0,
        }
        llm_stage: dict[str, Any] = {"runner": "transformers", "runner_args": llm_args}
        if self.llm_runner == "vllm":
            # vLLM's own model runner, KV cache and sampler; its KV cache sized from the
            # stage's share of the device (process-scoped), leaving the rest to the DiT.
            llm_stage = {
                "runner": "vllm",
                "runner_args": {"model": str(llm_dir), "max_model_len": 256},
                "gpu_memory_fraction": VLLM_FRACTION,
            }
        specs = [
            StageSpec("llm", **llm_stage, **common),
            StageSpec(
                "dit", runner="diffusers", runner_args=dit_args, tags=("weights", "kv_cache", "requests"), **common
            ),
        ]
        if sd_dir is not None:  # the pipeline scene's consumer: a transfer into it wakes it
            sd = StageSpec("sd", runner="diffusers", runner_args={"model": str(sd_dir), **threads}, **common)
            specs.append(msgspec.structs.replace(sd, admission=AdmissionPolicy.WAKE))
        return specs

    def checkpoints(self) -> tuple[Path, Path, Path | None]:
        """The LLM's, the DiT's and (where the catalog has one of the LLM's width) the pipeline
        scene's SD checkpoint."""
        llm_size, dit_size = SIZES[self.size]
        sd_size = SD_SIZES[self.size]
        w = self.out.write

        def log(line: str) -> None:
            w(line + "\n")

        llm_dir, llm_s = cached_checkpoint(self.models_dir, LLM_FAMILY, llm_size, log=log)
        dit_dir, dit_s = cached_checkpoint(self.models_dir, DIT_FAMILY, dit_size, log=log)
        sd_dir, sd_s = (None, 0.0)
        if sd_size is not None:
            sd_dir, sd_s = cached_checkpoint(self.models_dir, SD_FAMILY, sd_size, log=log)
        made = llm_s + dit_s + sd_s
        names = ", ".join(d.name for d in (llm_dir, dit_dir, sd_dir) if d is not None)
        w(f"checkpoints: {names} in {self.models_dir} ({f'made in {made:.1f} s' if made else 'reused'})\n")
        return llm_dir, dit_dir, sd_dir

    # ------------------------------------------------------------------ bookkeeping

    def note(self, step: str, stage: str, state: str, duration_s: float, what: str) -> None:
        self.rows.append(Row(step, stage, state, duration_s, what))

    def record(self, step: str, report: LifecycleReport, *, over_link: bool = False) -> LifecycleReport:
        status = "" if report.status == "OK" else f" ({report.status})"
        what = memory_text(report, over_link=over_link)
        self.rows.append(Row(step, report.stage, report.state + status, report.duration_s, what))
        return report

    def check(self, what: str, ok: bool) -> str:
        if not ok:
            self.mismatches.append(what)
        return self.tick if ok else self.cross

    def expect_state(self, report: LifecycleReport, state: str) -> LifecycleReport:
        self.check(f"{report.stage} {report.command}: state {report.state}, expected {state}", report.state == state)
        return report

    @staticmethod
    def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        started = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - started

    # ------------------------------------------------------------------ the two stages' outputs

    def tokens(self, engine: Engine, step: str, reference: list[int] | None) -> list[int]:
        out, t = self.timed(lambda: engine.execute("llm", LLM_REQUEST))
        tokens = list(out["token_ids"])
        label = class_label_of(tokens)
        if reference is None:
            self.note(step, "llm", "RUNNING", t, f"{len(tokens)} tokens {tokens[:6]}... -> class {label}")
        else:
            mark = self.check(f"llm tokens at step {step!r}", tokens == reference)
            self.note(step, "llm", "RUNNING", t, f"same {len(tokens)} tokens, class {label} {mark}")
        return tokens

    def image(self, engine: Engine, step: str, name: str, payload: dict[str, Any], stage_op: str = "") -> Image:
        out, t = self.timed(lambda: engine.execute("dit", payload))
        image = Image(name, bytes(out["png"]), str(out["sha256"]))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / name).write_bytes(image.png)
        self.images.append(image)
        what = f"{stage_op}{name}"
        if len(self.images) == 1:
            what += f" (reference, tensor sha256 {image.sha256[:12]})"
        else:
            reference = self.images[0]
            same = image.png == reference.png and image.sha256 == reference.sha256
            what += f" == {reference.name}, bytes and tensor {self.check(f'image {name}', same)}"
        self.note(step, "dit", "RUNNING", t, what)
        return image

    def refused_at_once(
        self, step: str, engine: Engine, stage: str, payload: dict[str, Any], state: str, needle: str
    ) -> None:
        """A request the stage must refuse at once, saying why (`needle`)."""
        started = time.perf_counter()
        try:
            engine.execute(stage, payload, timeout_s=REFUSAL_PROBE_TIMEOUT_S)
        except RequestRejectedError as exc:
            elapsed_s = time.perf_counter() - started
            ok = needle in str(exc) and elapsed_s < AT_ONCE_BOUND_S
            mark = self.check(f"{stage} in {state} refuses at once naming {needle!r} ({elapsed_s:.2f} s: {exc})", ok)
            self.note(step, stage, state, elapsed_s, f"request refused at once ({needle}) {mark}")
            return
        self.check(f"{stage} in {state} served a request", False)
        self.note(step, stage, state, time.perf_counter() - started, f"request served {self.cross}")

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        w = self.out.write
        llm_size, dit_size = SIZES[self.size]
        w(
            f"omni-core demo: {LLM_FAMILY} {llm_size} (tokens) -> {DIT_FAMILY} {dit_size} (image) on one device "
            f"({self.device}, backend {self.backend}); images in {self.out_dir}/\n"
        )
        started = time.perf_counter()
        llm_dir, dit_dir, sd_dir = self.checkpoints()
        self.out_dir.mkdir(parents=True, exist_ok=True)
        began = time.perf_counter()
        specs = self.specs(llm_dir, dit_dir, sd_dir)
        with Engine(specs, trace_path=self.trace_path) as engine:
            w(f"started {len(specs)} stages (1 rank each) in {time.perf_counter() - began:.1f} s\n")
            status = engine.status()
            for name in (spec.name for spec in specs):
                for rank in status[name]["ranks"].values():
                    why = f" ({rank['backend_reason']})" if rank["backend_reason"] else ""
                    w(f"  {name}: backend {rank['backend']}{why}\n")
            self.scenario(engine)
        self.print_table()
        self.write_sheet()
        self.write_summary()
        verdict = "PASS" if not self.mismatches else "FAIL: " + "; ".join(self.mismatches)
        w(
            f"verdict: {verdict} ({len(self.rows)} steps, {len(self.images)} images, "
            f"{time.perf_counter() - started:.1f} s)\n"
        )
        return 0 if not self.mismatches else 1

    def scenario(self, engine: Engine) -> None:
        steps = DIT_STEPS[self.size]
        tokens = self.tokens(engine, "1 serve", None)
        label = class_label_of(tokens)
        dit = {"class_label": label, "seed": DIT_SEED, "steps": steps}
        self.image(engine, "1 serve", "00-reference.png", dit)

        # Level 1, taking turns: the LLM hands the device to the DiT and gets it back.
        self.expect_state(self.record("2 sleep L1", engine.sleep("llm", level=1), over_link=True), "SLEEPING")
        self.image(engine, "2 serve", "01-while-llm-sleeps.png", dit)
        self.expect_state(self.record("2 sleep L1", engine.sleep("dit", level=1), over_link=True), "SLEEPING")
        self.expect_state(self.record("2 wake", engine.wake("llm"), over_link=True), "RUNNING")
        self.tokens(engine, "2 serve", tokens)
        self.expect_state(self.record("2 wake", engine.wake("dit"), over_link=True), "RUNNING")
        self.image(engine, "2 serve", "02-after-dit-L1.png", dit)

        # Level 2: weights discarded; nothing runs until they are reloaded from the checkpoint.
        for stage, payload in (("dit", dit), ("llm", LLM_REQUEST)):
            self.expect_state(self.record("3 sleep L2", engine.sleep(stage, level=2)), "SLEEPING")
            self.expect_state(self.record("3 wake", engine.wake(stage)), "NEEDS_RELOAD")
            self.refused_at_once("3 serve", engine, stage, payload, "NEEDS_RELOAD", "NEEDS_RELOAD")
            self.expect_state(self.record("3 reload", engine.reload_weights(stage)), "RUNNING")
            if stage == "dit":
                self.image(engine, "3 serve", "03-after-dit-L2-reload.png", dit)
            else:
                self.tokens(engine, "3 serve", tokens)

        # Partial wake: the weights are back, the rest is not; the stage refuses work until it is.
        self.expect_state(self.record("4 sleep L1", engine.sleep("dit", level=1), over_link=True), "SLEEPING")
        partial = engine.wake("dit", tags=["weights"])
        self.expect_state(self.record("4 wake weights", partial, over_link=True), "PARTIAL")
        self.refused_at_once("4 serve", engine, "dit", dit, "PARTIAL", "PARTIAL")
        self.expect_state(self.record("4 wake rest", engine.wake("dit", tags=["kv_cache", "requests"])), "RUNNING")
        self.image(engine, "4 serve", "04-after-partial-wake.png", dit)

        # A step-wise request interrupted by a level-1 sleep: its latents and the scheduler's
        # history sleep with the weights, and the finished image is the uninterrupted one.
        begun, t = self.timed(lambda: engine.execute("dit", {"op": "start", **dit}))
        request_id = begun["request_id"]
        self.note("5 start", "dit", "RUNNING", t, f"step-wise request {request_id}: {steps} steps")
        half = steps // 2
        _, t = self.timed(lambda: engine.execute("dit", {"op": "step", "request_id": request_id, "steps": half}))
        self.note("5 step", "dit", "RUNNING", t, f"{half} of {steps} steps done")
        report = self.expect_state(self.record("5 sleep L1", engine.sleep("dit", level=1), over_link=True), "SLEEPING")
        held = all(rr.pool_bytes_before.get("requests", 0) > 0 for rr in report.ranks.values())
        self.check("the step-wise request's state was in the 'requests' pool at the sleep", held)
        self.tokens(engine, "5 serve", tokens)  # the LLM's turn while the DiT sleeps
        self.expect_state(self.record("5 wake", engine.wake("dit"), over_link=True), "RUNNING")
        self.image(
            engine,
            "5 finish",
            "05-stepwise-across-L1.png",
            {"op": "finish", "request_id": request_id},
            stage_op=f"{request_id} finished: ",
        )

        if "sd" in engine.status():
            pipeline_scene(self, engine, PROMPT)
        else:
            self.note("6 pipeline", "llm>sd", "-", 0.0, f"skipped: no {SD_FAMILY} size of the {self.size} LLM's width")

    # ------------------------------------------------------------------ output

    def print_table(self) -> None:
        write_table(
            self.out,
            [(r.step, r.stage, r.state, r.duration_s, r.what) for r in self.rows],
            "memory per rank / check",
            stage_width=6,
            rule_width=110,
        )

    def write_sheet(self) -> None:
        """All images side by side, scaled up (nearest neighbour), each over its file name:
        contact-sheet.png."""
        if not self.images:
            return
        from PIL import Image as PILImage
        from PIL import ImageDraw

        pictures = [PILImage.open(io.BytesIO(image.png)).convert("RGB") for image in self.images]
        scale = max(1, -(-SHEET_MIN_PX // max(p.width for p in pictures)))
        pictures = [p.resize((p.width * scale, p.height * scale), PILImage.Resampling.NEAREST) for p in pictures]
        width = sum(p.width for p in pictures) + SHEET_GAP_PX * (len(pictures) + 1)
        tallest = max(p.height for p in pictures)
        sheet = PILImage.new("RGB", (width, tallest + 2 * SHEET_GAP_PX + SHEET_CAPTION_PX), "white")
        draw = ImageDraw.Draw(sheet)
        x = SHEET_GAP_PX
        for picture, image in zip(pictures, self.images, strict=True):
            sheet.paste(picture, (x, SHEET_GAP_PX))
            draw.text((x, tallest + SHEET_GAP_PX + 4), image.name.removesuffix(".png"), fill="black")
            x += picture.width + SHEET_GAP_PX
        sheet.save(self.out_dir / "contact-sheet.png", optimize=True)

    def write_summary(self) -> None:
        (self.out_dir / "summary.json").write_text(json.dumps(self.summary(), indent=1) + "\n")

    def summary(self) -> dict[str, Any]:
        """The run as data: `summary.json` beside the images, and `omni-core demo --json`."""
        return {
            "verdict": "PASS" if not self.mismatches else "FAIL",
            "mismatches": self.mismatches,
            "device": self.device,
            "backend": self.backend,
            "size": self.size,
            "prompt": PROMPT,
            "images": [
                {"file": i.name, "tensor_sha256": i.sha256, "png_sha256": hashlib.sha256(i.png).hexdigest()}
                for i in self.images
            ],
            "steps": [vars(row) for row in self.rows],
        }


def llm_runner_problem(llm_runner: str, device: str, size: str) -> str | None:
    """Why the language-model stage cannot run on `llm_runner` here, or None."""
    if llm_runner not in LLM_RUNNERS:
        return f"llm_runner {llm_runner!r} is not one of {list(LLM_RUNNERS)}"
    if llm_runner == "vllm" and (device != "cuda" or size == "tiny"):
        return (
            "the vllm language-model stage needs --device cuda and --size large (vLLM runs on a GPU, and its "
            "attention kernels do not take the tiny model's 16-wide heads)"
        )
    return None


def main(
    device: str = "cpu",
    backend: str | None = None,
    size: str = "tiny",
    out_dir: str = "omni-core-demo-out",
    models_dir: str | None = None,
    trace_path: str | None = None,
    llm_runner: str = "transformers",
    json_out: bool = False,
) -> int:
    """`json_out`: the narration on stderr, `RealDemo.summary()` as JSON on stdout."""
    demo = RealDemo(
        device=device,
        backend=backend,
        size=size,
        out_dir=Path(out_dir),
        models_dir=Path(models_dir) if models_dir else default_models_dir(),
        trace_path=trace_path,
        llm_runner=llm_runner,
        out=sys.stderr if json_out else sys.stdout,
    )
    code = demo.run()
    if json_out:
        print(json.dumps(demo.summary(), indent=2))
    return code
