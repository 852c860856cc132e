"""The stage core's requests: admission, the queue and its pump, dispatch to every rank,
the ranks' results, and each request's deadline.

A request runs on every rank of the stage and retires only when every rank has answered it:
until then a rank may still be running it, and a sleep must not go out over it.
"""

from __future__ import annotations

from typing import Any

from omni_core.fsm import admission
from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy, Admit, QueueAction
from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.fsm.request_queue import RequestQueue
from omni_core.fsm.stage_step import Outbound, StageCounters, StageStep, _Request, _Task
from omni_core.fsm.stage_versions import VersionKeeper
from omni_core.fsm.table import Lifecycle
from omni_core.fsm.worker_step import InvariantViolation
from omni_core.protocol import Execute, Nack, Result
from omni_core.protocol import StageState as S


class StageRequests:
    """Mixed into StageCore: every request, from its Submit to its answer."""

    name: str
    ranks: tuple[int, ...]
    epoch: int
    state: S
    lifecycle: Lifecycle[S]
    policy: AdmissionPolicy
    queue_limit: int
    max_in_flight: int
    wake_deadline_s: float
    weights_version: int
    versions: VersionKeeper
    failure: str
    counters: StageCounters
    queue: RequestQueue
    in_flight: dict[str, _Request]
    _answers: list[RequestOutcome]
    _task: _Task | None
    _start_pending: bool
    _expired_at: float | None
    _expired_task: str

    def _submit(self, event: I.Submit, now: float) -> StageStep:
        request = _Request(event.request_id, event.payload, now + event.timeout_s, event.adapter)
        if request.request_id in self.in_flight or request.request_id in self.queue:
            why = f"request id {request.request_id!r} is already queued or in flight on stage {self.name!r}; "
            self._answer(request, RequestError.REJECTED, why + "submit each request under a new id")
            return StageStep()
        decision = admission.admit(self.state, self.policy).decision
        if decision is Admit.RUN and len(self.in_flight) < self.max_in_flight and not self.queue:
            return self._dispatch(request)
        refusal = self._refusal(decision)
        if refusal:
            self._answer(request, RequestError.REJECTED, refusal)
        elif len(self.queue) >= self.queue_limit:
            self._answer(request, RequestError.REJECTED, self._queue_full())
        else:
            self.queue.append(request)
        return StageStep()

    def _refusal(self, decision: Admit) -> str:
        name, state = self.name, self.state.value
        if decision is Admit.REFUSE_FAILED:
            return f"stage {name!r} is {state}: {self.failure or 'stopped'}; restart() it first"
        if self.state is S.NEEDS_RELOAD and self.versions.floor and decision is not Admit.RUN:
            return self.versions.floor_detail(name)
        if decision is Admit.REFUSE_POLICY and self.state is S.NEEDS_RELOAD:
            return (
                f"stage {name!r} is NEEDS_RELOAD (weights discarded by a level-2 sleep) and its admission "
                "policy is 'reject'; call reload_weights() first"
            )
        if decision is Admit.REFUSE_POLICY:
            fix = "resume() it" if self.state is S.PAUSED else "wake it"
            return (
                f"stage {name!r} is {state}, not RUNNING, and its admission policy is 'reject'; {fix} "
                "first or use admission='queue' or 'wake'"
            )
        if decision is Admit.REFUSE_NEEDS_RELOAD:
            return (
                f"stage {name!r} is NEEDS_RELOAD (weights discarded by a level-2 sleep); call "
                "reload_weights() before sending requests"
            )
        return ""

    def _queue_full(self) -> str:
        if self.state is S.RUNNING:
            return (
                f"stage {self.name!r} has {len(self.in_flight)} requests in flight (max_in_flight) and "
                f"{len(self.queue)} queued (queue_limit); retry later or raise the limits"
            )
        return (
            f"stage {self.name!r} is {self.state.value} and its queue is full ({self.queue_limit} "
            "requests); retry later or raise queue_limit"
        )

    def _pump(self, now: float) -> StageStep:
        """Move the queue on after anything changed (QUEUE_RULES), and end a start."""
        step = StageStep()
        if self._start_pending and self.state in (S.RUNNING, S.NEEDS_RELOAD, S.FAILED, S.STOPPED):
            self._start_pending = False
            step = StageStep(started=self.state)
        action = admission.queue_rule(self.state, self.policy).action
        if action is QueueAction.DISPATCH:
            # Collected, then joined once: chaining `then` per request copies the sends each
            # time (quadratic in the requests a resume releases).
            sends: list[Outbound] = []
            while self.queue and len(self.in_flight) < self.max_in_flight:
                sends += self._dispatch(self.queue.popleft()).sends
            step = step.then(StageStep(sends=tuple(sends)))
        elif action is QueueAction.AUTO_WAKE and self.queue and self._task is None:
            task_id = f"auto-wake-{self.name}-{self.epoch}-{next(self._auto_wakes)}"
            step = step.then(self._wake(I.WakeCall(task_id, None, self.wake_deadline_s), now))
        elif action is QueueAction.REJECT_ALL:
            if self.state is S.NEEDS_RELOAD:  # the same words as a refusal at submit
                why = self._refusal(Admit.REFUSE_NEEDS_RELOAD)
            else:
                why = f"{self.failure or f'stage {self.name!r} is {self.state.value}'}; restart() the stage"
            self._fail_requests(RequestError.REJECTED, why)
        return step

    def _dispatch(self, request: _Request) -> StageStep:
        self.lifecycle.fire("execute")  # legal only in RUNNING: the table is the check
        if request.request_id in self.in_flight or request.request_id in self.queue:
            raise InvariantViolation(f"stage {self.name!r}: request {request.request_id} both queued and in flight")
        self.in_flight[request.request_id] = request
        command = Execute(
            task_id=request.request_id, epoch=self.epoch, payload=request.payload, adapter=request.adapter
        )
        return StageStep(sends=tuple(Outbound(rank, command) for rank in self.ranks))

    def _on_request_reply(self, request: _Request, reply: Result | Nack, now: float) -> StageStep:
        if reply.rank not in self.ranks:
            self.counters.unknown_replies_ignored += 1
            return StageStep()
        request.replies[reply.rank] = reply
        return self._maybe_retire(request, now)

    def _maybe_retire(self, request: _Request, now: float) -> StageStep:
        """A request retires only when every rank has answered it: until then a rank may still
        be running it, and a sleep must not go out over it."""
        if len(request.replies) < len(self.ranks):
            return StageStep()
        refusals = {r: m for r, m in sorted(request.replies.items()) if isinstance(m, Nack)}
        results = [m for _, m in sorted(request.replies.items()) if isinstance(m, Result)]
        mixed = {
            r: m.weights_version
            for r, m in sorted(request.replies.items())
            if isinstance(m, Result) and m.weights_version != self.weights_version
        }
        if refusals:
            named = "; ".join(f"rank {r}: {m.reason.value} in {m.state.value}: {m.detail}" for r, m in refusals.items())
            self._answer(
                request, RequestError.FAILED, f"stage {self.name!r} refused request {request.request_id} ({named})"
            )
        elif mixed:  # P-17: never a result of weights other than the stage's committed version
            self._answer(
                request,
                RequestError.FAILED,
                f"stage {self.name!r}: ranks {sorted(mixed)} answered request "
                f"{request.request_id} with weights versions {mixed}, not the stage's version "
                f"{self.weights_version}; the result is discarded",
            )
            del self.in_flight[request.request_id]
            why = {
                r: f"answered request {request.request_id} with weights version {v}; the stage committed "
                f"version {self.weights_version}"
                for r, v in mixed.items()
            }
            return self._fail_task(why, now) if self._task else self._fail_idle(why, now)
        elif results:  # ranks of one stage compute the same result: rank 0's
            first = results[0]
            self._answer(request, None, "", first.output, first.weights_version, first.adapter, first.adapter_version)
        return self._retire(request, now)

    def _retire(self, request: _Request, now: float) -> StageStep:
        del self.in_flight[request.request_id]
        if self.state is S.DRAINING and not self.in_flight and self._task is not None:
            return self._send_drained(now)
        return StageStep()

    def _answer(
        self,
        request: _Request,
        error: RequestError | None,
        detail: str,
        output: Any = None,
        weights_version: int = 0,
        adapter: str | None = None,
        adapter_version: int = 0,
    ) -> None:
        if not request.answered:
            request.answered = True
            ran = (weights_version, adapter, adapter_version)
            self._answers.append(RequestOutcome(request.request_id, output, error, detail, *ran))

    def _fail_requests(
        self, queued: RequestError, detail: str, *, running: RequestError | None = None, running_detail: str = ""
    ) -> None:
        """End every request: queued ones never ran (`queued`), those sent to the ranks may
        have (`running`, default the same) and say so."""
        for request in self.in_flight.values():
            self._answer(request, running or queued, running_detail or detail)
        for request in self.queue:
            self._answer(request, queued, detail)
        self.in_flight.clear()
        self.queue.clear()

    def _send_failed(self, event: I.SendFailed, now: float) -> StageStep:
        request = self.in_flight.get(event.task_id)
        if request is None:
            return StageStep()  # a lifecycle command: its deadline names the rank (P-9)
        # The engine, not a rank, is at fault: its queue to these ranks is full. The caller
        # hears now; ranks that got the request still answer, and it retires when they have.
        self._answer(
            request,
            RequestError.OVERLOADED,
            f"request {request.request_id} to stage {self.name!r} "
            f"could not be sent to ranks {list(event.ranks)}: the engine is overloaded (its socket "
            "queue is full); retry later or lower max_in_flight",
        )
        for rank in event.ranks:
            request.replies[rank] = None
        return self._maybe_retire(request, now)

    def _expire_requests(self, now: float) -> StageStep:
        """Every request at its own deadline: one sent to the ranks and still unanswered fails
        the ranks that gave no result (P-9); a queued one is rejected, and a short one never
        waits behind a long one."""
        step = StageStep()
        silent: dict[int, str] = {}
        for request in [r for r in self.in_flight.values() if now >= r.deadline_at]:
            if self._expired_at is None:
                self._expired_at, self._expired_task = request.deadline_at, request.request_id
            missing = [r for r in self.ranks if r not in request.replies]
            self._answer(
                request,
                RequestError.FAILED,
                f"request {request.request_id} to stage {self.name!r}: "
                f"ranks {missing} gave no result before its deadline; the stage fails, since a rank "
                "still running a request cannot be put to sleep safely",
            )
            for rank in missing:
                silent.setdefault(rank, f"no result for request {request.request_id} before its deadline")
        if silent:
            step = step.then(self._ranks_unresponsive(silent, now))
        # Every queued request at its own deadline: a short one must not wait behind a long one.
        for request in self.queue.pop_expired(now):
            self._answer(
                request,
                RequestError.REJECTED,
                f"request {request.request_id} waited in the queue of "
                f"stage {self.name!r} until its deadline; the stage stayed {self.state.value}",
            )
        return step

    def _ranks_unresponsive(self, failures: dict[int, str], now: float) -> StageStep:
        """Ranks that gave no result for a request within its deadline (P-9): the stage
        cannot trust them with a sleep or the next request, so it fails naming them."""
        failures = {r: why for r, why in failures.items() if r in self.ranks}
        if not failures or self.state in (S.FAILED, S.STOPPED):
            return StageStep()
        step = self._fail_task(failures, now) if self._task else self._fail_idle(failures, now)
        self._check_invariants()
        return step
