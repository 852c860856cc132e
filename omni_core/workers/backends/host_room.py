"""Whether this host can hold a stage's pinned weight arena: the `auto` backend's test.

The `fast` backend page-locks one host arena of exactly the offloaded weights' size at load
time. That is what lets its sleeps and wakes run at the host link's speed, and it is also
memory the host's other processes can no longer use. `auto` chooses `fast` only when the
host has the arena's bytes available with a margin to spare, and `cumem` (which pins its
host copies at sleep time) otherwise.

Every stage on a host is counted: the check and the arena's registration run under one
host-wide lock, so a rank reads the available memory only after every arena registered
before it has already taken its bytes out of it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from omni_core.units import fmt_bytes

GiB = 1 << 30
MIN_MARGIN_BYTES = 4 * GiB  # the host's own processes, page cache, the other stages' bursts
MARGIN_FRACTION = 0.10  # of the host's total memory, when that is more than the minimum
LOCK_NAME = "omni-core-host-arena.lock"


@dataclass(frozen=True)
class HostMemory:
    """`/proc/meminfo`'s MemTotal and MemAvailable, in bytes."""

    total_bytes: int
    available_bytes: int


def read_host_memory(path: str = "/proc/meminfo") -> HostMemory:
    fields: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            name, _, rest = line.partition(":")
            parts = rest.split()
            if name in ("MemTotal", "MemAvailable") and parts:
                fields[name] = int(parts[0]) * 1024  # the file counts kB
    if "MemTotal" not in fields or "MemAvailable" not in fields:
        raise RuntimeError(f"{path} lacks MemTotal or MemAvailable; cannot size the host arena")
    return HostMemory(fields["MemTotal"], fields["MemAvailable"])


@dataclass(frozen=True)
class ArenaChoice:
    """The outcome of the test: `fits`, and the figures behind it in words."""

    fits: bool
    arena_bytes: int
    available_bytes: int
    margin_bytes: int

    @property
    def reason(self) -> str:
        figures = (
            f"the pinned weight arena needs {fmt_bytes(self.arena_bytes)}, the host has "
            f"{fmt_bytes(self.available_bytes)} available and keeps {fmt_bytes(self.margin_bytes)} spare"
        )
        if self.fits:
            return f"auto chose 'fast': {figures}"
        return (
            f"auto chose 'cumem' (host copies pinned at each sleep, slower first sleeps): {figures}; "
            "free host memory or set backend='fast' to insist"
        )


def margin_bytes(total_bytes: int) -> int:
    return max(MIN_MARGIN_BYTES, int(total_bytes * MARGIN_FRACTION))


def choose_arena(arena_bytes: int, host: HostMemory) -> ArenaChoice:
    margin = margin_bytes(host.total_bytes)
    return ArenaChoice(arena_bytes + margin <= host.available_bytes, arena_bytes, host.available_bytes, margin)


@contextlib.contextmanager
def host_arena_lock(directory: str | None = None) -> Iterator[None]:
    """Held from a rank's check of the host's memory until its arena is registered."""
    path = os.path.join(directory or tempfile.gettempdir(), LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock


HostMemorySource = Callable[[], HostMemory]
