"""Real-model runner tests: tiny seeded checkpoints, CPU, one thread.

Skipped as a whole without the `models` extra (transformers, diffusers). The checkpoints are
written once per session; tests that need a variant (another seed, a broken file) derive it
from these in their own tmp dirs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="needs the models extra: pip install -e '.[models]'")
pytest.importorskip("diffusers", reason="needs the models extra: pip install -e '.[models]'")

from omni_core.fsm.tags import plan_sleep
from omni_core.models import make_checkpoint
from omni_core.runners.base import ModelRunner
from omni_core.workers.backends import PortableBackend

CPU = torch.device("cpu")
# (family, seed) of every checkpoint the tests use; seed 1 is "another checkpoint of the
# same architecture" for weight updates.
CHECKPOINTS = (("qwen2", 0), ("qwen2", 1), ("llama", 0), ("dit", 0), ("dit", 1), ("ddpm", 0), ("sd", 0))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """'qwen2', 'qwen2-seed1', 'llama', 'dit', 'dit-seed1', 'ddpm', 'sd' -> tiny checkpoint dir."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for family, seed in CHECKPOINTS:
        name = family if seed == 0 else f"{family}-seed{seed}"
        out[name] = Path(make_checkpoint(family, "tiny", root / name, seed=seed).path)
    return out


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """Results must not depend on the machine's load, and tiny models run fastest on one
    thread. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Pools:
    """A runner in the pools of a portable backend, driven the way the worker drives it:
    allocate each tag inside its pool, track it, sleep with the runner's saved buffers."""

    def __init__(self, runner: ModelRunner, tags: tuple[str, ...] = ("weights", "kv_cache")) -> None:
        self.runner, self.tags = runner, tags
        self.backend = PortableBackend(CPU)
        for tag in tags:
            with self.backend.pool(tag):
                runner.allocate(tag)
            self.backend.track(tag, runner.tensors(tag))

    def sleep(self, level: int) -> None:
        plan = plan_sleep(level, frozenset(self.tags))  # what the worker's state machine asks for
        self.runner.before_sleep(plan.offload, plan.discard)
        self.backend.sleep(plan.offload, plan.discard, buffers=self.runner.buffers_to_save())

    def wake(self, tags: tuple[str, ...] | None = None) -> None:
        self.backend.wake(set(tags or self.tags))

    def reload(self, source: str | None = None) -> None:
        self.runner.reload_weights(source)
        self.backend.track("weights", self.runner.tensors("weights"))
