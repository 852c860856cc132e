from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_cpu_thread():
    """Tiny CPU matmuls run fastest on one thread, and on a loaded CI machine several
    intra-op threads can cost a scheduler slice per op. Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def runner():  # type: ignore[no-untyped-def]
    """A loaded synthetic runner that records the names an update writes (the weight-receiver
    tests: test_weight_receiver, test_shm_attacks, test_ipc_attacks)."""
    from .test_weight_receiver import RecordingRunner

    RecordingRunner.writes = []
    r = RecordingRunner(torch.device("cpu"), weights_bytes=4096, tensor_count=2, hidden=16, kv_bytes=1024)
    r.load_weights()
    r.allocate_caches()
    return r
