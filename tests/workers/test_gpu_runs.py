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


def probe_frees() -> dict:
    """vLLM frees run members itself (as its C extension does when torch gives a segment back:
    the free callback's handle unmapped and released, the range and the handle's cell freed):
    one member of a run, then every member of another. The rest stay exact through sleeps and
    wakes, and the run whose members all went gives its memory back."""
    import vllm.cumem_allocator as extension

    from omni_core.workers.backends.cuda_driver import CudaDriver
    from omni_core.workers.backends.fast import FastBackend
    from omni_core.workers.backends.runs import _libc

    device = torch.device("cuda", 0)
    backend = FastBackend(device)  # runs by default
    g = torch.Generator(device=device).manual_seed(1)
    with backend.pool("weights"):
        tensors = [torch.randn(4096, 4096, dtype=torch.bfloat16, device=device, generator=g) for _ in range(32)]
    with backend.pool("kv_cache"):
        kv = torch.empty(256 * MiB, dtype=torch.uint8, device=device)
    reference = [t.clone() for t in tensors]
    backend.track("weights", tensors)
    backend.track("kv_cache", [])
    torch.cuda.synchronize(device)
    driver, allocator = CudaDriver(), backend.allocator

    # Played here, not by torch: the tensors stay referenced, so torch never gives their
    # segments back a second time (the process leaves with os._exit).
    played: list[torch.Tensor] = []

    def vllm_frees(tensor: torch.Tensor) -> None:
        played.append(tensor)
        index, size, d_mem, cell = allocator.python_free_callback(tensor.data_ptr())
        extension.python_unmap_and_release(index, size, d_mem, cell)
        driver.free_range(d_mem, size)
        _libc().free(cell)

    def exact() -> bool:
        return all(torch.equal(t, r) for t, r in zip(tensors, reference, strict=True))

    out: dict = {"runs_at_load": backend.stats()["mapped_runs"], "runs": backend.stats()["runs"]}
    vllm_frees(tensors.pop(5))  # one member of the first run; never touched again (os._exit)
    reference.pop(5)
    out["exact_after_one"] = exact()
    backend.sleep({"weights"}, {"kv_cache"})
    backend.wake({"weights", "kv_cache"})
    out["exact_after_sleep_and_wake"] = exact()
    free_before, _ = torch.cuda.mem_get_info(device)
    last = tensors[15:]  # the second run at load; the wake regrouped runs around the gap
    del tensors[15:], reference[15:]
    freed_ptrs = {t.data_ptr() for t in last}
    runs = {id(run): run for run in backend.path.runs._of.values()}.values()
    # A run goes with its last member: the runs all of whose members are freed here, no more.
    out["runs_wholly_freed_bytes"] = sum(run.nbytes for run in runs if run.members <= freed_ptrs)
    for tensor in last:
        vllm_frees(tensor)
    free_after, _ = torch.cuda.mem_get_info(device)
    out["freed_by_last_run_bytes"] = free_after - free_before
    out["exact_after_all"] = exact()
    backend.sleep({"weights"}, {"kv_cache"})
    backend.wake({"weights", "kv_cache"})
    out["exact_at_end"] = exact()
    del kv
    return out


def _problem() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    from omni_core.workers.backends import cumem_unavailable_reason

    return cumem_unavailable_reason(torch.device("cuda", 0))


_PROBLEM = _problem()


def in_child(call: str) -> dict:
    """`call` (a probe of this module) in a child process that leaves with os._exit."""
    code = (
        "import json, os, sys; from tests.workers.test_gpu_runs import probe, probe_frees; "
        f"print('PROBE', json.dumps({call})); sys.stdout.flush(); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("PROBE "))


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_runs_wake_bit_exact_and_give_the_memory_back():
    cycles = in_child("probe(6)")["cycles"]
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


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_vllm_may_free_run_members_itself():
    out = in_child("probe_frees()")
    print(out)
    assert out["runs_at_load"] == 2 and out["runs"] == f"of {512 * MiB} bytes"  # 32 x 32 MiB: two runs
    assert out["exact_after_one"] and out["exact_after_sleep_and_wake"] and out["exact_after_all"]
    assert out["exact_at_end"]
    # The runs whose members all went gave their memory back (and no other run did).
    assert out["runs_wholly_freed_bytes"] >= 256 * MiB
    assert abs(out["freed_by_last_run_bytes"] - out["runs_wholly_freed_bytes"]) <= 64 * MiB
