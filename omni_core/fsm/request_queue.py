"""The stage's requests: the book of every request (`RequestBook`: queued, in flight, answered)
and its queue of requests waiting to run (`RequestQueue`): first in, first out, and each at its own
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
from typing import Any

from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.fsm.stage_step import StageRequest
from omni_core.fsm.worker_step import InvariantViolation
from omni_core.protocol import VersionSpan

# Below this many entries the heap is never rebuilt: rebuilding a small heap costs more than
# skipping its few stale entries.
_REBUILD_FLOOR = 64


class RequestQueue:
    """Requests in arrival order, removable by id and by deadline. No IO, no clock: `now` is
    the caller's."""

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, tuple[int, StageRequest]] = OrderedDict()  # request_id -> (arrival, request)
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline_at_s, arrival, request_id)
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._by_id)

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def __iter__(self) -> Iterator[StageRequest]:
        return iter([request for _, request in self._by_id.values()])

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def append(self, request: StageRequest) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request {request.request_id!r} is already queued")
        arrival = next(self._arrivals)
        self._by_id[request.request_id] = (arrival, request)
        heapq.heappush(self._deadlines, (request.deadline_at_s, arrival, request.request_id))

    def popleft(self) -> StageRequest:
        """The oldest request; IndexError when empty (as a deque's)."""
        if not self._by_id:
            raise IndexError("pop from an empty request queue")
        _, (_, request) = self._by_id.popitem(last=False)
        self._compact()
        return request

    def pop_expired(self, now: float) -> list[StageRequest]:
        """Remove and return every request whose deadline is at or before `now`, earliest
        deadline first (ties in arrival order)."""
        expired: list[StageRequest] = []
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


class RequestBook:
    """Every request of one stage, from its Submit to its answer: those waiting (the queue,
    at most `queue_limit`), those sent to every rank (in flight, at most `max_in_flight`), and
    the answers the callers hear from the input being stepped.

    Its invariants: a request is queued or in flight, never both; the queue holds at most
    `queue_limit`; each request is answered once (a request answered early, aborted or
    overloaded, keeps its place in flight until every rank has answered it). What a request
    may do in which stage state is the stage's (the admission tables); the book keeps count."""

    def __init__(self, queue_limit: int, max_in_flight: int) -> None:
        if queue_limit < 0 or max_in_flight < 1:
            raise ValueError(
                f"a stage needs queue_limit >= 0 and max_in_flight >= 1, got {queue_limit} and {max_in_flight}"
            )
        self.queue_limit = queue_limit
        self.max_in_flight = max_in_flight
        self.queue = RequestQueue()
        self.in_flight: dict[str, StageRequest] = {}
        self._answers: list[RequestOutcome] = []  # the answers of the input being stepped

    def __contains__(self, request_id: object) -> bool:
        """Whether `request_id` is queued or in flight (a new request must not reuse it)."""
        return request_id in self.in_flight or request_id in self.queue

    def has_room(self) -> bool:
        """Whether one more request may be sent to the ranks now (max_in_flight)."""
        return len(self.in_flight) < self.max_in_flight

    def start(self, request: StageRequest) -> None:
        """`request` goes to every rank: in flight until each has answered it."""
        if request.request_id in self:
            raise InvariantViolation(f"request {request.request_id} both queued and in flight")
        self.in_flight[request.request_id] = request

    def retire(self, request: StageRequest) -> None:
        """Every rank has answered `request` (or will not): it leaves the book."""
        del self.in_flight[request.request_id]

    def answer(
        self,
        request: StageRequest,
        error: RequestError | None,
        detail: str,
        output: Any = None,
        weights_version: int = 0,
        adapter: str | None = None,
        adapter_version: int = 0,
        version_spans: tuple[VersionSpan, ...] = (),
        discarded_tokens: int = 0,
    ) -> None:
        """The caller hears how `request` ended, once: a later answer of the same request
        (its ranks' results after an abort) is dropped."""
        if not request.answered:
            request.answered = True
            ran = (weights_version, adapter, adapter_version, version_spans, discarded_tokens)
            self._answers.append(RequestOutcome(request.request_id, output, error, detail, *ran))

    def take_answers(self) -> tuple[RequestOutcome, ...]:
        """The answers given since the last call, in the order given."""
        answers, self._answers = tuple(self._answers), []
        return answers

    def fail_all(
        self, queued: RequestError, detail: str, *, running: RequestError | None = None, running_detail: str = ""
    ) -> None:
        """End every request: queued ones never ran (`queued`), those sent to the ranks may
        have (`running`, default the same) and say so."""
        for request in self.in_flight.values():
            self.answer(request, running or queued, running_detail or detail)
        for request in self.queue:
            self.answer(request, queued, detail)
        self.in_flight.clear()
        self.queue.clear()

    def check_invariants(self) -> str:
        """What is wrong with the book, or "" (the stage's check asks it after every input).
        Queued and in flight never overlap: `start` checks the one request it moves, so this
        check costs nothing per queued request (16k queued submits stay linear)."""
        if len(self.queue) > self.queue_limit:
            return f"{len(self.queue)} requests queued, over queue_limit {self.queue_limit}"
        return self.queue.check_invariants()
