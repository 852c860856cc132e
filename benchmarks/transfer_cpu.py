"""A stage-to-stage transfer's bytes on the CPU (P-22) against a memcpy of the same bytes.

The transfer is the rank's own path, in one process (both ranks' halves, no sockets): the
producer's `RankTransfers.export` (the runner's tensors copied into a WeightSender's shm
buckets) and the consumer's `RankTransfers.land` (the buckets opened as an update opens them,
checked, copied into the runner's inbox), then the release. The baseline is one
`torch.Tensor.copy_` of the same bytes between two host tensors.

    python -m benchmarks.transfer_cpu --out benchmarks/results/transfer_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from omni_core.protocol import TransferIn, TransferOut, TransferRelease
from omni_core.runners.base import ModelRunner
from omni_core.runners.connector import ConnectorSpec
from omni_core.workers.transfers import rank_transfers, transfer_release

TARGET_RATIO = 1.5
SIZES_MIB = (16, 64, 256)


class _Rows(ModelRunner):
    """A runner that exports (and imports) one float32 tensor of `rows` x 1024."""

    def __init__(self, rows: int) -> None:
        super().__init__(torch.device("cpu"))
        self.value = torch.randn(rows, 1024)

    def load_weights(self) -> None: ...
    def allocate_caches(self) -> None: ...
    def tensors(self, tag: str) -> list[torch.Tensor]:
        return []

    def execute(self, payload: Any) -> Any:
        return None

    def reload_weights(self, source: str | None) -> None: ...

    def transfer_exports(self) -> dict[str, ConnectorSpec]:
        return {"hidden": ConnectorSpec(torch.float32, (None, 1024))}

    def transfer_imports(self) -> dict[str, ConnectorSpec]:
        return self.transfer_exports()

    def export_tensors(self, payload: Any, names: Any) -> dict[str, torch.Tensor]:
        return {"hidden": self.value}


def _one(mib: int, n: int) -> dict[str, float]:
    rows = mib * 256  # 1024 float32 a row: 4 KiB
    producer, consumer = _Rows(rows), _Rows(1)
    copies, exports, lands = [], [], []
    dst = torch.empty_like(producer.value)
    for i in range(n):
        started = time.perf_counter()
        dst.copy_(producer.value)
        copies.append(time.perf_counter() - started)
        out = TransferOut(task_id=f"o{i}", epoch=0, request_id=f"r{i}", names=("hidden",), max_bytes=1 << 34)
        started = time.perf_counter()
        source = rank_transfers(producer).export(producer, out)
        exported = time.perf_counter()
        land = TransferIn(
            task_id=f"i{i}", epoch=0, request_id=f"r{i}", producer_version=0, source=source, max_bytes=1 << 34
        )
        rank_transfers(consumer).land(consumer, land)
        landed = time.perf_counter()
        exports.append(exported - started)
        lands.append(landed - exported)
        assert torch.equal(consumer.take_imported(f"r{i}")["hidden"], producer.value)
        transfer_release(producer, TransferRelease(task_id=f"x{i}", epoch=0, request_id=f"r{i}"))
    copy_s = statistics.median(copies)
    total = [e + la for e, la in zip(exports, lands, strict=True)]
    return {
        "mib": mib,
        "memcpy_s": copy_s,
        "export_s": statistics.median(exports),
        "land_s": statistics.median(lands),
        "transfer_s": statistics.median(total),
        "ratio": statistics.median(total) / copy_s,
    }


def main(out: Path, n: int, command: str) -> int:
    torch.set_num_threads(1)
    results = [_one(mib, n) for mib in SIZES_MIB]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# A stage-to-stage transfer over shared memory on the CPU, against a memcpy",
        "",
        f"Machine: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs), one torch thread. Commit {commit}.",
        f"Command: `{command}`",
        "",
        f"Median of {n} runs per size. The transfer is the producer's export (the tensor copied into shm",
        "buckets) plus the consumer's landing (the buckets opened and checked, the tensor copied into its",
        "inbox), both ranks' halves in one process; the memcpy is one `copy_` of the same bytes.",
        "",
        "| MiB | memcpy | export (copy in) | land (open, copy out) | transfer | transfer / memcpy |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['mib']} | {r['memcpy_s'] * 1e3:.1f} ms | {r['export_s'] * 1e3:.1f} ms | {r['land_s'] * 1e3:.1f} ms "
            f"| {r['transfer_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x |"
        )
    worst = max(r["ratio"] for r in results)
    export_x = max(r["export_s"] / r["memcpy_s"] for r in results)
    land_x = max(r["land_s"] / r["memcpy_s"] for r in results)
    met = (
        "met"
        if worst <= TARGET_RATIO
        else (
            f"missed by {worst / TARGET_RATIO:.2f}x: the bytes are copied twice, into the producer's buckets "
            f"(at most {export_x:.2f}x a memcpy: an idle sender's buckets are refilled in place) and out into "
            f"the consumer's inbox (at most {land_x:.2f}x: a fresh allocation, every page faulted on first "
            "touch, where the memcpy writes into memory already touched); a runner writing its export into "
            "the buckets and an inbox reusing its buffers would take both toward 1x"
        )
    )
    lines += ["", "## Targets", "", "| target | measured | met |", "|---|---|---|"]
    lines.append(f"| shm transfer within {TARGET_RATIO}x of a memcpy (worst size) | {worst:.2f}x | {met} |")
    lines.append(
        "| CUDA IPC transfer within 1.2x of a raw device copy | not run | missed: no device this round; "
        "`python -m benchmarks.transfer_gpu` is the script |"
    )
    out.write_text("\n".join(lines) + "\n")
    print(out.read_text())
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.transfer_cpu")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/transfer_cpu.md"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    raise SystemExit(main(args.out, args.runs, "python -m benchmarks.transfer_cpu --out " + str(args.out)))
