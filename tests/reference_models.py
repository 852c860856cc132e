"""Independent reference models of the worker and stage lifecycles, for the stateful tests.

Written from docs/design.md and specs/protocol.md, not from `omni_core.fsm`: no import from it,
no shared tag arithmetic, no transition table. Each model is a plain Python state machine
over sets and enums that says, for one input, what a correct implementation must answer;
the tests drive the real cores and these models side by side and compare.

Where the spec leaves an order of checks open (a command that is both stale and busy...),
the model fixes one; it is the documented order of `WorkerCore`:
stale epoch > copy of the task in progress > already answered > busy > FAILED > the
command's own checks (unknown tag > unsupported > ALREADY > invalid state). "Already
answered" before "busy" is P-1/P-2: an answered task keeps its one reply, busy or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from omni_core.protocol import (
    AckStatus,
    Command,
    Execute,
    NackReason,
    ReloadWeights,
    Shutdown,
    Sleep,
    StageState,
    Status,
    Wake,
    WorkerState,
)

W = WorkerState
S = StageState
WEIGHTS = "weights"


class PropertyViolation(AssertionError):
    """A protocol property (P-n of specs/protocol.md) does not hold. `prop` names it, so a
    test can tell "the invariant caught it" from "something unrelated crashed"."""

    def __init__(self, prop: str, message: str) -> None:
        super().__init__(f"[{prop}] {message}")
        self.prop = prop


class ModelMismatch(PropertyViolation):
    """The implementation and the reference model disagree."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


def require(cond: bool, prop: str, message: str) -> None:
    if not cond:
        raise PropertyViolation(prop, message)


def same_command(a: Command, b: Command) -> bool:
    """Equal apart from the epoch: what a retry of one task looks like."""
    return msgspec.structs.replace(a, epoch=0) == msgspec.structs.replace(b, epoch=0)


def settle(asleep: frozenset[str], weights_valid: bool, tags: tuple[str, ...]) -> WorkerState:
    """Where a wake or a reload ends (docs/design.md, the worker)."""
    if not asleep and weights_valid:
        return W.ACTIVE  # everything resident, weights valid
    if WEIGHTS in tags and WEIGHTS not in asleep and not weights_valid:
        return W.NEEDS_RELOAD  # level 2: memory mapped, weights garbage
    return W.PARTIAL  # some tags still asleep


# ============================================================================ worker


@dataclass(frozen=True)
class Expect:
    """What one input must produce.

    kind: "nack" (reason), "ack" (status, state), "result", "effect" (effect),
    "ignore" (a copy of the task in progress: nothing now), "cached" (the recorded reply).
    `state` is the worker state the reply reports.
    """

    kind: str
    reason: NackReason | None = None
    status: AckStatus | None = None
    state: WorkerState | None = None
    effect: tuple | None = None


@dataclass
class _PendingWork:
    command: Command
    effect: tuple


IDLE = (W.ACTIVE, W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)
ASLEEP_SOME = (W.SLEEPING, W.PARTIAL, W.NEEDS_RELOAD)


