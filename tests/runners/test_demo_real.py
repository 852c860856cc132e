"""`omni-core demo` on real models, as CI runs it: tiny Qwen2 + tiny DiT on the CPU.

One run of the whole scenario (about 30 s on the shared 2-core CI machine, most of it the two
rank processes importing torch, transformers and diffusers), checked from its table, its
images and its summary; the checkpoint cache and the command line's options separately.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from omni_core.cli import main as cli_main
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
)
IMAGES = (
    "00-reference.png",
    "01-while-llm-sleeps.png",
    "02-after-dit-L1.png",
    "03-after-dit-L2-reload.png",
    "04-after-partial-wake.png",
    "05-stepwise-across-L1.png",
)


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
    assert "  llm: backend portable" in text and "  dit: backend portable" in text
    rows = text.splitlines()
    over_link = [r for r in rows if r.startswith(("2 sleep L1", "2 wake", "5 sleep L1", "5 wake", "4 wake weights"))]
    assert len(over_link) == 7 and all(" GB/s)" in r for r in over_link), over_link
    assert not any(" GB/s" in r for r in rows if r.startswith(("3 sleep L2", "3 wake", "4 wake rest")))


def test_demo_writes_the_same_image_after_every_sleep(demo_run) -> None:
    _, _, out = demo_run
    pngs = {name: (out / name).read_bytes() for name in IMAGES}
    assert all(png.startswith(b"\x89PNG") for png in pngs.values())
    assert len(set(pngs.values())) == 1  # byte for byte
    assert (out / "contact-sheet.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == "PASS" and summary["mismatches"] == []
    assert [i["file"] for i in summary["images"]] == list(IMAGES)
    assert len({i["tensor_sha256"] for i in summary["images"]}) == 1
    # The DiT's class came from the LLM's tokens, and the table says which.
    first = next(s for s in summary["steps"] if s["stage"] == "llm")
    assert "-> class " in first["what"]


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
