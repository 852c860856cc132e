"""The fast backend with runs (runs.py) on a real GPU: touching allocations woken into one
physical allocation each, bit-exact over dirty and clean sleeps, memory given back.

A child process (which leaves with os._exit: vLLM's pools can abort at interpreter exit)
allocates 2 GiB of bfloat16 weights in 64 tensors of 32 MiB and a KV pool, keeps a reference
copy on the device outside the pools, then sleeps and wakes with run_bytes=512 MiB (every
other sleep releasing after its last copy, as a swap's outgoing stage with room beside it).

    source .device/setup.sh && python3 -m pytest -s -m gpu tests/workers/test_gpu_runs.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

GiB, MiB = 1 << 30, 1 << 20


def probe(cycles: int) -> dict:
    from omni_core.workers.backends.fast import FastBackend

    device = torch.device("cuda", 0)
    backend = FastBackend(device, run_bytes=512 * MiB)
    g = torch.Generator(device=device).manual_seed(0)
    with backend.pool("weights"):
        tensors = [torch.randn(4096, 4096, dtype=torch.bfloat16, device=device, generator=g) for _ in range(64)]
    with backend.pool("kv_cache"):
        kv = torch.empty(GiB, dtype=torch.uint8, device=device)  # held: a freed block is not slept
    reference = [t.clone() for t in tensors]  # outside the pools: never slept
    backend.track("weights", tensors)
    backend.track("kv_cache", [])
    torch.cuda.synchronize(device)
    out: dict = {"cycles": []}
    for cycle in range(cycles):
        if cycle == cycles // 2:
            backend.declare_read_only({"weights"})  # the later sleeps copy nothing
            backend.path.prepare(("weights",))
        free_awake, _ = torch.cuda.mem_get_info(device)
        # every other sleep keeps its memory until its last copy (a swap with room beside it)
        backend.sleep({"weights"}, {"kv_cache"}, release_late=cycle % 2 == 1)
        free_asleep, _ = torch.cuda.mem_get_info(device)
        sleep_stats = dict(backend.path.stats.last)
        backend.wake({"weights", "kv_cache"})
        torch.cuda.synchronize(device)
        out["cycles"].append(
            {
                "cycle": cycle,
                "exact": all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True)),
                "freed_bytes": free_asleep - free_awake,
                "sleep_s": sleep_stats["total_s"],
                "copied_bytes": sleep_stats["offloaded_bytes"],
                "release_late": sleep_stats["release_late"],
                "wake_map_s": backend.path.stats.last["map_s"],
                "mapped_runs": backend.stats()["mapped_runs"],
            }
        )
    del kv
    return out


def _problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from omni_core.workers.backends import cumem_unavailable_reason

    return cumem_unavailable_reason(torch.device("cuda", 0))


_PROBLEM = _problem()


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_runs_wake_bit_exact_and_give_the_memory_back():
    code = (
        "import json, os, sys; from tests.workers.test_gpu_runs import probe; "
        "print('PROBE', json.dumps(probe(6))); sys.stdout.flush(); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    cycles = json.loads(lines[-1].removeprefix("PROBE "))["cycles"]
    for c in cycles:
        print(c)
    assert all(c["exact"] for c in cycles)
    # 2 GiB of weights + 1 GiB of KV back to the device at every sleep, runs or not
    assert all(c["freed_bytes"] >= 3 * GiB - 64 * MiB for c in cycles)
    # the first half copies at every sleep, the second (declared clean) never
    assert [c["copied_bytes"] > 0 for c in cycles] == [k < len(cycles) // 2 for k in range(len(cycles))]
    # released late where asked and there were copies to wait for (a clean sleep has none)
    assert [c["release_late"] for c in cycles] == [k % 2 == 1 and k < len(cycles) // 2 for k in range(len(cycles))]
    # 64 touching 32 MiB weights: 4 runs of 512 MiB made at load, 4 more per wake (the KV,
    # alone, on its own handle)
    assert [c["mapped_runs"] for c in cycles] == [4 * (k + 2) for k in range(len(cycles))]