class WorkerModel:
    def __init__(self, tags: tuple[str, ...], *, epoch: int, level2: bool, partial_wake: bool) -> None:
        self.tags = tags
        self.epoch = epoch
        self.level2 = level2
        self.partial_wake = partial_wake
        self.state = W.LOADING
        self.asleep: frozenset[str] = frozenset()
        self.weights_valid = True
        self.failure = ""
        self.pending: _PendingWork | None = None
        self.answered: dict[str, Command] = {}  # task_id -> command, for every recorded reply

    # ---------------------------------------------------------------- inputs

    def loaded(self) -> None:
        assert self.state is W.LOADING
        self.state = W.ACTIVE

    def load_failed(self, error: str) -> None:
        self.failure = error
        self.state = W.FAILED

    def command(self, cmd: Command) -> Expect:
        if cmd.epoch < self.epoch:
            return self._nack(NackReason.STALE_EPOCH)
        self.epoch = cmd.epoch
        if self.pending is not None and self.pending.command.task_id == cmd.task_id:
            if same_command(self.pending.command, cmd):
                return Expect("ignore")
            return self._nack(NackReason.TASK_ID_REUSED)
        if not isinstance(cmd, Status) and cmd.task_id in self.answered:
            if same_command(self.answered[cmd.task_id], cmd):
                return Expect("cached")
            return self._nack(NackReason.TASK_ID_REUSED)
        if self.pending is not None:
            if isinstance(cmd, Status):
                return Expect("ack", status=AckStatus.OK, state=self.state)
            if isinstance(cmd, Execute):
                # The stage takes this BUSY as the rank's answer: a copy must get it again (P-1).
                self.answered[cmd.task_id] = cmd
            return self._nack(NackReason.BUSY)
        if self.state is W.FAILED and not isinstance(cmd, (Shutdown, Status)):
            return self._nack(NackReason.FAILED)
        if isinstance(cmd, Sleep):
            return self._sleep(cmd)
        if isinstance(cmd, Wake):
            return self._wake(cmd)
        if isinstance(cmd, ReloadWeights):
            if self.state not in (W.NEEDS_RELOAD, W.ACTIVE):
                return self._nack(NackReason.INVALID_STATE)
            return self._start(cmd, W.RELOADING, ("reload", cmd.source))
        if isinstance(cmd, Execute):
            if self.state is not W.ACTIVE:
                return self._nack(NackReason.INVALID_STATE)
            return self._start(cmd, W.ACTIVE, ("execute", cmd.payload))
        if isinstance(cmd, Status):
            return self._start(cmd, self.state, ("status",))
        if isinstance(cmd, Shutdown):
            if self.state is W.STOPPED:
                return self._already(cmd)
            return self._start(cmd, W.STOPPED, ("shutdown",))
        raise AssertionError(f"unknown command {cmd!r}")

    def done(self) -> Expect:
        """The pending effect succeeded."""
        assert self.pending is not None
        work, self.pending = self.pending, None
        cmd, effect = work.command, work.effect
        if isinstance(cmd, Execute):
            self.answered[cmd.task_id] = cmd
            return Expect("result")
        if isinstance(cmd, Sleep):
            _, offload, discard = effect
            self.asleep |= offload | discard
            if WEIGHTS in discard:
                self.weights_valid = False
            self.state = W.SLEEPING
        elif isinstance(cmd, Wake):
            self.asleep -= effect[1]
            self.state = settle(self.asleep, self.weights_valid, self.tags)
        elif isinstance(cmd, ReloadWeights):
            self.weights_valid = True
            self.state = settle(self.asleep, self.weights_valid, self.tags)
        if not isinstance(cmd, Status):
            self.answered[cmd.task_id] = cmd  # Status is never recorded
        return Expect("ack", status=AckStatus.OK, state=self.state)

    def error(self, text: str) -> Expect:
        """The pending effect raised."""
        assert self.pending is not None
        work, self.pending = self.pending, None
        cmd = work.command
        if not isinstance(cmd, Status):
            self.answered[cmd.task_id] = cmd
        if isinstance(cmd, Execute):
            # A bad request says nothing about memory: the worker stays ACTIVE.
            return Expect("nack", reason=NackReason.EXECUTE_ERROR, state=self.state)
        self.failure = text
        if self.state is not W.STOPPED:
            self.state = W.FAILED
        return Expect("nack", reason=NackReason.BACKEND_ERROR, state=self.state)

    # ---------------------------------------------------------------- commands

    def _resolve(self, tags: tuple[str, ...] | None) -> frozenset[str] | None:
        wanted = frozenset(self.tags if tags is None else tags)
        return wanted if wanted <= set(self.tags) else None

    def _sleep(self, cmd: Sleep) -> Expect:
        wanted = self._resolve(cmd.tags)
        if wanted is None:
            return self._nack(NackReason.UNKNOWN_TAG)
        if cmd.level == 2 and not self.level2:
            return self._nack(NackReason.UNSUPPORTED)
        to_sleep = wanted - self.asleep
        if not to_sleep and self.state in ASLEEP_SOME:
            return self._already(cmd)
        if self.state not in IDLE:
            return self._nack(NackReason.INVALID_STATE)
        # Level 1 keeps a host copy of valid weights and drops scratch; level 2 drops all, and so
        # does a sleep of weights already invalid (nothing worth copying).
        offload = to_sleep & {WEIGHTS} if cmd.level == 1 and self.weights_valid else frozenset()
        return self._start(cmd, W.OFFLOADING, ("sleep", offload, to_sleep - offload))

    def _wake(self, cmd: Wake) -> Expect:
        wanted = self._resolve(cmd.tags)
        if wanted is None:
            return self._nack(NackReason.UNKNOWN_TAG)
        to_wake = wanted & self.asleep
        if not to_wake and self.state in IDLE:
            return self._already(cmd)
        if to_wake != self.asleep and not self.partial_wake:
            return self._nack(NackReason.UNSUPPORTED)
        if self.state not in ASLEEP_SOME:
            return self._nack(NackReason.INVALID_STATE)
        return self._start(cmd, W.RESTORING, ("wake", to_wake))

    # ---------------------------------------------------------------- helpers

    def _start(self, cmd: Command, state: WorkerState, effect: tuple) -> Expect:
        self.state = state
        self.pending = _PendingWork(cmd, effect)
        return Expect("effect", effect=effect)

    def _already(self, cmd: Command) -> Expect:
        self.answered[cmd.task_id] = cmd
        return Expect("ack", status=AckStatus.ALREADY, state=self.state)

    def _nack(self, reason: NackReason) -> Expect:
        return Expect("nack", reason=reason, state=self.state)


