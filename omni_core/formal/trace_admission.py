"""What a stage's records must show about admission, answers and waits, checked against the
tables before anything is replayed (the trace spec replays the ranks' answers, not the
orchestrator's admission; tla/OmniAdmission.tla model-checks that from the same tables):

- every request's admission is the decision `fsm.admission.ADMISSION` gives in the state the
  stage's lines put it in, under the policy in force: the one its StageStarting and every
  AdmissionChanged name, which every RequestSubmitted and auto-started StageIssued repeats
  (a trace of an older omni-core names no policy and records no change of it: there each
  decision is held to some policy of the table);
- a wake the stage started itself (`StageIssued.auto`) is one `QUEUE_RULES` starts
  (AUTO_WAKE: a sleeping stage under `wake`) while a request waits in the queue;
- a request is answered once, a refused one with a refusal and nothing run; one answered
  with its output was dispatched; one dispatched had its deadline set when it came in;
- a death flagged `fenced` is one the core fences (another epoch's process, or no rank of
  the stage), and one not flagged is not;
- a Wake refused NO_MEMORY by a rank is refused no earlier than its `memory_wait_s` after
  the rank took it (P-16), on the one clock of the host;
- one incoming wake per device at a time (P-16, `engine/incoming.py`): a swap's hold of its
  devices (IncomingHeld, until its IncomingFreed) shares no device with a hold of any stage
  still in force, and a wake that waits for memory is issued only under its own hold (where
  the trace records holds: its stage's start names the policy);
- liveness at the end: a stage whose trace has its StageStopped (the run ended; a trace cut
  short by a killed engine is a prefix, which owes nothing) answered every request and
  ended every task it issued, the requests and tasks a stop abandons included (the engine
  answers them, failed, after its StageStopped line).

`RecordChecks(lines, stage, ranks)` reads the stage's lines once; `why(n)` is the reason
line n is refuted ("" when it is not), `owed()` what the end still owes. trace_export turns
both into refuted events, so the replay stops there with the reason.
"""

from __future__ import annotations

from typing import Any

from omni_core.fsm import trace_records as T
from omni_core.fsm.admission import AdmissionPolicy, QueueAction, admit, queue_rule
from omni_core.protocol import StageState as S

CLOCK_SLACK_S = 1e-6  # float rounding of the stamps; far below any wait a caller can ask for
REFUSALS = ("refuse_policy", "refuse_needs_reload", "refuse_failed")
WAITING = ("run", "queue")  # a request that waits for its answer: run now, or queued first


def _states(name: str) -> S | None:
    try:
        return S(name)
    except ValueError:
        return None


