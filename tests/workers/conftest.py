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
