"""The memory gate of a wake: map nothing the device has no room for.

During a swap, stage A sleeps while stage B wakes on the same GPU. B's rank asks its gate
before mapping each allocation (or moving each tensor) of the wake: the gate admits when
the device's free memory, less a reserve, covers the bytes; otherwise it polls free memory
with a short, growing backoff until it does, or until `memory_wait_s` has passed since
the wake began. Then `MemoryWaitExpired` names what was needed, what was free, how long it
waited and who holds the device, and the backend unmaps what this wake mapped (the host
copies stay valid) and refuses the wake (`WakeRefused`, NACK NO_MEMORY).

It stays cheap: free memory is queried once and each admitted allocation is deducted from
that budget; the device is asked again only when the budget does not cover the next one,
so a wake with plenty of room costs one query, not one per allocation. A driver refusal of
a map the gate admitted (a third process allocated in between) is "not free yet": the
budget is dropped, and the allocation waits again like any other.

The clock and the sleep are injected, so the logic is tested without waiting.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from omni_core.workers.device_memory import FreeMemorySource, is_out_of_memory
from omni_core.workers.simulated_device import HolderList

MIN_BACKOFF_S = 0.0005  # first poll: A's copies free memory within a millisecond
MAX_BACKOFF_S = 0.02  # a poll costs a driver call; 50 a second is plenty
MAX_HOLDERS_SHOWN = 16  # a refusal names the largest holders; the rest are counted
GiB = float(1 << 30)

T = TypeVar("T")


class MemoryWaitExpired(RuntimeError):
    """The device did not free enough memory within the wake's `memory_wait_s`."""

    def __init__(
        self, message: str, *, needed_bytes: int, free_bytes: int, waited_s: float, holders: HolderList
    ) -> None:
        super().__init__(message)
        self.needed_bytes, self.free_bytes, self.waited_s, self.holders = needed_bytes, free_bytes, waited_s, holders


class WakeRefused(RuntimeError):
    """A wake was refused for lack of device memory and rolled back: every allocation it
    mapped is unmapped again, the host copies are intact and the tags are asleep as before.
    The message is the gate's (needed, free, waited, holders)."""


def _gib(nbytes: int) -> str:
    return f"{nbytes / GiB:.3f} GiB"


def describe_holders(listing: HolderList) -> str:
    if not listing.holders:
        why = listing.problem or "no process holds any"
        return f"holders unknown ({why})" if listing.problem else f"holders: none listed ({why})"
    largest = sorted(listing.holders, key=lambda h: -h.nbytes)
    shown = [h.describe() for h in largest[:MAX_HOLDERS_SHOWN]]
    more = len(listing.holders) - len(shown)
    text = "holders: " + "; ".join(shown) + (f"; and {more} more" if more > 0 else "")
    if listing.skipped:
        text += f" ({listing.skipped} unreadable or over the cap, not counted)"
    if listing.problem:
        text += f" ({listing.problem})"
    return text


def room_for(source: FreeMemorySource | None, nbytes: int) -> bool:
    """Whether the device has `nbytes` free now beyond the gate's reserve: a swap's outgoing
    rank then keeps its memory until its last copy (Sleep.incoming_bytes), since the incoming
    stage's gate would not wait for it. The incoming stage wakes at the same time, so what
    it mapped already counts against the room: a device with little to spare may answer
    False although it fits, the safe side. No source, nothing incoming, or a query that
    fails: False (release as each copy lands, which never makes anyone wait longer)."""
    if source is None or nbytes <= 0:
        return False
    try:
        return source.free_bytes() - source.reserve_bytes >= nbytes
    except Exception:
        return False


