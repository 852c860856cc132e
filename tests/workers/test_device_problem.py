"""A device the machine lacks is named with the setting that chose it, before torch's own words."""

from __future__ import annotations

import pytest
import torch

from omni_core.engine import Engine, StageFailedError, StageSpec
from omni_core.workers.config import device_problem

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_cpu_is_fine_and_a_non_device_is_named() -> None:
    assert device_problem("cpu") is None
    assert "'tpu' is not a torch device" in (device_problem("tpu") or "")


@needs_no_cuda
def test_cuda_without_cuda_says_which_torch_sees_none() -> None:
    problem = device_problem("cuda:1") or ""
    assert problem.startswith("'cuda:1' needs a CUDA GPU") and torch.__version__ in problem


@needs_no_cuda
def test_a_rank_on_a_missing_device_fails_naming_the_stage_setting() -> None:
    spec = StageSpec(
        name="s",
        runner="synthetic",
        device="cuda",
        backend="portable",
        runner_args={"weights_bytes": 4096, "kv_bytes": 4096},
    )
    with pytest.raises(StageFailedError) as caught, Engine([spec]):
        pass
    text = str(caught.value)
    assert "device 'cuda' needs a CUDA GPU" in text and "the TOML key `device`" in text, text
    assert "Torch not compiled with CUDA enabled" not in text
