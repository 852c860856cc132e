"""The stage's queue of requests waiting to run: first in, first out, and each at its own
deadline, with every operation's cost bounded by the requests it touches, not by the queue.

The queue is indexed twice: by arrival (an OrderedDict: the oldest request leaves in O(1),
and any request is found by id in O(1)) and by deadline (a heap, so a tick finds the
expired requests without scanning the rest). A request that leaves the queue by
dispatch leaves a stale heap entry behind; stale entries are skipped when they surface and
the heap is rebuilt when they outnumber the live ones, so it never holds more than twice the
queue plus a constant.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterator

from omni_core.fsm.stage_step import _Request

# Below this many entries the heap is never rebuilt: rebuilding a small heap costs more than
# skipping its few stale entries.
_REBUILD_FLOOR = 64


class RequestQueue:
    """Requests in arrival order, removable by id and by deadline. No IO, no clock: `now` is
    the caller's."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, tuple[int, _Request]] = OrderedDict()  # request_id -> (arrival, request)
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline_at, arrival, request_id)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __iter__(self) -> Iterator[_Request]:
        return iter([request for _, request in self._by_id.values()])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def append(self, request: _Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already queued")
        arrival = next(self._arrivals)
        self._by_id[request.request_id] = (arrival, request)
        heapq.heappush(self._deadlines, (request.deadline_at, arrival, request.request_id))

    def popleft(self) -> _Request:
        """The oldest request; IndexError when empty (as a deque's)."""
        if not self._by_id:
            raise IndexError("pop from an empty request queue")
        _, (_, request) = self._by_id.popitem(last=False)
        self._compact()
        return request

    def pop_expired(self, now: float) -> list[_Request]:
        """Remove and return every request whose deadline is at or before `now`, earliest
        deadline first (ties in arrival order)."""
        expired: list[_Request] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, arrival, request_id = heapq.heappop(self._deadlines)
            queued = self._by_id.get(request_id)
            # A stale entry: that request left by dispatch (an id queued again is a new arrival).
            if queued is not None and queued[0] == arrival:
                del self._by_id[request_id]
                expired.append(queued[1])
        return expired

    def clear(self) -> None:
        self._by_id.clear()
        self._deadlines.clear()

    def check_invariants(self) -> str:
        """What is wrong with the queue's own state, or "" (the stage's check asks it)."""
        if len(self._deadlines) < len(self._by_id):
            return f"deadline heap holds {len(self._deadlines)} entries for {len(self._by_id)} queued requests"
        if len(self._deadlines) > 2 * len(self._by_id) + _REBUILD_FLOOR:
            return f"deadline heap holds {len(self._deadlines)} entries for {len(self._by_id)} queued requests"
        return ""

    def _compact(self) -> None:
        """Drop the stale heap entries once they outnumber the live ones (amortised O(1) per pop)."""
        if len(self._deadlines) <= 2 * len(self._by_id) + _REBUILD_FLOOR:
            return
        live = {arrival for arrival, _ in self._by_id.values()}
        self._deadlines = [entry for entry in self._deadlines if entry[1] in live]
        heapq.heapify(self._deadlines)