class MemoryGate:
    """Admits a wake's allocations as the device's free memory allows. One per wake: the
    wait is measured from its construction (the wake's start)."""

    def __init__(
        self,
        source: FreeMemorySource,
        *,
        memory_wait_s: float,
        what: str = "this wake",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        if memory_wait_s < 0:
            raise ValueError(f"memory_wait_s must be >= 0, got {memory_wait_s}")
        if not 0 < min_backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < min_backoff_s <= max_backoff_s, got {min_backoff_s}, {max_backoff_s}")
        self.source = source
        self.memory_wait_s = memory_wait_s
        self.what = what
        self._clock, self._sleep = clock, sleep
        self._min_backoff_s, self._max_backoff_s = min_backoff_s, max_backoff_s
        self.started_s = clock()
        self._budget_bytes: int | None = None  # None: ask the device at the next acquire
        self.queries = 0  # free-memory queries made (tests; the trace of a slow wake)
        self.admitted_bytes = 0  # admitted and not released
        self.waited_s = 0.0  # time spent sleeping between polls
        self.wake_bytes = 0  # what the whole wake maps, when the backend says (messages)
        self._driver_refusal = ""
        self._last_free = 0  # the device's last answer (messages)

    def expect(self, wake_bytes: int) -> None:
        """The backend's total for this wake, named in a refusal."""
        self.wake_bytes = wake_bytes

    def acquire(self, nbytes: int) -> None:
        """Return once `nbytes` may be mapped; raise MemoryWaitExpired when the wait is over."""
        if nbytes < 0:
            raise ValueError(f"cannot acquire {nbytes} bytes")
        backoff_s = self._min_backoff_s
        fresh = False  # the budget comes from a query made in this call
        while True:
            if self._budget_bytes is not None and nbytes <= self._budget_bytes:
                self._budget_bytes -= nbytes
                self.admitted_bytes += nbytes
                return
            if not fresh:  # no budget, or one from before earlier allocations: ask the device
                self._query()
                fresh = True
                continue
            now = self._clock()  # the device's own answer does not cover it: wait, then ask again
            left_s = self.started_s + self.memory_wait_s - now
            if left_s <= 0:
                raise self._expired(nbytes, self._last_free, now)
            pause_s = min(backoff_s, left_s)
            self._sleep(pause_s)
            self.waited_s += pause_s
            backoff_s = min(backoff_s * 2, self._max_backoff_s)
            fresh = False

    def _query(self) -> None:
        free = self.source.free_bytes()
        self.queries += 1
        self._last_free = free
        self._budget_bytes = max(0, free - self.source.reserve_bytes)

    def release(self, nbytes: int) -> None:
        """A mapped allocation was unmapped again (rollback): its bytes are free once more."""
        self.admitted_bytes -= nbytes
        if self._budget_bytes is not None:
            self._budget_bytes += nbytes

    def driver_refused(self, nbytes: int, error: BaseException) -> None:
        """The driver refused a map this gate admitted: the budget was wrong (another process
        allocated since the query). Forget it, so the allocation waits on fresh figures."""
        self.admitted_bytes -= nbytes
        self._budget_bytes = None
        self._driver_refusal = f"{type(error).__name__}: {error}"

    def admit(self, nbytes: int, allocate: Callable[[], T]) -> T:
        """`allocate()` once `nbytes` are admitted, waiting again while the driver refuses it."""
        while True:
            self.acquire(nbytes)
            try:
                return allocate()
            except Exception as exc:
                if not is_out_of_memory(exc):
                    raise
                self.driver_refused(nbytes, exc)
                # Not at once: the free figure that admitted it may not have changed yet.
                self._pause_after_refusal(nbytes)

    def _pause_after_refusal(self, nbytes: int) -> None:
        now = self._clock()
        left_s = self.started_s + self.memory_wait_s - now
        if left_s <= 0:
            raise self._expired(nbytes, self._last_free, now)
        pause_s = min(self._max_backoff_s, left_s)
        self._sleep(pause_s)
        self.waited_s += pause_s

    def _expired(self, nbytes: int, free: int, now: float) -> MemoryWaitExpired:
        holders = self.source.holders()
        waited_s = now - self.started_s
        reserve = self.source.reserve_bytes
        total = (
            f" (the wake maps {_gib(self.wake_bytes)} in all, {_gib(self.admitted_bytes)} mapped so far)"
            if self.wake_bytes
            else ""
        )
        refused = (
            f"; the driver refused a map the free figure allowed ({self._driver_refusal})"
            if self._driver_refusal
            else ""
        )
        when = (
            "refused at once (memory_wait_s=0)"
            if self.memory_wait_s == 0
            else f"after waiting {waited_s:.3f} s (memory_wait_s={self.memory_wait_s:g})"
        )
        message = (
            f"{self.what} needed {nbytes} bytes ({_gib(nbytes)}) for its next allocation{total}, "
            f"{free} bytes ({_gib(free)}) free on {self.source.describe()}"
            f"{f' less a reserve of {_gib(reserve)}' if reserve else ''}: {when}{refused}; "
            f"{describe_holders(holders)}. Put a stage holding that memory to sleep first, "
            "or give the wake more time (memory_wait_s)"
        )
        return MemoryWaitExpired(message, needed_bytes=nbytes, free_bytes=free, waited_s=waited_s, holders=holders)


def admit(gate: MemoryGate | None, nbytes: int, allocate: Callable[[], T]) -> T:
    """`allocate()` through `gate`, or at once when the wake has none."""
    return allocate() if gate is None else gate.admit(nbytes, allocate)