# ============================================================================ stage

STAGE_OF = {W.ACTIVE: S.RUNNING, W.SLEEPING: S.SLEEPING, W.PARTIAL: S.PARTIAL, W.NEEDS_RELOAD: S.NEEDS_RELOAD}
SETTLED = (S.RUNNING, S.PAUSED, S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)
SOME_ASLEEP = (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)


@dataclass(frozen=True)
class Call:
    """What a stage API call must do.

    kind: "raise" (StageCommandError; `busy`: StageBusyError), "retry" (re-send to `sends`),
    "recorded" (the outcome recorded for that task_id), "already" (ALREADY, nothing sent),
    "begin" (task started; `sends` lists the ranks, empty while draining), "done" (a task that
    ends in the call, OK, nothing sent: a pause with nothing in flight, a resume).
    """

    kind: str
    sends: frozenset[int] = frozenset()
    busy: bool = False


@dataclass(frozen=True)
class Delivery:
    """What one reply must do to the stage: "stale", "unknown", "duplicate" (counted and
    ignored), "ack" (recorded, no commit yet), "commit", or "fail" (naming `ranks`)."""

    kind: str
    ranks: frozenset[int] = frozenset()


@dataclass
class StageTask:
    task_id: str
    signature: tuple
    deadline_at: float
    expect_state: WorkerState
    expect_asleep: frozenset[str]
    weights_valid_after: bool
    sent: bool = False
    acked: set[int] = field(default_factory=set)


