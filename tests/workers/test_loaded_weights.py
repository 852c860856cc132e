"""What a rank's Hello says of its runner's load: step mode, and the weights read (sorted),
or none where they break the Hello's bounds (never a part of them)."""

from __future__ import annotations

import pytest
import torch

from omni_core.protocol import Capability
from omni_core.protocol.messages import MAX_LOADED_WEIGHTS, MAX_WEIGHT_NAME_CHARS
from omni_core.runners.synthetic import SyntheticRunner

from ._harness import TestOrchestrator

RUNNER = "tests.workers.named_runner:NamedWeightsRunner"
SMALL = {"weights_bytes": 64 << 10, "tensor_count": 2, "kv_bytes": 4 << 10, "hidden": 8, "cpu_threads": 1}


@pytest.fixture(scope="module")
def hellos():
    orch = TestOrchestrator()
    try:
        cases = {
            "three": {"names": 3},
            "too_many": {"names": MAX_LOADED_WEIGHTS + 1},
            "too_long": {"names": 1, "name_chars": MAX_WEIGHT_NAME_CHARS + 1},
        }
        workers = {
            case: orch.spawn(rank, runner=RUNNER, runner_args={**SMALL, **args})
            for rank, (case, args) in enumerate(cases.items())
        }
        yield {case: orch.wait_hello(worker) for case, worker in workers.items()}
    finally:
        orch.close()


def test_the_hello_lists_the_loaded_weights_sorted_and_declares_step_mode(hellos):
    assert hellos["three"].loaded_weights == ("w0000000", "w0000001", "w0000002")
    assert Capability.STEP_MODE in hellos["three"].capabilities


@pytest.mark.parametrize("case", ["too_many", "too_long"])
def test_names_beyond_the_bounds_are_not_sent_and_the_rank_still_starts(hellos, case):
    assert hellos[case].loaded_weights == () and hellos[case].detail == ""


def test_a_runner_that_does_not_say_declares_neither():
    runner = SyntheticRunner(torch.device("cpu"), **SMALL)
    assert runner.loaded_weights() == frozenset() and runner.supports_step_mode is False
