"""`omni-core demo` on real models, as CI runs it: tiny Qwen2 + tiny DiT on the CPU.

One run of the whole scenario (about 30 s on the shared 2-core CI machine, most of it the two
rank processes importing torch, transformers and diffusers), checked from its table, its
images and its summary; the checkpoint cache and the command line's options separately.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from omni_core.cli import main as cli_main
from omni_core.demo_pipeline import BY_HAND_IMAGE, PIPELINE_IMAGE, pipeline_scene
from omni_core.demo_real import MARKER, RealDemo, cached_checkpoint, class_label_of

STEPS = (
    "2 sleep L1",
    "2 wake",
    "3 sleep L2",
    "3 wake",
    "3 reload",
    "4 wake weights",
    "4 wake rest",
    "5 start",
    "5 step",
    "5 sleep L1",
    "5 finish",
    "6 sleep L1",
    "6 wake",
    "6 pipeline",
    "6 by hand",
)
IMAGES = (
    "00-reference.png",
    "01-while-llm-sleeps.png",
    "02-after-dit-L1.png",
    "03-after-dit-L2-reload.png",
    "04-after-partial-wake.png",
    "05-stepwise-across-L1.png",
)
PIPELINE_IMAGES = (PIPELINE_IMAGE, BY_HAND_IMAGE)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory) -> tuple[int, str, Path]:
    root = tmp_path_factory.mktemp("demo")
    out = io.StringIO()
    code = RealDemo(out_dir=root / "out", models_dir=root / "models", out=out).run()
    return code, out.getvalue(), root / "out"


def test_demo_passes_through_every_lifecycle(demo_run) -> None:
    code, text, _ = demo_run
    assert code == 0, text
    assert "verdict: PASS" in text, text
    for step in STEPS:
        assert step in text, step
    assert "NEEDS_RELOAD" in text and "PARTIAL" in text
    assert text.count("request refused at once") == 3, text  # L2 twice (dit, llm), partial wake once
    assert "✗" not in text


def test_demo_names_each_backend_and_the_link_rate_of_each_level_1_move(demo_run) -> None:
    _, text, _ = demo_run
    assert all(f"  {stage}: backend portable" in text for stage in ("llm", "dit", "sd"))
    rows = text.splitlines()
    level_1 = ("2 sleep L1", "2 wake", "5 sleep L1", "5 wake", "4 wake weights", "6 sleep L1", "6 wake")
    over_link = [r for r in rows if r.startswith(level_1)]
    assert len(over_link) == 12 and all(" GB/s)" in r for r in over_link), over_link
    assert not any(" GB/s" in r for r in rows if r.startswith(("3 sleep L2", "3 wake", "4 wake rest")))


def test_demo_writes_the_same_image_after_every_sleep(demo_run) -> None:
    _, _, out = demo_run
    pngs = {name: (out / name).read_bytes() for name in IMAGES}
    assert all(png.startswith(b"\x89PNG") for png in pngs.values())
    assert len(set(pngs.values())) == 1  # byte for byte
    assert (out / "contact-sheet.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS" and summary["mismatches"] == []
    assert [i["file"] for i in summary["images"]] == [*IMAGES, *PIPELINE_IMAGES]
    assert len({i["tensor_sha256"] for i in summary["images"][: len(IMAGES)]}) == 1
    # The DiT's class came from the LLM's tokens, and the table says which.
    first = next(s for s in summary["steps"] if s["stage"] == "llm")
    assert "-> class " in first["what"]


def test_demo_conditions_the_diffusion_stage_through_a_transfer_as_by_hand(demo_run) -> None:
    """Step 6: both stages asleep, the transfer wakes sd, the LLM sleeps again once the hop is
    released, and the image equals the one the caller chained by hand."""
    _, text, out = demo_run
    through, by_hand = ((out / name).read_bytes() for name in PIPELINE_IMAGES)
    assert through.startswith(b"\x89PNG") and through == by_hand
    assert through != (out / IMAGES[0]).read_bytes()  # another model's image, not a DiT copy
    rows = [r for r in text.splitlines() if r.startswith("6 ")]
    assert [r.split()[2] for r in rows] == ["L1", "L1", "llm", "llm>sd", "L1", "llm", "hand"], rows
    assert "moved by a transfer at llm v0, sd woken ✓" in rows[3]
    assert rows[-1].endswith(f"{BY_HAND_IMAGE} == {PIPELINE_IMAGE}, bytes and tensor ✓")


def test_the_class_label_follows_the_tokens() -> None:
    assert class_label_of([1, 2, 3]) == 6
    assert class_label_of([999, 2]) == 1
    assert class_label_of([5, 6]) != class_label_of([5, 7])


def test_checkpoints_are_made_once_and_reused(tmp_path) -> None:
    path, made_s = cached_checkpoint(tmp_path, "qwen2", "tiny")
    assert made_s > 0 and (path / "config.json").is_file()
    marker = tmp_path / f"{path.name}.{MARKER}"
    assert json.loads(marker.read_text())["family"] == "qwen2"
    assert cached_checkpoint(tmp_path, "qwen2", "tiny") == (path, 0.0)
    marker.unlink()  # as an interrupted run leaves it: made again, over the half directory
    again, made_s = cached_checkpoint(tmp_path, "qwen2", "tiny")
    assert again == path and made_s > 0 and marker.is_file()


def test_command_line_options(capsys) -> None:
    assert cli_main(["demo", "--weights-mib", "4"]) == 2
    assert "--synthetic" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["demo", "--size", "huge"])


class _StubEngine:
    """What the pipeline scene asks of an engine, answering with given images: the scene's
    own checks, without rank processes."""

    def __init__(self, by_hand_png: bytes, sd_state: str = "RUNNING") -> None:
        self.by_hand_png, self.sd_state = by_hand_png, sd_state
        self.calls: list[tuple[str, str]] = []

    def _report(self, stage: str, command: str, state: str) -> SimpleNamespace:
        self.calls.append((command, stage))
        return SimpleNamespace(stage=stage, command=command, state=state, status="OK", duration_s=0.0, ranks={})

    def sleep(self, stage: str, level: int) -> SimpleNamespace:
        return self._report(stage, "Sleep", "SLEEPING")

    def wake(self, stage: str) -> SimpleNamespace:
        return self._report(stage, "Wake", "RUNNING")

    def pipeline(self, stages: list) -> SimpleNamespace:
        self.calls.append(("pipeline", ">".join(s.stage for s in stages)))
        return SimpleNamespace(output={"png": b"\x89PNG same", "sha256": "ab"}, producer_versions=(0,))

    def status(self) -> dict:
        return {"sd": {"state": self.sd_state}}

    def execute(self, stage: str, payload: dict) -> dict:
        self.calls.append(("execute", stage))
        if stage == "llm":
            assert payload["export"] == ["prompt_embeds"]
            return {"prompt_embeds": "the wire tensor"}
        assert payload["conditioning"] == {"prompt_embeds": "the wire tensor"}
        return {"png": self.by_hand_png, "sha256": "ab"}


@pytest.mark.parametrize(
    ("by_hand_png", "sd_state", "mismatch"),
    [
        (b"\x89PNG same", "RUNNING", None),
        (b"\x89PNG other", "RUNNING", f"image {BY_HAND_IMAGE} equals {PIPELINE_IMAGE}"),
        (b"\x89PNG same", "SLEEPING", "the transfer woke the sleeping sd stage"),
    ],
)
def test_the_pipeline_scene_fails_the_demo_when_its_image_or_wake_differs(
    tmp_path, by_hand_png, sd_state, mismatch
) -> None:
    demo = RealDemo(out_dir=tmp_path, models_dir=tmp_path, out=io.StringIO())
    engine = _StubEngine(by_hand_png, sd_state)
    pipeline_scene(demo, engine, "a fox")  # type: ignore[arg-type]
    if mismatch is None:
        assert demo.mismatches == []
    else:
        assert len(demo.mismatches) == 1 and mismatch in demo.mismatches[0], demo.mismatches
    # Both asleep, the producer woken, the pipeline, the producer asleep and awake, then by hand.
    assert engine.calls[:4] == [("Sleep", "llm"), ("Sleep", "sd"), ("Wake", "llm"), ("pipeline", "llm>sd")]
    assert engine.calls[-2:] == [("execute", "llm"), ("execute", "sd")]
    assert (tmp_path / BY_HAND_IMAGE).read_bytes() == by_hand_png


def test_the_sd_stage_is_started_only_with_a_checkpoint_of_the_llms_width(tmp_path) -> None:
    from omni_core.demo_pipeline import SD_SIZES
    from omni_core.engine import AdmissionPolicy

    demo = RealDemo(out_dir=tmp_path, models_dir=tmp_path, out=io.StringIO())
    assert [s.name for s in demo.specs(tmp_path / "llm", tmp_path / "dit")] == ["llm", "dit"]
    specs = {s.name: s for s in demo.specs(tmp_path / "llm", tmp_path / "dit", tmp_path / "sd")}
    assert specs["sd"].admission is AdmissionPolicy.WAKE  # the transfer wakes it
    assert specs["llm"].admission is specs["dit"].admission is AdmissionPolicy.REJECT
    assert SD_SIZES == {"tiny": "tiny-64", "large": None}  # no SD of Qwen2 1.5B's width (1536)
