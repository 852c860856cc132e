"""Process-scoped accounting on a real GPU with this process's pid hidden from NVML, as in a
container's PID namespace: the figure stays this process's own (never device-wide), whether
NVML lists the process under another pid (its entry found by its growth) or not at all (the
own tally). A neighbour process holds memory on the same device throughout.

    source .device/setup.sh && python3 -m pytest -q -m gpu tests/workers/test_gpu_accounting.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from omni_core.workers.accounting import ProcessMemory, PynvmlApi

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 1 << 30
NEIGHBOUR = """
import sys, torch
held = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.read()
"""


class WithoutPid:
    """Real NVML, less one pid's entry: the rank as NVML sees it from outside its namespace
    when the driver lists no pid for it at all."""

    def __init__(self, pid: int) -> None:
        self.real, self.pid = PynvmlApi(), pid

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    def process_bytes(self, handle: Any) -> dict[int, int]:
        return {p: n for p, n in self.real.process_bytes(handle).items() if p != self.pid}


@pytest.fixture(scope="module")
def neighbour():
    proc = subprocess.Popen([sys.executable, "-c", NEIGHBOUR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    yield proc
    proc.kill()
    proc.wait()


def test_hidden_pid_figures_are_this_process_and_not_the_device(neighbour) -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the context exists, as in a rank before its load
    true = ProcessMemory("cuda:0")
    renamed = ProcessMemory("cuda:0", pid=1)  # NVML lists us as another pid
    hidden = ProcessMemory("cuda:0", pid=1, nvml=WithoutPid(os.getpid()))
    weights = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
    truth = true.measure()
    assert truth.source == "nvml" and truth.process_bytes is not None
    free, total = torch.cuda.mem_get_info()
    device_wide = total - free
    assert device_wide >= truth.process_bytes + 3 * GiB  # the neighbour is there

    found = renamed.measure()
    print(f"true {truth.process_bytes}, renamed {found}, device-wide {device_wide}")
    assert found.process_bytes == truth.process_bytes and renamed.own_entry == os.getpid()

    tallied = hidden.measure()
    print(f"hidden {tallied}")
    assert tallied.source.startswith("own-tally") and tallied.process_bytes is not None
    # Within 256 MiB of the truth (the context is an estimate until an entry is found) and
    # nowhere near the device-wide figure with the neighbour's 3 GiB in it.
    assert abs(tallied.process_bytes - truth.process_bytes) <= 256 << 20
    del weights
