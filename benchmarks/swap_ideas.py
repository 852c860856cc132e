"""Ideas for the swap at the duplex limit and for the clean sleep, each measured on one GPU.

`python -m benchmarks.swap_ideas --out DIR [--gib 16] [--reps 3]`, through the CUDA driver's
calls made directly (cuda_driver.py), 16 GiB in 512 allocations of 32 MiB, each in a virtual
range of its own (as vLLM's CuMemAllocator reserves them).

**Unmap** (the clean sleep: nothing to copy, only unmapping; and the map a wake pays):

- `serial`        cuMemUnmap + cuMemRelease per allocation (what `fast` does today)
- `release_early` the physical handle released right after its map (the mapping keeps the
                  memory): a sleep is cuMemUnmap alone
- `threads4`      unmap + release spread over 4 threads
- `big_range`     32 physical handles of 512 MiB, each mapped once into one contiguous range
- `span_map`      32 handles of 512 MiB, each mapped over 16 neighbouring ranges reserved one
                  by one (vLLM's layout, mapped with fewer physical allocations)
- `one_call`      512 handles mapped side by side in one range, unmapped with one cuMemUnmap

**Swap** (process A sleeps 16 GiB: device->host copies, each allocation unmapped once its copy
landed; process B wakes 16 GiB at the same instant: maps and host->device copies). B's ways:

- `base`       create + map + set access per 32 MiB allocation, copy right after (`fast`)
- `big_range`  one cuMemCreate + cuMemMap per 512 MiB into one contiguous range (a 512 MiB
               handle mapped piecewise into vLLM's 32 MiB ranges is refused: cuMemMap takes
               offset 0 only, CUDA_ERROR_NOT_SUPPORTED on an H100 with driver 580)
- `access_span` per 32 MiB allocation cuMemCreate + cuMemMap, but one cuMemSetAccess per run
               of neighbouring ranges (up to 512 MiB): the access call is the slow one
- `span_map`   one 512 MiB physical allocation mapped over 16 neighbouring 32 MiB ranges
- `span_both`  the same, and A's memory laid out so too (A unmaps 32 spans, not 512 ranges)
- `premapped`  B maps everything before the swap starts (when it fits): copies alone
- `premapped_late` the same, and A unmaps only once all its copies have landed: do A's
               unmaps slow B's copies?
- `handoff`    A's allocations are exportable; their file descriptors go to B before the
               swap (SCM_RIGHTS over a Unix socket), B imports them, and maps each one as soon
               as A says its copy has landed (a shared counter): no new physical memory
- `a_alone`, `b_alone` each side with the other idle

The time of each cuMemCreate / cuMemMap / cuMemSetAccess / import in B is summed, so the slow
call is named. Every wake is checked against its host copy (the start and end of every
allocation). Writes swap_ideas.json and swap_ideas.md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
ALLOC_BYTES = 32 * MiB
BIG_BYTES = 512 * MiB
STREAMS = 2
SAMPLE_BYTES = 4096
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
FDS_PER_MESSAGE = 200  # SCM_RIGHTS carries at most 253
LEAD_S = 0.3
UNMAP_VARIANTS = ("serial", "release_early", "threads4", "big_range", "span_map", "one_call")
SWAP_VARIANTS = (
    "a_alone",
    "b_alone",
    "base",
    "access_span",
    "big_range",
    "span_map",
    "span_both",
    "premapped",
    "premapped_late",
    "handoff",
)


class Gpu:
    """One process's device, driver, streams and host arena of `total` bytes."""

    def __init__(self, total: int, seed: int) -> None:
        import torch

        from omni_core.workers.backends import cuda_driver as cd
        from omni_core.workers.backends.cuda_ops import CudaOps
        from omni_core.workers.backends.host_arena import HostArena

        self.torch, self.cd = torch, cd
        self.device = torch.device("cuda", 0)
        torch.cuda.set_device(self.device)
        self.ops = CudaOps(self.device, STREAMS)
        self.drv = cd.CudaDriver()
        cu = self.drv.cu
        cu.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64]
        cu.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_int]
        self.total, self.count = total, total // ALLOC_BYTES
        self.host = HostArena(total, self.ops)
        base = torch.arange(ALLOC_BYTES // 8, dtype=torch.int64) * 7 + seed
        for i in range(self.count):
            self.host.view(i * ALLOC_BYTES, ALLOC_BYTES).view(torch.int64).copy_(base + i)
        self.ranges = [self.drv.reserve(ALLOC_BYTES) for _ in range(self.count)]
        self.big = self.drv.reserve(total)
        self.mapped: list[tuple[int, int]] = []  # (ptr, nbytes) to unmap
        self.handles: list[int] = []  # physical handles to release
        self.calls: dict[str, float] = {}
        prop, access = self.drv._prop(0)
        self.access = access
        self.export_prop = cd._AllocProp(type=prop.type, requestedHandleTypes=POSIX_FD, location=prop.location)

    def call(self, what: str, fn: Any, *args: Any) -> None:
        t = time.perf_counter()
        self.drv.check(fn(*args), what)
        self.calls[what] = self.calls.get(what, 0.0) + time.perf_counter() - t

    def create(self, nbytes: int, exportable: bool = False) -> int:
        cell = ctypes.c_uint64()
        prop = self.export_prop if exportable else self.drv._prop(0)[0]
        self.call("create", self.drv.cu.cuMemCreate, ctypes.byref(cell), nbytes, ctypes.byref(prop), 0)
        return cell.value

    def map(self, ptr: int, nbytes: int, handle: int, offset: int = 0) -> None:
        self.call("map", self.drv.cu.cuMemMap, ptr, nbytes, offset, handle, 0)
        self.call("access", self.drv.cu.cuMemSetAccess, ptr, nbytes, ctypes.byref(self.access), 1)
        self.mapped.append((ptr, nbytes))

    def copy(self, ptr: int, host: int, nbytes: int, k: int, to_device: bool) -> None:
        stream = self.ops.streams[k % STREAMS]
        if to_device:
            self.ops.copy(ptr, host, nbytes, True, stream)
        else:
            self.ops.copy(host, ptr, nbytes, False, stream)

    def unmap_all(self) -> None:
        self.torch.cuda.synchronize(self.device)
        for ptr, nbytes in self.mapped:
            self.drv.check(self.drv.cu.cuMemUnmap(ptr, nbytes), "cuMemUnmap")
        for h in self.handles:
            self.drv.check(self.drv.cu.cuMemRelease(h), "cuMemRelease")
        self.mapped.clear()
        self.handles.clear()

    def drop(self) -> None:
        """After a failed variant: unmap and release what is left, whatever fails."""
        self.torch.cuda.synchronize(self.device)
        for ptr, nbytes in self.mapped:
            self.drv.cu.cuMemUnmap(ptr, nbytes)
        for h in self.handles:
            self.drv.cu.cuMemRelease(h)
        self.mapped.clear()
        self.handles.clear()

    def map_small(self, exportable: bool = False) -> None:
        for ptr in self.ranges:
            h = self.create(ALLOC_BYTES, exportable)
            self.handles.append(h)
            self.map(ptr, ALLOC_BYTES, h)

    def map_spans(self) -> None:
        """One 512 MiB physical allocation mapped over each 16 neighbouring 32 MiB ranges, each
        range reserved on its own (as vLLM reserves them)."""
        per = BIG_BYTES // ALLOC_BYTES
        for j in range(0, self.count, per):
            h = self.create(BIG_BYTES)
            self.handles.append(h)
            self.map(self.ranges[j], BIG_BYTES, h)

    def fill(self) -> None:
        for i, ptr in enumerate(self.ranges):
            self.copy(ptr, self.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, True)
        self.torch.cuda.synchronize(self.device)

    def verify(self, ptrs: list[int]) -> None:
        torch = self.torch
        scratch = torch.empty(SAMPLE_BYTES, dtype=torch.uint8, pin_memory=True)
        for i, ptr in enumerate(ptrs):
            for off in (0, ALLOC_BYTES - SAMPLE_BYTES):
                self.copy(ptr + off, scratch.data_ptr(), SAMPLE_BYTES, 0, False)
                torch.cuda.synchronize(self.device)
                if not torch.equal(scratch, self.host.view(i * ALLOC_BYTES + off, SAMPLE_BYTES)):
                    raise AssertionError(f"allocation {i} differs from its host copy at offset {off}")

    def big_ptrs(self) -> list[int]:
        return [self.big + i * ALLOC_BYTES for i in range(self.count)]


# ---------------------------------------------------------------------- unmap (one process)


def unmap_variant(g: Gpu, name: str) -> dict[str, Any]:
    cu = g.drv.cu
    g.calls = {}
    t0 = time.perf_counter()
    if name == "span_map":
        g.map_spans()
    elif name in ("serial", "release_early", "threads4"):
        g.map_small()
        if name == "release_early":
            for h in g.handles:
                g.drv.check(cu.cuMemRelease(h), "cuMemRelease")
            g.handles.clear()
    elif name == "big_range":
        for off in range(0, g.total, BIG_BYTES):
            h = g.create(BIG_BYTES)
            g.handles.append(h)
            g.map(g.big + off, BIG_BYTES, h)
    elif name == "one_call":
        for i in range(g.count):
            h = g.create(ALLOC_BYTES)
            g.handles.append(h)
            g.call("map", cu.cuMemMap, g.big + i * ALLOC_BYTES, ALLOC_BYTES, 0, h, 0)
        g.call("access", cu.cuMemSetAccess, g.big, g.total, ctypes.byref(g.access), 1)
    g.torch.cuda.synchronize(g.device)
    map_s = time.perf_counter() - t0
    mapped, handles = list(g.mapped), list(g.handles)
    g.mapped.clear()
    g.handles.clear()
    t1 = time.perf_counter()
    if name == "threads4":

        def work(part: int) -> None:
            g.drv.ensure_context(0)
            for (ptr, n), h in list(zip(mapped, handles, strict=True))[part::4]:
                g.drv.check(cu.cuMemUnmap(ptr, n), "cuMemUnmap")
                g.drv.check(cu.cuMemRelease(h), "cuMemRelease")

        threads = [threading.Thread(target=work, args=(p,)) for p in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elif name == "one_call":
        rc = cu.cuMemUnmap(g.big, g.total)
        if rc != 0:  # one call may not span several mappings: undo them one by one, then report
            for i in range(g.count):
                cu.cuMemUnmap(g.big + i * ALLOC_BYTES, ALLOC_BYTES)
            for h in handles:
                cu.cuMemRelease(h)
            g.drv.check(rc, "cuMemUnmap of 512 mappings in one call")
        for h in handles:
            g.drv.check(cu.cuMemRelease(h), "cuMemRelease")
    else:
        for ptr, n in mapped:
            g.drv.check(cu.cuMemUnmap(ptr, n), "cuMemUnmap")
        t_rel = time.perf_counter()
        for h in handles:
            g.drv.check(cu.cuMemRelease(h), "cuMemRelease")
        g.calls["release_s"] = time.perf_counter() - t_rel
    unmap_s = time.perf_counter() - t1
    free, _ = g.torch.cuda.mem_get_info(g.device)
    return {"variant": name, "map_s": map_s, "unmap_s": unmap_s, "free_after": free, **g.calls}


# ---------------------------------------------------------------------- swap (two processes)


def _spin_until(at: float) -> None:
    while time.monotonic() < at:
        pass


def _send_fds(sock: socket.socket, fds: list[int]) -> None:
    for i in range(0, len(fds), FDS_PER_MESSAGE):
        part = fds[i : i + FDS_PER_MESSAGE]
        socket.send_fds(sock, [len(part).to_bytes(4, "little")], part)


def _recv_fds(sock: socket.socket, count: int) -> list[int]:
    fds: list[int] = []
    while len(fds) < count:
        _, got, _, _ = socket.recv_fds(sock, 4, FDS_PER_MESSAGE)
        fds.extend(got)
    return fds


def outgoing(conn: Any, total: int, counter: Any, sock_path: str) -> None:
    """Process A: holds `total` bytes mapped; each round sleeps them (copy out, unmap each)."""
    g = Gpu(total, seed=1_000)
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(sock_path)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            break
        variant = msg
        try:
            exportable = variant == "handoff"
            per = BIG_BYTES // ALLOC_BYTES if variant == "span_both" else 1
            if per > 1:
                g.map_spans()
            else:
                g.map_small(exportable)
            g.fill()
            if exportable:
                fds = []
                for h in g.handles:
                    fd = ctypes.c_int()
                    g.drv.check(g.drv.cu.cuMemExportToShareableHandle(ctypes.byref(fd), h, POSIX_FD, 0), "export")
                    fds.append(fd.value)
                _send_fds(sock, fds)
                for fd in fds:
                    os.close(fd)
            counter.value = 0
            conn.send("armed")
            at = conn.recv()  # the start instant, once B has imported what it needs
            if variant == "b_alone":
                conn.send({"start": at, "end": at})
                g.unmap_all()
                continue
            _spin_until(at)
            start = time.monotonic()
            events = []
            for i, ptr in enumerate(g.ranges):
                g.copy(ptr, g.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, False)
                events.append(g.ops.record(g.ops.streams[i % STREAMS]))
            if variant.endswith("_late"):  # every copy lands before the first unmap
                events[-1].synchronize()
                events[-2].synchronize()
            for i in range(g.count):
                events[i].synchronize()
                counter.value = i + 1  # B may now write this allocation's memory
                if (i + 1) % per == 0:
                    g.drv.check(g.drv.cu.cuMemUnmap(g.ranges[i + 1 - per], per * ALLOC_BYTES), "cuMemUnmap")
                    g.drv.check(g.drv.cu.cuMemRelease(g.handles[i // per]), "cuMemRelease")
            end = time.monotonic()
            g.mapped.clear()
            g.handles.clear()
            conn.send({"start": start, "end": end})
        except Exception as exc:
            g.drop()
            conn.send({"error": f"{type(exc).__name__}: {exc}"[:400]})


def contiguous_runs(ptrs: list[int]) -> list[tuple[int, int]]:
    """(start, bytes) of each run of allocations that follow each other in the address space."""
    runs: list[list[int]] = []
    for ptr in ptrs:
        if runs and runs[-1][0] + runs[-1][1] == ptr:
            runs[-1][1] += ALLOC_BYTES
        else:
            runs.append([ptr, ALLOC_BYTES])
    return [(a, n) for a, n in runs]


def incoming(g: Gpu, variant: str, at: float, counter: Any, imported: list[int]) -> dict[str, Any]:
    """Process B's wake by `variant`, started at `at`; returns its times and call sums."""
    g.calls = {}
    ptrs = g.ranges
    premap_s = 0.0
    if variant.startswith("premapped"):
        t = time.perf_counter()
        g.map_small()
        premap_s = time.perf_counter() - t
    _spin_until(at)
    start = time.monotonic()
    if variant in ("base", "b_alone"):
        for i, ptr in enumerate(ptrs):
            h = g.create(ALLOC_BYTES)
            g.handles.append(h)
            g.map(ptr, ALLOC_BYTES, h)
            g.copy(ptr, g.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, True)
    elif variant.startswith("premapped"):
        for i, ptr in enumerate(ptrs):
            g.copy(ptr, g.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, True)
    elif variant == "big_range":
        ptrs = g.big_ptrs()
        k = 0
        for off in range(0, g.total, BIG_BYTES):
            h = g.create(BIG_BYTES)
            g.handles.append(h)
            g.map(g.big + off, BIG_BYTES, h)
            for s in range(0, BIG_BYTES, 2 * ALLOC_BYTES):
                g.copy(g.big + off + s, g.host.ptr + off + s, 2 * ALLOC_BYTES, k, True)
                k += 1
    elif variant in ("span_map", "span_both"):
        per = BIG_BYTES // ALLOC_BYTES
        for j in range(0, g.count, per):
            h = g.create(BIG_BYTES)
            g.handles.append(h)
            g.map(ptrs[j], BIG_BYTES, h)
            for i in range(j, j + per):
                g.copy(ptrs[i], g.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, True)
    elif variant == "access_span":
        per = BIG_BYTES // ALLOC_BYTES
        for j in range(0, g.count, per):
            group = range(j, min(j + per, g.count))
            for i in group:
                h = g.create(ALLOC_BYTES)
                g.handles.append(h)
                g.call("map", g.drv.cu.cuMemMap, ptrs[i], ALLOC_BYTES, 0, h, 0)
                g.mapped.append((ptrs[i], ALLOC_BYTES))
            for first, nbytes in contiguous_runs([ptrs[i] for i in group]):
                g.call("access", g.drv.cu.cuMemSetAccess, first, nbytes, ctypes.byref(g.access), 1)
            for i in group:
                g.copy(ptrs[i], g.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, True)
    elif variant == "handoff":
        for i, ptr in enumerate(ptrs):
            while counter.value <= i:
                pass
            g.handles.append(imported[i])
            g.map(ptr, ALLOC_BYTES, imported[i])
            g.copy(ptr, g.host.ptr + i * ALLOC_BYTES, ALLOC_BYTES, i, True)
    g.torch.cuda.synchronize(g.device)
    end = time.monotonic()
    g.verify(ptrs)
    g.unmap_all()
    return {"start": start, "end": end, "premap_s": premap_s, **{f"{k}_s": v for k, v in g.calls.items()}}


def swap_variant(g: Gpu, a: Any, sock: socket.socket, counter: Any, variant: str) -> dict[str, Any]:
    a.send(variant)  # A maps and fills (and exports), then says armed
    reply = a.recv()
    if reply != "armed":
        raise RuntimeError(f"A: {reply}")
    imported: list[int] = []
    import_s = 0.0
    if variant == "handoff":
        fds = _recv_fds(sock, g.count)
        for fd in fds:
            cell = ctypes.c_uint64()
            t = time.perf_counter()
            g.drv.check(g.drv.cu.cuMemImportFromShareableHandle(ctypes.byref(cell), fd, POSIX_FD), "import")
            import_s += time.perf_counter() - t
            imported.append(cell.value)
            os.close(fd)
    raise_after = None
    at = time.monotonic() + LEAD_S
    a.send(at)
    if variant == "a_alone":
        b = {"start": at, "end": at}
    else:
        try:
            b = incoming(g, variant, at, counter, imported)
        except Exception as exc:
            raise_after = exc
            b = {}
    a_times = a.recv()
    if raise_after is not None:
        raise raise_after
    if "error" in a_times:
        raise RuntimeError(f"A: {a_times['error']}")
    total = max(a_times["end"], b["end"]) - min(a_times["start"], b["start"])
    return {
        "variant": variant,
        "swap_s": total,
        "a_s": a_times["end"] - a_times["start"],
        "b_s": b["end"] - b["start"],
        "import_s": import_s,
        **{k: v for k, v in b.items() if k not in ("start", "end")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="swap-ideas")
    p.add_argument("--gib", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--unmap", default=",".join(UNMAP_VARIANTS))
    p.add_argument("--swap", default=",".join(SWAP_VARIANTS))
    args = p.parse_args(argv)
    import torch

    from omni_core.provenance import git_commit

    if not torch.cuda.is_available():
        print("swap_ideas: no CUDA device; this probe measures a GPU's driver and host link", file=sys.stderr)
        return 2
    total = args.gib * GiB
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def record(row: dict[str, Any]) -> None:
        rows.append(row)
        print("swap_ideas " + json.dumps(row), flush=True)
        (out / "swap_ideas.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    meta = {
        "machine": f"{platform.node()} {torch.cuda.get_device_name()}",
        "torch": torch.__version__,
        "commit": os.environ.get("OMNI_COMMIT") or git_commit(short=True),
        "command": " ".join(["python -m benchmarks.swap_ideas", *(argv if argv is not None else sys.argv[1:])]),
        "bytes": total,
        "alloc_bytes": ALLOC_BYTES,
    }
    g = Gpu(total, seed=2_000_000)
    meta["range_runs"] = len(contiguous_runs(g.ranges))  # separately reserved ranges that touch

    def each(part: str, names: str, run: Any) -> None:
        for name in [v for v in names.split(",") if v]:
            for rep in range(args.reps):
                try:
                    row = run(name)
                except Exception as exc:  # a variant that cannot run here is a finding
                    g.drop()
                    row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:400]}
                record({"part": part, "rep": rep, **row})
                if "error" in row:
                    break

    each("unmap", args.unmap, lambda name: unmap_variant(g, name))
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0, lock=False)
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "fds.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(path)
        listener.listen(1)
        mine, theirs = ctx.Pipe()
        proc = ctx.Process(target=outgoing, args=(theirs, total, counter, path), daemon=True)
        proc.start()
        sock, _ = listener.accept()
        if mine.recv() != "ready":
            raise RuntimeError("process A did not start")
        try:
            each("swap", args.swap, lambda name: swap_variant(g, mine, sock, counter, name))
        finally:
            mine.send(None)
            proc.join(60)
    (out / "swap_ideas.md").write_text(render(meta, rows))
    print(render(meta, rows))
    return 0


def _unmap_cells(r: dict[str, Any], gb: float) -> list[str]:
    sums = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r.items() if k in ("create", "map", "access", "release_s"))
    return [f"{r['map_s'] * 1e3:.1f}", f"{r['unmap_s'] * 1e3:.1f}", sums]


def _swap_cells(r: dict[str, Any], gb: float) -> list[str]:
    moved = 2 * gb if r["variant"] not in ("a_alone", "b_alone") else gb
    sums = ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in r.items() if k in ("create_s", "map_s", "access_s"))
    sums += f", import (before) {r['import_s'] * 1e3:.1f}" if r.get("import_s") else ""
    return [
        f"{r['swap_s']:.3f}",
        f"{moved / r['swap_s']:.1f}",
        f"{r['a_s']:.3f}",
        f"{r['b_s']:.3f}",
        f"{r.get('premap_s', 0) * 1e3:.1f}",
        sums,
    ]


TABLES = (
    ("unmap", "| unmap variant | rep | map (wake) ms | unmap (sleep) ms | call sums ms |", _unmap_cells),
    ("swap", "| swap variant | rep | swap s | both GB/s | A s | B s | B premap ms | B's calls ms |", _swap_cells),
)


def render(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    gb = meta["bytes"] / 1e9
    lines = [
        f"# Swap and clean-sleep ideas: {meta['bytes'] / GiB:.0f} GiB in {meta['bytes'] // meta['alloc_bytes']} "
        "allocations",
        "",
        f"{meta['machine']}, torch {meta['torch']}, commit {meta['commit']}, `{meta['command']}`; the "
        f"{meta['bytes'] // meta['alloc_bytes']} ranges, reserved one by one, form {meta.get('range_runs')} runs",
    ]
    for part, header, cells in TABLES:
        width = header.count("|") - 1
        lines += ["", header, "|---" * width + "|"]
        for r in (r for r in rows if r["part"] == part):
            rest = [f"error: {r['error']}"] + [""] * (width - 3) if "error" in r else cells(r, gb)
            lines.append("| " + " | ".join([r["variant"], str(r["rep"]), *rest]) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
