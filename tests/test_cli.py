"""The operator's command line: --version, --json, a closed pipe, progress, one-line errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

import omni_core
import omni_core.resources
from omni_core.cli import main as cli_main
from omni_core.progress import Progress

OMNI_CORE = [sys.executable, "-m", "omni_core.cli"]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_version_names_the_release_and_where_it_is_installed(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        cli_main(["--version"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"omni-core {omni_core.__version__} (") and str(Path(omni_core.__file__).parent) in out


def test_a_closed_pipe_ends_quietly() -> None:
    """`omni-core tables --format json | head -0`: the reader is gone before anything is written."""
    proc = subprocess.Popen([*OMNI_CORE, "tables", "--format", "json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141


def test_progress_redraws_one_line_on_a_terminal_and_clears_it() -> None:
    stream = Terminal()
    with Progress("qwen2 tiny", unit="M params", scale=1e6, stream=stream) as progress:
        progress.add_total(2_000_000)
        progress.advance(2_000_000)
    text = stream.getvalue()
    assert "qwen2 tiny: 100% (2.00 of 2.00 M params)" in text
    assert "\n" not in text and text.endswith("\r")  # redrawn in place, then cleared


def test_progress_is_silent_off_a_terminal_or_when_disabled() -> None:
    for stream, enabled in ((io.StringIO(), None), (Terminal(), False)):
        with Progress("x", stream=stream, enabled=enabled) as progress:
            progress.add_total(10)
            progress.advance(10)
        assert stream.getvalue() == ""


def test_models_make_counts_every_parameter(tmp_path) -> None:
    from omni_core.models import make_checkpoint

    stream = Terminal()
    progress = Progress("ddpm tiny", stream=stream)
    info = make_checkpoint("ddpm", "tiny", tmp_path / "ddpm", progress=progress)
    assert progress.total == progress.done == info.params > 0
    assert "100%" in stream.getvalue()


def test_models_make_json_and_no_progress_off_a_terminal(tmp_path, capsys) -> None:
    assert cli_main(["models", "make", "qwen2", "tiny", str(tmp_path / "q"), "--json"]) == 0
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    assert info["family"] == "qwen2" and info["params"] > 0 and info["path"] == str(tmp_path / "q")
    assert captured.err == ""
    assert cli_main(["models", "list", "--json"]) == 0
    families = json.loads(capsys.readouterr().out)
    assert {"family", "description", "sizes"} <= set(families[0])


def test_examples_lists_and_prints_the_shipped_configs(capsys) -> None:
    assert cli_main(["examples", "--json"]) == 0
    listed = {e["name"]: e for e in json.loads(capsys.readouterr().out)}
    assert "two_stages" in listed and Path(listed["two_stages"]["path"]).is_file()
    assert cli_main(["examples", "two_stages"]) == 0
    assert capsys.readouterr().out == Path(listed["two_stages"]["path"]).read_text()
    assert cli_main(["examples", "nope"]) == 2
    assert "no example named 'nope'; there are" in capsys.readouterr().err


def _no_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the error is for machines without it")


def test_demo_on_cuda_without_cuda_is_one_line_naming_the_option(capsys) -> None:
    _no_cuda()
    assert cli_main(["demo", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("omni-core demo: --device cuda: 'cuda' needs a CUDA GPU") and "--device cpu" in err, err


def test_demo_of_a_cuda_config_without_cuda_names_the_toml_key(tmp_path, capsys) -> None:
    _no_cuda()
    config = tmp_path / "cuda.toml"
    config.write_text(
        omni_core.resources.data_file("examples", "two_stages.toml")
        .read_text()
        .replace('device = "cpu"', 'device = "cuda"')
    )
    assert cli_main(["demo", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "stage 'talker': device = 'cuda'" in err and "TOML key `device`" in err, err


def test_demo_json_puts_the_steps_on_stdout_and_the_narration_on_stderr(capsys) -> None:
    assert cli_main(["demo", "--synthetic", "--weights-mib", "1", "--json"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["verdict"] == "PASS" and summary["mismatches"] == [] and summary["weights_mib"] == 1
    assert {"2 sleep L1", "4 reload"} <= {step["step"] for step in summary["steps"]}
    assert "verdict: PASS" in captured.err
    config = str(omni_core.resources.data_file("examples", "two_stages.toml"))
    assert cli_main(["demo", "--config", config, "--json"]) == 2
    assert "--json is for the built-in scenarios" in capsys.readouterr().err


def test_conformance_counts_its_cases_on_the_progress_line() -> None:
    from omni_core.conformance.runner import run_suite

    stream = Terminal()
    progress = Progress("conformance", unit="cases", stream=stream)
    report = run_suite("synthetic", only="P-3", progress=progress)
    assert progress.total == progress.done == len(report.results) > 1
    assert f"conformance: 100% ({progress.total} of {progress.total} cases)" in stream.getvalue()


def test_tables_json_is_the_tables_as_data(capsys) -> None:
    assert cli_main(["tables", "--json"]) == 0
    as_flag = capsys.readouterr().out
    assert cli_main(["tables", "--format", "json"]) == 0
    assert json.loads(as_flag) == json.loads(capsys.readouterr().out)
