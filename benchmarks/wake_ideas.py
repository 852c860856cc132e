"""Ideas for a level-1 wake at the host link's limit (issue 14, item 3), each measured.

The earlier probe (`wake_probe`, bench/results/memory.md) found that copies into memory mapped
just before run at 49.7 GB/s against 55.4 into memory mapped long ago, and that a memset
before each copy does not help.

`fast` wakes 16 GiB of realistic weights (512 x 32 MiB) at 43-45 GB/s on an H100/H200 whose
link carries 53-55 GB/s one way. A wake is two kinds of work: making memory (cuMemCreate +
cuMemMap + cuMemSetAccess per allocation, through vLLM's extension in `fast`) and copying
into it. This probe separates them and tries the ideas of the issue, each on the same bytes,
with the CUDA driver API called directly (ctypes on libcuda; no vLLM needed):

- `copy_only`       copies into memory mapped long ago: the link's ceiling for a wake
- `map_then_copy`   map every allocation first (timed), then copy (timed): is a fresh
                    mapping slower to copy into, and what does mapping cost alone?
- `pipelined`       what `fast` does: map allocation i+1 while i's bytes travel
- `map_thread`      the mapping on a second thread (ctypes drops the GIL), ahead of the copies
- `big_handles`     fewer, larger physical handles (512 MiB each, 16 tensors) in the same
                    virtual ranges: 32 maps instead of 512
- `sm_copy`         copies done by a kernel reading pinned host memory over UVA (Triton),
                    instead of the copy engines
- `separate_va`     pipelined, but each allocation in a virtual range of its own (as vLLM's
                    CuMemAllocator reserves them) instead of one range for all
- `vllm_ext`        pipelined, mapping through vLLM's `python_create_and_map` (what `fast`
                    calls) into separate ranges: the extension against the driver called directly

Every variant checks the restored bytes against the host copy (a sample of each allocation).

    python -m omni_core.bench.wake_ideas --out DIR [--gib 16] [--reps 3]

writes wake_ideas.json and wake_ideas.md (machine, commit, command) under DIR.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
ALLOC_BYTES = 32 * MiB  # the realistic layout of bench/memory.py's "16g": bf16 4096 x 4096
BIG_HANDLE_BYTES = 512 * MiB
CHUNK_BYTES = 64 * MiB  # one copy call moves at most this (fast's default chunk)
STREAMS = 2
SAMPLE_BYTES = 4096  # checked per allocation, at its start and end

class Probe:
    """One device, one host copy of `total_bytes`, one virtual range for the device side."""

    def __init__(self, total_bytes: int) -> None:
        import torch

        from omni_core.workers.backends.cuda_driver import CudaDriver
        from omni_core.workers.backends.fast import CudaOps, HostArena

        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.ops = CudaOps(self.device, STREAMS)
        self.driver = CudaDriver()
        self.total_bytes = total_bytes
        self.count = total_bytes // ALLOC_BYTES
        self.host = HostArena(total_bytes, self.ops)
        pattern = torch.randint(-(2**31), 2**31 - 1, (total_bytes // 8 // self.count,), dtype=torch.int64)
        for i in range(self.count):  # every allocation distinct: a misplaced copy shows
            self.host.view(i * ALLOC_BYTES, ALLOC_BYTES).view(torch.int64).copy_(pattern + i)
        self.base = self.driver.reserve(total_bytes)
        self.handles: list[tuple[int, int, int]] = []  # (ptr, nbytes, handle) mapped now
        # One range per allocation, as vLLM reserves them; their host offsets are the same.
        self.separate = [self.driver.reserve(ALLOC_BYTES) for _ in range(self.count)]
        self.handle_cells = (ctypes.c_uint64 * self.count)()  # vLLM's extension writes handles here
        self.vllm_mapped: list[tuple[int, int]] = []

    # ---------------------------------------------------------------- memory

    def spans(self, handle_bytes: int) -> list[tuple[int, int]]:
        return [(self.base + off, handle_bytes) for off in range(0, self.total_bytes, handle_bytes)]

    def map_span(self, ptr: int, nbytes: int) -> None:
        cell = ctypes.c_uint64()
        self.driver.map_into(self.device.index, nbytes, ptr, cell)
        self.handles.append((ptr, nbytes, cell.value))

    def unmap_all(self) -> None:
        self.torch.cuda.synchronize(self.device)
        for ptr, nbytes, handle in self.handles:
            self.driver.unmap_from(nbytes, ptr, handle)
        self.handles.clear()
        for ptr, i in self.vllm_mapped:
            self.driver.unmap_from(ALLOC_BYTES, ptr, self.handle_cells[i])
        self.vllm_mapped.clear()

    def host_of(self, i: int) -> int:
        return self.host.ptr + i * ALLOC_BYTES

    def copy_to(self, ptr: int, host: int, nbytes: int, k: int) -> None:
        for off in range(0, nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, nbytes - off)
            self.ops.copy(ptr + off, host + off, n, True, self.ops.streams[(k + off // CHUNK_BYTES) % STREAMS])

    # ---------------------------------------------------------------- copies

    def copy_span(self, ptr: int, nbytes: int, k: int) -> None:
        """Host bytes of [ptr, ptr+nbytes) to the device, in chunks over the streams."""
        host = self.host.ptr + (ptr - self.base)
        for off in range(0, nbytes, CHUNK_BYTES):
            n = min(CHUNK_BYTES, nbytes - off)
            self.ops.copy(ptr + off, host + off, n, True, self.ops.streams[k % STREAMS])
            k += 1

    def finish(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def verify(self, separate: bool = False) -> None:
        """A sample at the start and end of every allocation equals the host copy."""
        torch = self.torch
        scratch = torch.empty(SAMPLE_BYTES, dtype=torch.uint8, pin_memory=True)
        for i in range(self.count):
            for off in (0, ALLOC_BYTES - SAMPLE_BYTES):
                at = i * ALLOC_BYTES + off
                src = self.separate[i] + off if separate else self.base + at
                self.ops.copy(scratch.data_ptr(), src, SAMPLE_BYTES, False, self.ops.streams[0])
                self.finish()
                if not torch.equal(scratch, self.host.view(at, SAMPLE_BYTES)):
                    raise AssertionError(f"allocation {i} differs from its host copy at offset {off}")

    def sm_copy(self) -> None:
        """Every byte moved by a kernel reading the pinned host arena over UVA (Triton)."""
        kernel = _triton_copy_kernel()
        torch = self.torch

        class _Ptr:  # Triton takes anything with data_ptr() and dtype
            def __init__(self, ptr: int) -> None:
                self.ptr, self.dtype = ptr, torch.int64

            def data_ptr(self) -> int:
                return self.ptr

        words = self.total_bytes // 8
        block = 4096
        kernel[(triton_cdiv(words, block),)](_Ptr(self.base), _Ptr(self.host.ptr), words, BLOCK=block)

    def close(self) -> None:
        self.unmap_all()
        self.driver.free_range(self.base, self.total_bytes)
        for ptr in self.separate:
            self.driver.free_range(ptr, ALLOC_BYTES)
        self.host.close()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _triton_copy_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(dst, src, words, BLOCK: tl.constexpr):
        # 64-bit offsets: 16 GiB is 2**31 words, past int32
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < words
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

    return copy_kernel


# -------------------------------------------------------------------- the variants


def _timed(fn: Callable[[], None]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_variant(probe: Probe, name: str) -> dict[str, Any]:
    """One wake of every byte by `name`; returns its seconds (and its parts where it has them)."""
    small = probe.spans(ALLOC_BYTES)
    result: dict[str, Any] = {"variant": name}
    if name == "copy_only":  # mapped before the clock starts; warm the mappings once
        for ptr, n in small:
            probe.map_span(ptr, n)
        for k, (ptr, n) in enumerate(small):
            probe.copy_span(ptr, n, k)
        probe.finish()
        result["total_s"] = _timed(lambda: ([probe.copy_span(p, n, k) for k, (p, n) in enumerate(small)],
                                            probe.finish()))  # fmt: skip
    elif name == "map_then_copy":
        result["map_s"] = _timed(lambda: [probe.map_span(p, n) for p, n in small])
        result["copy_s"] = _timed(lambda: ([probe.copy_span(p, n, k) for k, (p, n) in enumerate(small)],
                                           probe.finish()))  # fmt: skip
        result["total_s"] = result["map_s"] + result["copy_s"]
    elif name in ("pipelined", "big_handles"):
        spans = small if name == "pipelined" else probe.spans(BIG_HANDLE_BYTES)

        def pipelined() -> None:
            k = 0
            for ptr, n in spans:
                probe.map_span(ptr, n)
                probe.copy_span(ptr, n, k)
                k += max(1, n // CHUNK_BYTES)
            probe.finish()

        result["total_s"] = _timed(pipelined)
        result["maps"] = len(spans)
    elif name == "map_thread":
        mapped: queue.Queue[tuple[int, int] | None] = queue.Queue()

        def mapper() -> None:
            probe.torch.cuda.set_device(probe.device)  # the primary context, current on this thread too
            for ptr, n in small:
                probe.map_span(ptr, n)
                mapped.put((ptr, n))
            mapped.put(None)

        def threaded() -> None:
            thread = threading.Thread(target=mapper)
            thread.start()
            k = 0
            while (item := mapped.get()) is not None:
                probe.copy_span(*item, k)
                k += 1
            thread.join()
            probe.finish()

        result["total_s"] = _timed(threaded)
    elif name in ("separate_va", "vllm_ext"):
        if name == "vllm_ext":
            from vllm.device_allocator.cumem import python_create_and_map  # what `fast` maps with

        def separate() -> None:
            for i, ptr in enumerate(probe.separate):
                if name == "vllm_ext":
                    python_create_and_map(probe.device.index, ALLOC_BYTES, ptr, ctypes.addressof(probe.handle_cells)
                                          + 8 * i)  # fmt: skip
                    probe.vllm_mapped.append((ptr, i))
                else:
                    probe.map_span(ptr, ALLOC_BYTES)
                probe.copy_to(ptr, probe.host_of(i), ALLOC_BYTES, i)
            probe.finish()

        result["total_s"] = _timed(separate)
        probe.verify(separate=True)
        result["gb_per_s"] = probe.total_bytes / result["total_s"] / 1e9
        probe.unmap_all()
        return result
    elif name == "sm_copy":
        for ptr, n in small:
            probe.map_span(ptr, n)
        probe.sm_copy()  # compile and warm
        probe.finish()
        result["total_s"] = _timed(lambda: (probe.sm_copy(), probe.finish()))
    else:
        raise ValueError(f"unknown variant {name!r}")
    probe.verify()
    result["gb_per_s"] = probe.total_bytes / result["total_s"] / 1e9
    probe.unmap_all()
    return result


VARIANTS = ("copy_only", "map_then_copy", "pipelined", "map_thread", "big_handles", "sm_copy", "separate_va",
            "vllm_ext")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench/results/wake_ideas")
    parser.add_argument("--gib", type=int, default=16, help="bytes to wake, GiB (512 x 32 MiB per 16)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--commit", default=None, help="the commit measured (the device's .git may be stale)")
    args = parser.parse_args(argv)
    import torch

    from omni_core.provenance import git_commit

    if not torch.cuda.is_available():
        print("wake_ideas: no CUDA device; this probe measures a GPU's host link", file=sys.stderr)
        return 2
    probe = Probe(args.gib * GiB)
    rows: list[dict[str, Any]] = []
    try:
        for name in args.variants.split(","):
            for rep in range(args.reps):
                try:
                    row = run_variant(probe, name)
                except Exception as exc:  # a variant that cannot run here is a finding, not the end
                    probe.unmap_all()
                    row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:500]}
                row["rep"] = rep
                rows.append(row)
                print(f"wake_ideas {name} rep {rep}: " + (f"{row['gb_per_s']:.1f} GB/s, {row['total_s']:.3f} s"
                      if "gb_per_s" in row else row["error"]), flush=True)  # fmt: skip
                if "error" in row:
                    break
    finally:
        probe.close()
    commit = args.commit or git_commit(short=True)
    meta = {"machine": f"{platform.node()} {torch.cuda.get_device_name()}", "torch": torch.__version__,
            "commit": commit, "command": " ".join(["python -m omni_core.bench.wake_ideas",
                                                                      *(argv or sys.argv[1:])]),
            "bytes": args.gib * GiB, "alloc_bytes": ALLOC_BYTES, "chunk_bytes": CHUNK_BYTES,
            "streams": STREAMS}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "wake_ideas.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "wake_ideas.md").write_text(render(meta, rows))
    print(render(meta, rows))
    return 0


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = [f"# Wake ideas: {meta['bytes'] / GiB:.0f} GiB in {meta['bytes'] // meta['alloc_bytes']} allocations",
             "", f"{meta['machine']}, torch {meta['torch']}, commit {meta['commit']}, `{meta['command']}`", "",
             "| variant | rep | total s | GB/s | map s | copy s | maps |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['rep']} | error: {r['error']} | | | | |")
            continue
        part = [f"{r[k]:.3f}" if k in r else "" for k in ("map_s", "copy_s")]
        lines.append(f"| {r['variant']} | {r['rep']} | {r['total_s']:.3f} | {r['gb_per_s']:.1f} | {part[0]} | "
                     f"{part[1]} | {r.get('maps', '')} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
