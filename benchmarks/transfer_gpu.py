"""A stage-to-stage transfer over CUDA IPC on one GPU (P-22) against a raw device copy of the
same bytes. Written for the GPU round, not run yet (no device this round): its results file
will be benchmarks/results/transfer_gpu.md.

The producer (this process) exports a CUDA tensor through `RankTransfers.export` (a
WeightSender's IPC buckets); the consumer (a spawned process, as a rank is) lands it through
`RankTransfers.land` (the typed handle checked, opened by torch's rebuild, copied into its
inbox on the device) and reports the landing's time; the baseline is one device-to-device
`copy_` of the same bytes in the producer, synchronized.

    python -m benchmarks.transfer_gpu --out benchmarks/results/transfer_gpu.md
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.multiprocessing as mp

from benchmarks.transfer_cpu import _Rows
from omni_core.protocol import IpcSource, TransferIn, TransferOut, TransferRelease
from omni_core.workers.transfers import rank_transfers, transfer_release

TARGET_RATIO = 1.2
SIZES_MIB = (64, 256, 1024)


def _consumer(jobs: Any, times: Any) -> None:
    torch.cuda.set_device(0)
    consumer = _Rows(1)
    consumer.device = torch.device("cuda", 0)
    while (job := jobs.get()) is not None:
        request_id, raw = job
        source = msgspec.msgpack.decode(raw, type=IpcSource)
        land = TransferIn(
            task_id=f"i-{request_id}",
            epoch=0,
            request_id=request_id,
            producer_version=0,
            source=source,
            max_bytes=1 << 36,
        )
        started = time.perf_counter()
        rank_transfers(consumer).land(consumer, land)
        torch.cuda.synchronize()
        times.put(time.perf_counter() - started)
        consumer.take_imported(request_id)


def _one(mib: int, n: int, jobs: Any, times: Any) -> dict[str, float]:
    producer = _Rows(mib * 256)
    producer.device, producer.value = torch.device("cuda", 0), producer.value.cuda()
    dst = torch.empty_like(producer.value)
    copies, exports, lands = [], [], []
    for i in range(n):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(producer.value)
        torch.cuda.synchronize()
        copies.append(time.perf_counter() - started)
        started = time.perf_counter()
        source = rank_transfers(producer).export(
            producer,
            TransferOut(task_id=f"o{mib}-{i}", epoch=0, request_id=f"r{mib}-{i}", names=("hidden",), max_bytes=1 << 36),
        )
        exports.append(time.perf_counter() - started)
        jobs.put((f"r{mib}-{i}", msgspec.msgpack.encode(source)))
        lands.append(times.get(timeout=120))
        transfer_release(producer, TransferRelease(task_id=f"x{mib}-{i}", epoch=0, request_id=f"r{mib}-{i}"))
    return {
        "mib": mib,
        "copy_s": statistics.median(copies),
        "export_s": statistics.median(exports),
        "land_s": statistics.median(lands),
    }


def main(out: Path, n: int) -> int:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    ctx = mp.get_context("spawn")
    jobs, times = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_consumer, args=(jobs, times))
    child.start()
    try:
        results = [_one(mib, n, jobs, times) for mib in SIZES_MIB]
    finally:
        jobs.put(None)
        child.join(60)
    rows = [
        f"| {r['mib']} | {r['copy_s'] * 1e3:.2f} ms | {r['export_s'] * 1e3:.2f} ms | {r['land_s'] * 1e3:.2f} ms "
        f"| {r['land_s'] / r['copy_s']:.2f}x |"
        for r in results
    ]
    worst = max(r["land_s"] / r["copy_s"] for r in results)
    text = "\n".join(
        [
            "# A stage-to-stage transfer over CUDA IPC on one GPU, against a raw device copy",
            "",
            f"Device: {torch.cuda.get_device_name(0)}. Command: `python -m benchmarks.transfer_gpu --out {out}`",
            "",
            "| MiB | device copy | export | land (open, copy) | land / copy |",
            "|---|---|---|---|---|",
            *rows,
            "",
            "## Targets",
            "",
            "| target | measured | met |",
            "|---|---|---|",
            f"| IPC landing within {TARGET_RATIO}x of a raw device copy (worst size) | {worst:.2f}x "
            f"| {'met' if worst <= TARGET_RATIO else 'missed'} |",
        ]
    )
    out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer_gpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/transfer_gpu.md"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    raise SystemExit(main(args.out, args.runs))
