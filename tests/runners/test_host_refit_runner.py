"""The transformers runner refitted while asleep (Capability.HOST_REFIT), on CPU: its reload
and its update_weights, written through the host copy of the portable backend while the
weights sleep at level 1, bring back exactly a runner started on the new weights; nothing is
mapped meanwhile, and the tensors get their own storage back whatever the write did."""

from __future__ import annotations

import pytest

from omni_core.runners.base import RunnerArgumentError
from omni_core.workers.host_refit import host_refit_ready, weights_on_host

from .test_transformers_runner import GREEDY, runner_in_pools


def test_a_reload_into_the_host_copy_equals_a_runner_started_on_it(checkpoints) -> None:
    expected = runner_in_pools(checkpoints["qwen2-seed1"]).runner.execute(GREEDY)
    pools = runner_in_pools(checkpoints["qwen2"])
    assert host_refit_ready(pools.backend, pools.runner, pools.tags)
    assert pools.runner.execute(GREEDY) != expected
    pools.sleep(1)
    with weights_on_host(pools.backend, pools.runner.host_refit_tensors()) as nbytes:
        pools.runner.reload_weights(str(checkpoints["qwen2-seed1"]))
        assert pools.backend.usage()["weights"] == 0  # written on the host: nothing mapped
    assert nbytes == pools.backend.host_bytes()
    assert pools.backend.usage()["weights"] == 0
    pools.wake()
    assert pools.runner.execute(GREEDY) == expected


def test_an_update_into_the_host_copy_equals_a_runner_started_on_it(checkpoints) -> None:
    source = runner_in_pools(checkpoints["qwen2-seed1"]).runner
    expected = source.execute(GREEDY)
    pools = runner_in_pools(checkpoints["qwen2"])
    pools.sleep(1)
    with weights_on_host(pools.backend, pools.runner.host_refit_tensors()):
        pools.runner.update_weights(source.weights_to_share().items())
    pools.wake()
    assert pools.runner.execute(GREEDY) == expected


def test_the_tensors_get_their_storage_back_when_the_write_raises(checkpoints) -> None:
    pools = runner_in_pools(checkpoints["qwen2"])
    before = pools.runner.execute(GREEDY)
    storages = [t.untyped_storage()._cdata for t in pools.runner.host_refit_tensors()]
    pools.sleep(1)
    with pytest.raises(RuntimeError, match="midway"), weights_on_host(pools.backend, pools.runner.host_refit_tensors()):
        raise RuntimeError("the sender vanished midway")
    assert [t.untyped_storage()._cdata for t in pools.runner.host_refit_tensors()] == storages
    pools.wake()
    assert pools.runner.execute(GREEDY) == before  # nothing was written: the old weights


def test_weights_without_a_host_copy_refuse_before_anything_is_written(checkpoints) -> None:
    pools = runner_in_pools(checkpoints["qwen2"])
    pools.sleep(2)  # level 2 keeps no host copy
    tensors = pools.runner.host_refit_tensors()
    with pytest.raises(RunnerArgumentError, match="no host copy"), weights_on_host(pools.backend, tensors):
        raise AssertionError("never entered")
    awake = runner_in_pools(checkpoints["qwen2"])
    tensors = awake.runner.host_refit_tensors()
    with pytest.raises(RunnerArgumentError, match="is not asleep"), weights_on_host(awake.backend, tensors):
        raise AssertionError("never entered")
    assert all(t.device.type == "cpu" and t.untyped_storage().nbytes() for t in awake.runner.tensors("weights"))
