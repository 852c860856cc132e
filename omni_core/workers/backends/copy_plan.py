"""Copies of a sleep or a wake, planned (pure) and issued over lanes.

`plan_copies` joins allocations that are neighbours on both sides into runs and cuts each
run into chunks; `RestoreCopies` does it as a wake's allocations are mapped, one run at a
time, handing each chunk to a lane (`lanes.LanePicker`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from omni_core.workers.backends.cumem import handle_of
from omni_core.workers.backends.lanes import LanePicker


class CopyObserver(Protocol):
    """Watches a FastPath's device work (`FastPath.observer`; None, the default, costs one
    attribute test per copy or map): the swap benchmark draws each process's bytes in flight
    and mapped bytes from it. Times are `time.monotonic()`, which is system-wide on Linux,
    so the timelines of two processes line up."""

    def copy_issued(self, stream: Any, nbytes: int, to_device: bool) -> None:
        """A copy of `nbytes` was just queued on `stream` (it completes later)."""

    def mapped(self, nbytes: int, started_s: float) -> None:
        """An allocation of `nbytes` was mapped; the map call began at `started_s`."""

    def unmapped(self, nbytes: int) -> None:
        """An allocation of `nbytes` was just unmapped (its memory is free again)."""


def nbytes_of(data: Any) -> int:
    return int(handle_of(data).size)


@dataclass(frozen=True)
class Copy:
    """One asynchronous copy: `nbytes` between device address `device` and host `host`;
    `completes` lists the indices of the allocations whose last byte is in it."""

    device: int
    host: int
    nbytes: int
    completes: tuple[int, ...]


def plan_copies(spans: Sequence[tuple[int, int, int]], chunk_bytes: int) -> list[Copy]:
    """`spans` are (device address, host address, size), in the order they should travel.
    A span that continues the previous one on both sides joins its run; every run is cut
    into copies of at most `chunk_bytes`. Each span index appears in exactly one copy's
    `completes`: the copy holding its last byte (a zero-size span: the copy where it starts)."""
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    runs: list[list[Any]] = []  # [device, host, length, [(end offset in run, span index)]]
    for index, (dev, host, size) in enumerate(spans):
        if size < 0:
            raise ValueError(f"span {index} has negative size {size}")
        last = runs[-1] if runs else None
        if last is not None and dev == last[0] + last[2] and host == last[1] + last[2]:
            last[2] += size
            last[3].append((last[2], index))
        else:
            runs.append([dev, host, size, [(size, index)]])
    copies: list[Copy] = []
    for dev, host, length, ends in runs:
        count = max(1, -(-length // chunk_bytes))
        done: list[list[int]] = [[] for _ in range(count)]
        for end, index in ends:
            done[max(0, end - 1) // chunk_bytes].append(index)
        for k in range(count):
            start = k * chunk_bytes
            copies.append(Copy(dev + start, host + start, min(chunk_bytes, length - start), tuple(done[k])))
    return copies


class RestoreCopies:
    """The host->device copies of a wake: contiguous allocations join one run, and a run
    goes out (cut into chunks, spread over the lanes) once it holds `chunk_bytes` or the
    next allocation does not continue it."""

    def __init__(self, lanes: LanePicker, chunk_bytes: int, observer: CopyObserver | None = None) -> None:
        self.lanes, self.chunk_bytes, self.observer = lanes, chunk_bytes, observer
        self.run: list[tuple[int, int, int]] = []  # (device, host, bytes), contiguous on both sides
        self.run_bytes = 0
        self.issued = 0  # copies started
        self.restored_bytes = 0

    def add(self, device: int, host: int, nbytes: int) -> None:
        last = self.run[-1] if self.run else None
        if last is not None and (last[0] + last[2] != device or last[1] + last[2] != host):
            self.flush()
        self.run.append((device, host, nbytes))
        self.restored_bytes += nbytes
        self.run_bytes += nbytes
        if self.run_bytes >= self.chunk_bytes:  # start this run's copies; map the next ones meanwhile
            self.flush()

    def flush(self) -> None:
        for c in plan_copies(self.run, self.chunk_bytes):
            if c.nbytes:
                lane = self.lanes.pick(c.nbytes)
                lane.copy(c.device, c.host, c.nbytes, True)
                if self.observer is not None:
                    self.observer.copy_issued(getattr(lane, "stream", lane.name), c.nbytes, True)
                self.issued += 1
        self.run.clear()
        self.run_bytes = 0
