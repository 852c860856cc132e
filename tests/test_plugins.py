"""One registry for runner and backend names (omni_core.plugins): omni-core's own, those an
installed package registers as entry points, and import paths. The spec that checks a name
and the rank that resolves it read the same registry, so they accept the same names."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.engine import InvalidArgumentError, StageSpec
from omni_core.plugins import BACKENDS, RUNNERS, name_problem, registered
from omni_core.runners.base import load_runner_class
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.backends import BackendUnavailable, select_backend
from omni_testing.faults import FailingWakeBackend, FaultyRunner

ENTRY_POINTS = """\
[omni_core.backends]
demo-backend = omni_testing.faults:FailingWakeBackend
not-a-backend = omni_testing.faults:FaultyRunner

[omni_core.runners]
demo-runner = omni_testing.faults:FaultyRunner
synthetic = omni_testing.faults:FaultyRunner
"""


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package that registers a backend and a runner, installed on sys.path."""
    dist = tmp_path / "omni_core_demo_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: omni-core-demo-plugin\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_a_registered_backend_and_runner_are_taken_by_the_spec_and_the_rank(installed: None) -> None:
    spec = StageSpec("s", runner="demo-runner", backend="demo-backend")
    assert isinstance(select_backend(spec.backend, "cpu"), FailingWakeBackend)
    assert load_runner_class(spec.runner) is FaultyRunner
    assert registered(BACKENDS)["demo-backend"] == "omni_testing.faults:FailingWakeBackend"


def test_a_registered_name_does_not_shadow_a_builtin(installed: None) -> None:
    assert load_runner_class("synthetic") is SyntheticRunner


def test_a_registered_backend_must_be_a_memory_backend(installed: None) -> None:
    with pytest.raises(TypeError, match=r"not a subclass of omni_core\.workers\.backends\.MemoryBackend"):
        select_backend("not-a-backend", "cpu")


def test_an_unregistered_name_is_refused_alike_by_the_spec_and_the_rank() -> None:
    problem = name_problem(BACKENDS, "demo-backend")
    assert problem is not None and "entry-point group 'omni_core.backends'" in problem
    with pytest.raises(InvalidArgumentError) as refused:
        StageSpec("s", backend="demo-backend")
    assert problem in str(refused.value)
    with pytest.raises(BackendUnavailable) as unavailable:
        select_backend("demo-backend", "cpu")
    assert str(unavailable.value) == problem
    with pytest.raises(InvalidArgumentError, match="field 'runner': runner 'demo-runner' is not one of"):
        StageSpec("s", runner="demo-runner")
    assert name_problem(RUNNERS, "demo-runner") is not None