class StageModel:
    def __init__(self, ranks: int, tags: tuple[str, ...], *, start_deadline_at: float) -> None:
        self.ranks = frozenset(range(ranks))
        self.tags = tags
        self.epoch = 0
        self.state = S.STARTING
        self.asleep: frozenset[str] = frozenset()
        self.weights_valid = True
        self.requests = 0
        self.hello: set[int] = set()
        self.start_deadline_at = start_deadline_at
        self.task: StageTask | None = None
        self.ended: dict[str, tuple] = {}  # task_id -> signature, for every task that ended
        self.failed_ranks: frozenset[int] = frozenset()
        self.just_paused = False  # the last request_finished ended a pause's drain
        self.paused = False  # a pause holds until resume(), through sleeps and wakes

    # ---------------------------------------------------------------- API calls

    def sleep(self, task_id: str, level: int, tags: tuple[str, ...] | None, now: float, deadline_s: float) -> Call:
        wanted = self._resolve(tags)
        if wanted is None:
            return Call("raise")
        signature = ("Sleep", level, None if tags is None else wanted)
        early = self._retry_or_refuse(task_id, signature)
        if early is not None:
            return early
        to_sleep = wanted - self.asleep
        if not to_sleep and self.state in SOME_ASLEEP:
            return self._already(task_id, signature)
        if self.state not in SETTLED:
            return Call("raise")
        discards_weights = level == 2 and WEIGHTS in to_sleep
        self.task = StageTask(
            task_id,
            signature,
            now + deadline_s,
            W.SLEEPING,
            self.asleep | to_sleep,
            self.weights_valid and not discards_weights,
        )
        if self.state is S.RUNNING:
            self.state = S.DRAINING  # admission closed; Sleep goes out once requests finish
            if self.requests:
                return Call("begin")
        return Call("begin", sends=self._send())

    def wake(self, task_id: str, tags: tuple[str, ...] | None, now: float, deadline_s: float) -> Call:
        wanted = self._resolve(tags)
        if wanted is None:
            return Call("raise")
        signature = ("Wake", None if tags is None else wanted)
        early = self._retry_or_refuse(task_id, signature)
        if early is not None:
            return early
        to_wake = wanted & self.asleep
        if not to_wake:
            return self._already(task_id, signature)
        if self.state not in SOME_ASLEEP:
            return Call("raise")
        after = self.asleep - to_wake
        self.task = StageTask(
            task_id,
            signature,
            now + deadline_s,
            settle(after, self.weights_valid, self.tags),
            after,
            self.weights_valid,
        )
        return Call("begin", sends=self._send())

    def reload(self, task_id: str, source: str | None, now: float, deadline_s: float) -> Call:
        signature = ("ReloadWeights", source)
        early = self._retry_or_refuse(task_id, signature)
        if early is not None:
            return early
        if self.state is not S.NEEDS_RELOAD:
            return Call("raise")
        self.task = StageTask(
            task_id, signature, now + deadline_s, settle(self.asleep, True, self.tags), self.asleep, True
        )
        return Call("begin", sends=self._send())

    def pause(self, task_id: str, mode: str, now: float, deadline_s: float) -> Call:
        """Admission closes, nothing is sent or released; PAUSED once no request is in flight."""
        signature = ("Pause", mode)
        early = self._retry_or_refuse(task_id, signature)
        if early is not None:
            return early
        if self.state is S.PAUSED:
            return self._already(task_id, signature)
        if self.state is not S.RUNNING:
            return Call("raise")
        self.task = StageTask(task_id, signature, now + deadline_s, W.ACTIVE, self.asleep, self.weights_valid)
        self.state = S.DRAINING
        if self.requests:
            return Call("begin")
        self._paused()
        return Call("done")

    def resume(self, task_id: str) -> Call:
        signature = ("Resume",)
        early = self._retry_or_refuse(task_id, signature)
        if early is not None:
            return early
        if self.state is S.RUNNING:
            return self._already(task_id, signature)
        if self.state is S.PAUSED:
            self.state = S.RUNNING
        elif not (self.paused and self.state in (S.SLEEPING, S.PARTIAL, S.NEEDS_RELOAD)):
            return Call("raise")
        self.paused = False  # asleep: it stays so, the next wake serves
        self.ended[task_id] = signature
        return Call("done")

    def _paused(self) -> None:
        self.state = S.PAUSED
        self.paused = True
        self._end()

    def request_started(self) -> bool:
        if self.state is not S.RUNNING:
            return False
        self.requests += 1
        return True

    def request_finished(self) -> frozenset[int]:
        assert self.requests > 0
        self.requests -= 1
        self.just_paused = False
        if self.state is S.DRAINING and self.requests == 0:
            assert self.task is not None
            if self.task.signature[0] == "Pause":
                self.just_paused = True
                self._paused()
                return frozenset()
            return self._send()
        return frozenset()

    def restart(self, now: float, deadline_s: float) -> bool:
        if self.state not in (*SETTLED, S.FAILED, S.STOPPED):
            return False
        self.epoch += 1
        self.state = S.STARTING
        self.paused = False
        self.asleep, self.weights_valid = frozenset(), True
        self.requests = 0
        self.hello = set()
        self.failed_ranks = frozenset()
        self.start_deadline_at = now + deadline_s
        return True

    # ---------------------------------------------------------------- network and time

    def hello_from(self, rank: int, epoch: int) -> str:
        if epoch != self.epoch or self.state is not S.STARTING:
            return "stale"
        self.hello.add(rank)
        if self.hello == self.ranks:
            self.state = S.RUNNING
        return "ok"

    def reply(
        self, *, epoch: int, task_id: str, rank: int, is_nack: bool, state: WorkerState | None, asleep: frozenset[str]
    ) -> Delivery:
        if epoch != self.epoch:
            return Delivery("stale")
        task = self.task
        if task is None or not task.sent or task_id != task.task_id or rank not in self.ranks:
            return Delivery("unknown")
        if rank in task.acked:
            return Delivery("duplicate")
        if is_nack or state is not task.expect_state or asleep != task.expect_asleep:
            return self._fail(frozenset({rank}))
        task.acked.add(rank)
        if task.acked != self.ranks:
            return Delivery("ack")
        self.state = STAGE_OF[task.expect_state]
        if self.paused and self.state is S.RUNNING:
            self.state = S.PAUSED  # every tag back, but the pause holds until resume()
        self.asleep, self.weights_valid = task.expect_asleep, task.weights_valid_after
        self._end()
        return Delivery("commit")

    def tick(self, now: float) -> Delivery | None:
        """None: nothing happens. "fail": FAILED naming ranks. "drain_timeout": back to RUNNING."""
        if self.state is S.STARTING and now >= self.start_deadline_at:
            return self._fail(self.ranks - self.hello)
        task = self.task
        if task is None or now < task.deadline_at:
            return None
        if self.state is S.DRAINING:
            self.state = S.RUNNING  # nothing was sent; the sleep is abandoned
            self._end()
            return Delivery("drain_timeout")
        return self._fail(self.ranks - task.acked)

    def rank_died(self, rank: int) -> Delivery | None:
        if self.state in (S.FAILED, S.STOPPED):
            return None
        return self._fail(frozenset({rank}))

    # ---------------------------------------------------------------- helpers

    def _resolve(self, tags: tuple[str, ...] | None) -> frozenset[str] | None:
        if tags is None:
            return frozenset(self.tags)
        wanted = frozenset(tags)
        return wanted if wanted and wanted <= set(self.tags) else None

    def _retry_or_refuse(self, task_id: str, signature: tuple) -> Call | None:
        task = self.task
        if task is not None and task.task_id == task_id:
            if task.signature != signature:
                return Call("raise")
            return Call("retry", sends=self.ranks - task.acked if task.sent else frozenset())
        if task_id in self.ended:
            return Call("recorded") if self.ended[task_id] == signature else Call("raise")
        if task is not None:
            return Call("raise", busy=True)
        if self.state in (S.FAILED, S.STARTING, S.STOPPED):
            return Call("raise")
        return None

    def _already(self, task_id: str, signature: tuple) -> Call:
        self.ended[task_id] = signature
        return Call("already")

    def _send(self) -> frozenset[int]:
        assert self.task is not None
        self.state = S.TRANSITIONING if self.task.signature[0] == "Sleep" else S.WAKING
        self.task.sent = True
        return self.ranks

    def _fail(self, ranks: frozenset[int]) -> Delivery:
        self.state = S.FAILED
        self.failed_ranks = ranks
        self.requests = 0
        if self.task is not None:
            self._end()
        return Delivery("fail", ranks)

    def _end(self) -> None:
        assert self.task is not None
        self.ended[self.task.task_id] = self.task.signature
        self.task = None