class RecordChecks:
    """The per-stage checks above, over one pass of the stage's lines."""

    def __init__(self, lines: list[T.TraceLine], stage: str, ranks: int) -> None:
        self.stage, self.ranks = stage, ranks
        self._why: dict[int, str] = {}
        self._state: str | None = None
        self._policies: set[str] = {p.value for p in AdmissionPolicy}
        self._policy_line = 0  # the line that named the policy in force (0: none did)
        self._submitted: dict[str, tuple[int, T.RequestSubmitted]] = {}
        self._waiting: set[str] = set()  # admitted, not yet dispatched (queued)
        self._dispatched: set[str] = set()
        self._answered: set[str] = set()
        self._issued: dict[str, int] = {}  # task id -> the line that issued it
        self._ended: set[str] = set()
        self._wake_waits: dict[tuple[int, str], float] = {}  # (rank, task) -> memory_wait_s sent
        self._wake_taken: dict[tuple[int, int, str], float] = {}  # (rank, epoch, task) -> mono_s taken
        self._issue_waits: dict[str, float] = {}  # Wake task -> memory_wait_s its issue names
        self._modern = False  # its start names the policy: every admission record must too
        self._holds: dict[tuple[str, str], tuple[int, frozenset[str]]] = {}  # (stage, task) -> (line, devices)
        self._stopped = 0
        self._last = 0
        for n, line in enumerate(lines, start=1):
            hold = self._hold(n, line)  # every stage's: a device is shared across stages
            if hold and line.stage == stage:
                self._why.setdefault(n, hold)
            if line.stage == stage:
                self._last = n
                why = self._engine(n, line) if line.is_engine else self._worker(line)
                if why:
                    self._why.setdefault(n, why)

    def why(self, n: int) -> str:
        return self._why.get(n, "")

    @property
    def last_line(self) -> int:
        return self._last

    def owed(self) -> str:
        """What a stage whose run ended (its StageStopped is in the trace) still owes at the
        end of the file: a request never answered, a task never ended."""
        if not self._stopped:
            return ""
        unanswered = [r for r in self._submitted if r not in self._answered]
        unended = [t for t in self._issued if t not in self._ended]
        if not unanswered and not unended:
            return ""
        parts = []
        if unanswered:
            parts.append(f"request(s) {', '.join(sorted(unanswered)[:5])} never answered")
        if unended:
            parts.append(f"task(s) {', '.join(sorted(unended)[:5])} never ended")
        return (
            f"the stage stopped (line {self._stopped}) and the trace ends with {' and '.join(parts)}: "
            "every request and task is answered, a stop's abandoned ones with a failure"
        )

    # ------------------------------------------------------------ engine lines

    def _engine(self, n: int, line: T.TraceLine) -> str:
        r: Any = line.record
        match r:
            case T.StageStarting():
                self._state = S.STARTING.value
                self._modern = self._modern or bool(r.policy)
                return self._policy_named(n, r.policy, "its start")
            case T.AdmissionChanged():
                why = "" if r.before in self._policies else self._policy_mismatch(r.before, "the change's 'before'")
                self._policies, self._policy_line = {r.after}, n
                return why
            case T.RequestSubmitted():
                return self._submit(n, r)
            case T.StageDispatched():
                return self._dispatch(r)
            case T.RequestAnswered():
                return self._answer(r)
            case T.StageIssued():
                why = self._issue(n, r)
                self._state = r.after
                return why
            case T.StageSent() if r.command == "Wake":
                wait_s = r.memory_wait_s or 0.0
                self._wake_waits[r.rank, r.task_id] = wait_s
                issued = self._issue_waits.get(r.task_id, wait_s)
                if issued != wait_s:
                    return f"wake {r.task_id!r} sent with memory_wait_s {wait_s:g}; its issue named {issued:g}"
                return ""
            case T.TaskEnded():
                self._ended.add(r.task_id)
                return ""
            case T.RankDied():
                return self._died(r)
            case T.StageStopped():
                self._stopped = self._stopped or n
                self._state = S.STOPPED.value
                return ""
            case T.StageChanged() | T.StageDeadline() | T.StageRestarted():
                self._state = r.after
                return ""
        return ""

    def _policy_mismatch(self, policy: str, what: str) -> str:
        known = "/".join(sorted(self._policies))
        where = f" (line {self._policy_line} set it)" if self._policy_line else ""
        return f"{what} names admission policy {policy!r}, but the stage's lines put it under {known}{where}"

    def _policy_named(self, n: int, policy: str, what: str) -> str:
        if not policy and self._modern:
            return f"{what} names no admission policy, though the stage's start named one"
        if not policy:
            return ""  # a trace of an older omni-core: the decisions narrow the policy instead
        if policy not in self._policies:
            return self._policy_mismatch(policy, what)
        self._policies, self._policy_line = {policy}, self._policy_line or n
        return ""

    def _submit(self, n: int, r: T.RequestSubmitted) -> str:
        self._submitted.setdefault(r.request_id, (n, r))
        if r.admission in WAITING:
            self._waiting.add(r.request_id)
        if self._state is not None and r.state != self._state:
            return f"request {r.request_id!r} came in with the stage {r.state}; its lines put it in {self._state}"
        why = self._policy_named(n, r.policy, f"request {r.request_id!r}'s admission")
        state = _states(r.state)
        if why or state is None:
            return why or f"request {r.request_id!r} came in in state {r.state!r}, which no stage has"
        fits = {p for p in self._policies if admit(state, AdmissionPolicy(p)).decision.value == r.admission}
        if not fits:
            table = ", ".join(f"{p}: {admit(state, AdmissionPolicy(p)).decision.value}" for p in sorted(self._policies))
            return (
                f"request {r.request_id!r} admitted {r.admission!r} in {r.state}; the admission table "
                f"decides otherwise there ({table})"
            )
        self._narrow(fits)
        return ""

    def _narrow(self, fits: set[str]) -> None:
        # A trace of an older omni-core does not record a change of policy either, so there
        # each decision is held to some policy, not the one the decisions before it implied.
        if self._modern:
            self._policies = fits

    def _dispatch(self, r: T.StageDispatched) -> str:
        self._dispatched.add(r.request_id)
        self._waiting.discard(r.request_id)
        submitted = self._submitted.get(r.request_id)
        if submitted is None:
            return f"request {r.request_id!r} dispatched, but no line says it came in"
        n, came = submitted
        if came.admission not in WAITING:
            return f"request {r.request_id!r} dispatched, though its admission at line {n} was {came.admission!r}"
        if abs(came.deadline_at_s - r.deadline_at_s) > CLOCK_SLACK_S:
            return (
                f"request {r.request_id!r} dispatched with its deadline at {r.deadline_at_s:.6f} s; "
                f"it came in (line {n}) with it at {came.deadline_at_s:.6f} s"
            )
        return ""

    def _answer(self, r: T.RequestAnswered) -> str:
        submitted = self._submitted.get(r.request_id)
        if submitted is None:
            return f"request {r.request_id!r} answered, but no line says it came in"
        if r.request_id in self._answered:
            return f"request {r.request_id!r} answered a second time"
        self._answered.add(r.request_id)
        self._waiting.discard(r.request_id)
        n, came = submitted
        if came.admission in REFUSALS and r.error != "rejected":
            heard = r.error or "its output"
            return f"request {r.request_id!r}, refused at line {n} ({came.admission}), answered with {heard}"
        if not r.error and r.request_id not in self._dispatched:
            return f"request {r.request_id!r} answered with its output, but it was never dispatched to a rank"
        return ""

    def _issue(self, n: int, r: T.StageIssued) -> str:
        self._issued.setdefault(r.task_id, n)
        if r.command == "Wake":
            wait_s = self._issue_waits[r.task_id] = r.memory_wait_s or 0.0
            # A waiting wake is level 1 in the records (P-16, as the spec marks it); a trace of
            # an older omni-core records no wait, only the level.
            if (r.level == 1) != (wait_s > 0) and (self._modern or wait_s > 0):
                return f"wake {r.task_id!r} recorded at level {r.level} with memory_wait_s {wait_s:g}"
            if wait_s > 0 and self._modern and (self.stage, r.task_id) not in self._holds:
                return f"wake {r.task_id!r} waits for memory, but no IncomingHeld line holds its devices"
        if not r.auto:
            return ""
        why = self._policy_named(n, r.policy, f"the auto-started {r.command} {r.task_id!r}")
        state = _states(r.before)
        if why or state is None:
            return why or f"{r.task_id!r} started in state {r.before!r}, which no stage has"
        fits = {p for p in self._policies if queue_rule(state, AdmissionPolicy(p)).action is QueueAction.AUTO_WAKE}
        if r.command != "Wake" or not fits:
            known = "/".join(sorted(self._policies))
            return (
                f"{r.command} {r.task_id!r} started by the stage itself in {r.before} under policy {known}: "
                "the queue rules start only a wake, of a sleeping stage under 'wake'"
            )
        self._narrow(fits)
        if not self._waiting:
            return f"wake {r.task_id!r} started by the stage itself with no request waiting in its queue"
        return ""

    def _died(self, r: T.RankDied) -> str:
        fenced = r.process_epoch != r.epoch or not 0 <= r.rank < self.ranks
        if r.fenced == fenced:
            return ""
        if r.fenced:
            return (
                f"rank {r.rank}'s death flagged fenced, but it is the process of the stage's epoch {r.epoch}: "
                "the core fences only another epoch's"
            )
        return f"rank {r.rank}'s death (a process of epoch {r.process_epoch}) not fenced under epoch {r.epoch}"

    def _hold(self, n: int, line: T.TraceLine) -> str:
        r: Any = line.record
        if isinstance(r, T.IncomingFreed):
            self._holds.pop((line.stage, r.task_id), None)
        if not isinstance(r, T.IncomingHeld):
            return ""
        devices = frozenset(r.devices)
        for (other, task), (at, held) in self._holds.items():
            if devices & held:
                return (
                    f"the incoming wake {r.task_id!r} holds {', '.join(sorted(devices & held))}, which the incoming "
                    f"wake {task!r} of stage {other!r} holds since line {at}: one incoming wake per device at a time"
                )
        self._holds[line.stage, r.task_id] = (n, devices)
        return ""

    # ------------------------------------------------------------ worker lines

    def _worker(self, line: T.TraceLine) -> str:
        r: Any = line.record
        if isinstance(r, T.WorkerReceived) and r.command == "Wake":
            self._wake_taken[line.rank, line.epoch, r.task_id] = line.mono_s
        elif isinstance(r, T.ReplySent) and r.reply == "nack" and r.info == "NO_MEMORY":
            taken = self._wake_taken.get((line.rank, line.epoch, r.task_id))
            wait_s = self._wake_waits.get((line.rank, r.task_id), 0.0)
            if taken is not None and line.mono_s + CLOCK_SLACK_S < taken + wait_s:
                return (
                    f"rank {line.rank} refused wake {r.task_id!r} NO_MEMORY {line.mono_s - taken:.3f} s after "
                    f"taking it; it was sent to wait {wait_s:g} s for memory (P-16: no refusal before then)"
                )
        return ""
