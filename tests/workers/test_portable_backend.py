"""The portable backend on CPU: storage really released, restored bit for bit, nothing kept
at level 2 except the runner's buffers."""

from __future__ import annotations

import pytest
import torch

from omni_core.runners.synthetic import SyntheticRunner
from omni_core.workers.backends import BackendStateError, PortableBackend

W, KV = "weights", "kv_cache"
PAYLOAD = {"seed": 3, "batch": 4}


def loaded(**runner_args) -> tuple[PortableBackend, SyntheticRunner]:
    backend = PortableBackend(torch.device("cpu"))
    runner = SyntheticRunner(
        torch.device("cpu"),
        **{"weights_bytes": 1 << 20, "tensor_count": 8, "kv_bytes": 64 << 10, "hidden": 64, **runner_args},
    )
    for tag in (W, KV):
        with backend.pool(tag):
            runner.allocate(tag)
        backend.track(tag, runner.tensors(tag))
    return backend, runner


def snapshot(runner: SyntheticRunner) -> list[torch.Tensor]:
    return [t.clone() for t in runner.tensors(W)]


def test_sleep_releases_every_storage_and_keeps_the_tensor_objects():
    backend, runner = loaded()
    objects = [id(t) for t in runner.tensors(W) + runner.tensors(KV)]
    shapes = [t.shape for t in runner.tensors(W)]
    backend.sleep({W}, {KV})
    assert all(t.untyped_storage().nbytes() == 0 for t in runner.tensors(W) + runner.tensors(KV))
    assert backend.usage() == {W: 0, KV: 0}
    assert backend.host_bytes() == sum(t.numel() * t.element_size() for t in runner.tensors(W))  # KV: no copy
    assert [id(t) for t in runner.tensors(W) + runner.tensors(KV)] == objects
    assert [t.shape for t in runner.tensors(W)] == shapes
    with pytest.raises(RuntimeError, match="holds no memory"):
        runner.execute(PAYLOAD)


def test_level1_wake_restores_bit_exact():
    backend, runner = loaded(dtype="bfloat16")
    before, out = snapshot(runner), runner.execute(PAYLOAD)
    usage = backend.usage()
    backend.sleep({W}, {KV}, buffers=runner.buffers_to_save())
    backend.wake({W, KV})
    assert backend.usage() == usage and backend.host_bytes() == 0
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(runner), strict=True))
    assert runner.execute(PAYLOAD)["data"] == out["data"]


def test_level2_keeps_no_copy_but_the_buffers():
    backend, runner = loaded()
    out = runner.execute(PAYLOAD)
    calibration = runner.calibration.clone()
    backend.sleep(set(), {W, KV}, buffers=runner.buffers_to_save())
    assert backend.host_bytes() == calibration.numel() * calibration.element_size()  # the buffer only
    backend.wake({W, KV})
    assert all(not t.any() for t in runner.weights)  # discarded: zeros, not the old values
    assert torch.equal(runner.calibration, calibration)  # saved buffer written back in place
    assert runner.execute(PAYLOAD)["data"] != out["data"]
    runner.reload_weights(None)
    assert runner.execute(PAYLOAD)["data"] == out["data"]


def test_a_lost_buffer_would_be_noticed():
    """The synthetic output depends on the calibration buffer that reload does not refill."""
    backend, runner = loaded()
    out = runner.execute(PAYLOAD)
    backend.sleep(set(), {W, KV})  # buffers not passed: nothing saves the calibration
    backend.wake({W, KV})
    runner.reload_weights(None)
    assert runner.execute(PAYLOAD)["data"] != out["data"]


def test_partial_sleep_and_wake():
    backend, runner = loaded()
    out = runner.execute(PAYLOAD)
    backend.sleep(set(), {KV})
    assert backend.usage()[KV] == 0 and backend.usage()[W] > 0
    backend.sleep({W}, set())  # the rest later, with KV already asleep
    backend.wake({W})
    assert backend.asleep == {KV}
    with pytest.raises(RuntimeError, match=r"kv_cache tensor .* holds no memory"):
        runner.execute(PAYLOAD)
    backend.wake({KV})
    assert runner.execute(PAYLOAD)["data"] == out["data"]


def test_views_share_the_released_storage():
    backend = PortableBackend(torch.device("cpu"))
    base = torch.arange(64, dtype=torch.float32)
    view = base[8:16]
    with backend.pool(W):
        pass
    backend.track(W, [base, view])
    assert backend.usage() == {W: 64 * 4}  # one storage, counted once
    backend.sleep({W}, set())
    assert view.untyped_storage().nbytes() == 0
    backend.wake({W})
    assert torch.equal(view, torch.arange(8, 16, dtype=torch.float32))


def test_misuse_is_refused_whole():
    backend, _ = loaded()
    with pytest.raises(BackendStateError, match="unknown tag"):
        backend.sleep({"activations"}, set())
    backend.sleep({W}, {KV})
    with pytest.raises(BackendStateError, match="already asleep"):
        backend.sleep({W}, set())
    with pytest.raises(BackendStateError, match="not asleep"):
        backend.wake({"weights", "other"})
    with pytest.raises(BackendStateError, match="while it is asleep"), backend.pool(W):
        pass
    with pytest.raises(BackendStateError, match="both offloaded and discarded"):
        PortableBackend(torch.device("cpu")).sleep({W}, {W})


def test_release_drops_host_copies():
    backend, _ = loaded()
    backend.sleep({W}, {KV})
    assert backend.host_bytes() > 0
    backend.release()
    assert backend.host_bytes() == 0
