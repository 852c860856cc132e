"""A reload reads the path it checked: resolved once, opened without following a link that
appeared since, and a path that cannot be a path (a NUL) is refused as an argument."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omni_core.runners.base import RunnerArgumentError
from omni_core.runners.weights import WeightSet, opened_without_links, resolved


def checkpoint(directory: Path, value: float) -> Path:
    directory.mkdir(parents=True)
    save_file(
        {"weight": torch.full((4, 4), value), "bias": torch.full((4,), value)}, str(directory / "model.safetensors")
    )
    return directory


@pytest.fixture
def weights(tmp_path: Path) -> tuple[WeightSet, torch.nn.Linear]:
    module = torch.nn.Linear(4, 4)
    with torch.no_grad():
        module.weight.fill_(1.0)
        module.bias.fill_(1.0)
    weight_set = WeightSet({"": module})
    weight_set.bind_source(checkpoint(tmp_path / "own", 1.0))
    return weight_set, module


def test_a_source_swapped_for_a_link_after_the_check_is_refused_weights_untouched(weights, tmp_path, monkeypatch):
    weight_set, module = weights
    good = checkpoint(tmp_path / "allowed" / "new", 2.0)
    evil = checkpoint(tmp_path / "elsewhere" / "evil", 666.0)
    planned = weight_set.plan

    def plan_then_swap(directory: Path):  # the attacker's move between the check and the read
        steps = planned(directory)
        os.rename(good, tmp_path / "allowed" / "moved")
        os.symlink(evil, good)
        return steps

    monkeypatch.setattr(weight_set, "plan", plan_then_swap)
    with pytest.raises(RunnerArgumentError, match=r"without following a symlink.*changed after it was checked"):
        weight_set.load(good)
    assert float(module.weight.detach()[0, 0]) == 1.0 and float(module.bias.detach()[0]) == 1.0  # nothing written
    monkeypatch.undo()
    weight_set.load(tmp_path / "allowed" / "moved")  # an honest reload still works
    assert float(module.weight.detach()[0, 0]) == 2.0


def test_a_link_in_the_source_is_resolved_once_and_read_there(weights, tmp_path):
    weight_set, module = weights
    real = checkpoint(tmp_path / "real", 3.0)
    (tmp_path / "link").symlink_to(real)
    report = weight_set.load(tmp_path / "link")
    assert float(module.weight.detach()[0, 0]) == 3.0 and report.tensors == 2
    with opened_without_links(resolved(real / "model.safetensors")) as name:
        assert os.path.samefile(name, real / "model.safetensors")
    with (
        pytest.raises(RunnerArgumentError, match="without following a symlink"),
        opened_without_links(tmp_path / "link" / "model.safetensors"),
    ):
        pass


@pytest.mark.parametrize("source", ["/tmp/a\x00b", "\x00"])
def test_a_source_with_a_nul_is_refused_as_an_argument(weights, source):
    weight_set, module = weights
    with pytest.raises(RunnerArgumentError, match="not a usable path"):
        weight_set.load(Path(source))
    assert float(module.weight.detach()[0, 0]) == 1.0
