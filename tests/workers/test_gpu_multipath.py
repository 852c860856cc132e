"""Multi-path sleep and wake on two GPUs joined by NVLink, through the fast backend.

A child process (which leaves with os._exit: vLLM's pools can abort at interpreter exit)
loads 16 GiB of bfloat16 weights in 8B-shaped tensors on cuda:0, keeps a reference copy on
cuda:1, then sleeps and wakes them over each plan: the own link alone, the own link and
cuda:1's link by several shares. Every wake is compared with the reference on the GPU.
The first sleep of the process copies (the weights are declared written by execution).

Run on a 2-GPU lent machine: source .device/setup.sh && python3 -m pytest -s -m gpu
tests/workers/test_gpu_multipath.py; OMNI_MULTIPATH_OUT=FILE writes the figures as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

GiB = 1 << 30
PLANS = {  # name -> [(peer or None, share)]
    "direct": [],
    "1:1": [(None, 1.0), (1, 1.0)],
    "peer 0.9": [(None, 1.0), (1, 0.9)],
    "peer 1.1": [(None, 1.0), (1, 1.1)],
    "3 links": [(None, 1.0), (1, 1.0), (2, 1.0)],  # only where a third GPU is seen
    "4 links": [(None, 1.0), (1, 1.0), (2, 1.0), (3, 1.0)],
}


def _plans() -> dict[str, list]:
    n = torch.cuda.device_count()
    return {name: plan for name, plan in PLANS.items() if all(p is None or p < n for p, _ in plan)}


def _shapes(total_bytes: int) -> list[tuple[int, ...]]:
    """Llama-8B-like layers (bf16): q, k, v, o, gate, up, down, two norms per layer."""
    hidden, inter, kv = 4096, 14336, 1024
    layer = [
        (hidden, hidden),
        (kv, hidden),
        (kv, hidden),
        (hidden, hidden),
        (inter, hidden),
        (inter, hidden),
        (hidden, inter),
        (hidden,),
        (hidden,),
    ]
    shapes, used = [], 0
    while used < total_bytes:
        for shape in layer:
            n = 2 * int(torch.tensor(shape).prod())
            if used + n > total_bytes:
                return shapes
            shapes.append(shape)
            used += n
    return shapes


def probe(weights_bytes: int, cycles: int) -> dict:
    from omni_core.protocol import LinkShare
    from omni_core.workers.backends.fast import FastBackend

    backend = FastBackend(torch.device("cuda", 0))
    backend.declare_read_only(())  # every sleep copies
    g = torch.Generator(device="cuda:0").manual_seed(0)
    with backend.pool("weights"):
        tensors = [torch.randn(s, dtype=torch.bfloat16, device="cuda:0", generator=g) for s in _shapes(weights_bytes)]
    with backend.pool("kv_cache"):
        torch.empty(GiB, dtype=torch.uint8, device="cuda:0")
    backend.track("weights", tensors)
    backend.track("kv_cache", [])
    moved = sum(t.numel() * 2 for t in tensors)
    reference = [t.to("cuda:1") for t in tensors]
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    out: dict = {"bytes": moved, "tensors": len(tensors), "runs": []}
    for cycle in range(cycles):
        for name, plan in _plans().items():
            links = tuple(LinkShare(peer, share) for peer, share in plan)
            started = time.perf_counter()
            backend.sleep({"weights"}, {"kv_cache"}, links=links)
            sleep_s = time.perf_counter() - started
            sleep_lanes = dict(backend.path.stats.last.get("bytes_by_lane", {}))
            started = time.perf_counter()
            backend.wake({"weights", "kv_cache"}, links=links)
            torch.cuda.synchronize(0)
            wake_s = time.perf_counter() - started
            exact = all(torch.equal(t.to("cuda:1"), r) for t, r in zip(tensors, reference, strict=True))
            wake_stats = dict(backend.path.stats.last)
            out["runs"].append(
                {
                    "cycle": cycle,
                    "plan": name,
                    "sleep_gbps": moved / sleep_s / 1e9,
                    "wake_gbps": moved / wake_s / 1e9,
                    "exact": exact,
                    "sleep_lanes": sleep_lanes,
                    "wake_lanes": wake_stats.get("bytes_by_lane", {}),
                    "wake_map_s": wake_stats["map_s"],
                    "wake_s": wake_s,
                    "relay_failed": wake_stats.get("relay_failed", ""),
                }
            )
    return out


def _two_gpus_with_p2p() -> str | None:
    if torch.cuda.device_count() < 2:
        return f"needs two GPUs, sees {torch.cuda.device_count()}"
    if not torch.cuda.can_device_access_peer(0, 1):
        return "cuda:0 cannot access cuda:1 peer to peer"
    from omni_core.workers.backends import cumem_unavailable_reason

    return cumem_unavailable_reason(torch.device("cuda", 0))


_PROBLEM = _two_gpus_with_p2p() if torch.cuda.is_available() else "no CUDA device"


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_sleep_and_wake_over_two_links_are_bit_exact_and_faster_than_one():
    gib = float(os.environ.get("OMNI_MULTIPATH_GIB", "16"))
    code = (
        "import json, os, sys; from tests.workers.test_gpu_multipath import probe; "
        f"print('PROBE', json.dumps(probe({int(gib * GiB)}, 3))); sys.stdout.flush(); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(lines[-1].removeprefix("PROBE "))
    if os.environ.get("OMNI_MULTIPATH_OUT"):
        with open(os.environ["OMNI_MULTIPATH_OUT"], "w") as f:
            json.dump(figures, f, indent=1)
    for run in figures["runs"]:
        print(
            f"cycle {run['cycle']} {run['plan']:>9}: sleep {run['sleep_gbps']:6.1f} GB/s, wake "
            f"{run['wake_gbps']:6.1f} GB/s (maps {run['wake_map_s'] * 1e3:.0f} of {run['wake_s'] * 1e3:.0f} ms), "
            f"exact {run['exact']} {run['relay_failed']}"
        )
    assert all(run["exact"] and not run["relay_failed"] for run in figures["runs"])
    best = {p: max(r["wake_gbps"] for r in figures["runs"] if r["plan"] == p) for p in _plans()}
    assert best["1:1"] > 1.3 * best["direct"], best


def host_side(gib: float) -> dict:
    """k GPUs copying at once, each over its own link only (pinned host buffers, no relay):
    whether the host side (memory, root complex) caps what k links carry together."""
    import threading

    n = torch.cuda.device_count()
    nbytes = int(gib * GiB)
    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
    devices = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}") for i in range(n)]
    out = {}
    for k in range(1, n + 1):
        for direction in ("h2d", "d2h"):
            barrier = threading.Barrier(k)

            def copy(i: int, direction=direction, barrier=barrier) -> None:
                stream = torch.cuda.Stream(device=f"cuda:{i}")
                barrier.wait()
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        (
                            devices[i].copy_(hosts[i], non_blocking=True)
                            if direction == "h2d"
                            else hosts[i].copy_(devices[i], non_blocking=True)
                        )
                stream.synchronize()

            threads = [threading.Thread(target=copy, args=(i,)) for i in range(k)]
            started = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            out[f"{direction} x{k}"] = 2 * k * nbytes / (time.perf_counter() - started) / 1e9
    return out


@pytest.mark.gpu
@pytest.mark.skipif(_PROBLEM is not None, reason=f"{_PROBLEM}")
def test_what_k_links_carry_together_without_relays():
    code = (
        "import json, os, sys; from tests.workers.test_gpu_multipath import host_side; "
        "print('PROBE', json.dumps(host_side(4))); sys.stdout.flush(); os._exit(0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    figures = json.loads(lines[-1].removeprefix("PROBE "))
    if os.environ.get("OMNI_MULTIPATH_OUT"):
        with open(os.environ["OMNI_MULTIPATH_OUT"] + ".host.json", "w") as f:
            json.dump(figures, f, indent=1)
    for name, gbps in figures.items():
        print(f"{name}: {gbps:.1f} GB/s")
    assert figures["h2d x1"] > 20
