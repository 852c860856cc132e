"""Where a level-1 wake's time goes (a diagnostic behind bench/results/memory.md).

The same 8 GiB (256 allocations of 32 MiB in vLLM's CuMemAllocator) are copied host->device
with the fast path's copy plan, varying one thing at a time: the host source (the
registered arena, or a cudaHostAlloc buffer of the same size, freed at the end) and the device destination
(mapped long ago and written since, or mapped just now by vLLM's extension and never
touched). A single copy into a plain cudaMalloc buffer and the device->host direction
are the references. Prints one JSON object.

    python -m omni_core.bench.wake_probe [weights_gib]
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch

from omni_core.workers.backends.cumem import handle_of
from omni_core.workers.backends.fast import FastBackend, plan_copies

MiB = 1 << 20


def main(weights_gib: float = 8.0) -> dict[str, Any]:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    backend = FastBackend(device, prepare="load")
    count = int(weights_gib * 1024 / 32)
    with backend.pool("weights"):
        weights = [torch.empty(16 * MiB, dtype=torch.bfloat16, device=device) for _ in range(count)]
    for i, w in enumerate(weights):
        w.view(torch.uint8).random_(0, 256, generator=torch.Generator(device=device).manual_seed(i))
    backend.track("weights", weights)
    path, ops = backend.path, backend.path.ops
    allocs = path.allocations(["weights"])
    slots = path._slots
    total = sum(handle_of(d).size for _, d in allocs)
    arena = slots[allocs[0][0]].arena
    started = time.perf_counter()
    pinned_ptr = ops.host_alloc(total)
    out: dict[str, Any] = {"bytes": total, "allocations": len(allocs), "hostalloc_s": time.perf_counter() - started}

    def copy(base: int, to_device: bool) -> float:
        spans = [(p, base + slots[p].offset, handle_of(d).size) for p, d in allocs]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, c in enumerate(plan_copies(spans, path.chunk_bytes)):
            stream = ops.streams[k % len(ops.streams)]
            if to_device:
                ops.copy(c.device, c.host, c.nbytes, True, stream)
            else:
                ops.copy(c.host, c.device, c.nbytes, False, stream)
        torch.cuda.synchronize()
        return total / (time.perf_counter() - t0) / 1e9

    def remap() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _, d in allocs:
            path._unmap(d.handle)
            path._map(d.handle)
        return time.perf_counter() - t0

    out["d2h_arena_GBps"] = copy(arena.ptr, False)
    out["d2h_hostalloc_GBps"] = copy(pinned_ptr, False)
    out["h2d_arena_into_warm_GBps"] = copy(arena.ptr, True)
    out["h2d_hostalloc_into_warm_GBps"] = copy(pinned_ptr, True)
    out["remap_all_s"] = remap()
    out["h2d_arena_into_fresh_GBps"] = copy(arena.ptr, True)
    remap()
    out["h2d_hostalloc_into_fresh_GBps"] = copy(pinned_ptr, True)
    remap()
    for w in weights:
        w.zero_()
    out["h2d_arena_into_fresh_zeroed_GBps"] = copy(arena.ptr, True)
    remap()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for w in weights:
        w.zero_()
    torch.cuda.synchronize()
    out["zero_fresh_s"] = time.perf_counter() - t0
    plain = torch.empty(total, dtype=torch.uint8, device=device)
    plain.zero_()
    for name, base in (("arena", arena.ptr), ("hostalloc", pinned_ptr)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ops.copy(plain.data_ptr(), base, total, True, ops.streams[0])
        torch.cuda.synchronize()
        out[f"h2d_{name}_one_copy_plain_GBps"] = total / (time.perf_counter() - t0) / 1e9
    # the backend's own wake, for reference
    backend.sleep({"weights"}, set())
    t0 = time.perf_counter()
    backend.wake({"weights"})
    out["wake_GBps"] = total / (time.perf_counter() - t0) / 1e9
    out["wake_map_s"] = path.stats.last["map_s"]
    ops.host_free(pinned_ptr)
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


if __name__ == "__main__":
    result = main(float(sys.argv[1]) if len(sys.argv) > 1 else 8.0)
    print(json.dumps(result, indent=1))
    import os

    os._exit(0)
