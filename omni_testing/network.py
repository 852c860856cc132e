"""One simulated network for the sans-IO cores: a `StageCore`, its `WorkerCore`s, a
controlled clock and the messages in flight between them, with seeded faults.

It plays both shells: the engine's (step the stage core, send what the step says, feed
`SendFailed` back when a rank's queue is full, report a rank's death) and each rank's
(decode, call the worker core, perform its effect when told, reply). Every message crosses
the real codec: bytes go into the network, bytes come out. The network loses, duplicates,
delays and reorders messages and crashes ranks, either when a caller says so (deliver this
one, drop that one) or drawn from a seeded generator (`Faults`), so a run is a function of
its seed and its script. Nothing here reads a clock, the environment or a socket: time is
`Simulator.now` and moves only through `advance`.

Three users share it: the data-driven scenarios (`tests/testdata/*.txt`, through
`omni_testing.script`), the walkthrough (`omni-core walkthrough`) and the stateful tests
of the stage core.

The network addresses ranks, not processes: a command still in flight when its rank restarts
reaches the new process, which must fence it (P-6). A ZMQ ROUTER would drop it; the harsher
network is the better test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omni_core.fsm import inputs as I
from omni_core.fsm.effects import (
    Effect,
    ExecuteEffect,
    ProfileEffect,
    ShutdownEffect,
)
from omni_core.fsm.inputs import RequestOutcome
from omni_core.fsm.stage import StageCommandError, StageCore, StageStep, TaskOutcome
from omni_core.fsm.stage_table import STATELESS
from omni_core.fsm.worker import (
    BadFrame,
    CommandReceived,
    EffectCompleted,
    EffectDeclined,
    EffectRaised,
    Loaded,
    LoadFailed,
    WorkerCore,
    WorkerStep,
)
from omni_core.protocol import (
    Command,
    Hello,
    Message,
    ProtocolError,
    Shutdown,
    decode,
    decode_command,
    encode,
)
from omni_testing.describe import (
    describe,
    describe_effect,
    describe_input,
    describe_outcome,
    fmt_s,
    fmt_tags,
)
from omni_testing.envelope import (
    ECHO,
    NO_MEMORY,
    Envelope,
    Faults,
    SimulationError,
    sim_trace_paths,
)
from omni_testing.rng import SplitMix64

_STATELESS = frozenset(kind.__name__ for kind in STATELESS)
# A bound on one `settle`: far above any scenario, low enough that a livelock fails fast.
SETTLE_MAX_STEPS = 100_000
NO_FAULTS = Faults()  # a run with no seeded fault


def _counters(counters: object) -> dict[str, int]:
    return dataclasses.asdict(counters)  # type: ignore[call-overload]


def _changed(node: str, before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [f"  {node} counter {key} {before[key]} -> {value}" for key, value in after.items() if value != before[key]]


class Simulator:
    """A stage core, its worker cores and the network between them, on a controlled clock."""

    def __init__(
        self,
        stage: StageCore,
        *,
        make_worker: Callable[[int, int], WorkerCore] | None = None,
        seed: int = 0,
        faults: Faults = NO_FAULTS,
        serial_shell: bool = True,
        record: bool = True,
    ) -> None:
        self.stage = stage
        self.make_worker = make_worker or (lambda rank, epoch: WorkerCore(rank, tags=stage.tags, epoch=epoch))
        self.rng = SplitMix64(seed)
        self.faults = faults
        # The shipped rank shell is serial: it reads its next message only after the effect in
        # progress is done, so a command never meets a busy core. An asynchronous shell (off)
        # delivers at once, and the worker core answers BUSY: the harsher test of the core.
        self.serial_shell = serial_shell
        self.record = record  # off: no transcript (the stateful tests run thousands of steps)
        self.now = 0.0
        self.workers: list[WorkerCore] = []
        self.spawn_epoch: dict[int, int] = {}  # rank -> the epoch its process was started in
        self.network: list[Envelope] = []
        self.effects: dict[int, Effect] = {}  # rank -> the effect its shell is performing
        self.effect_command: dict[int, str] = {}  # rank -> the command that effect performs
        self.dead: set[int] = set()
        self.exiting: set[int] = set()  # told to shut down: their exit is no failure
        self.blocked: set[int] = set()  # the engine's send queue to these ranks is full
        self.load_errors: dict[int, str] = {}  # rank -> why its runner fails to load at the next spawn
        self.lines: list[str] = []
        self.counters = {"lost": 0, "duplicated": 0, "delayed": 0, "bad_replies": 0}
        self._ids = 0
        self.outcomes: dict[str, TaskOutcome] = {}  # the last outcome of each task
        self.submitted: set[str] = set()
        self.answered: dict[str, RequestOutcome] = {}  # every request is answered once (P-1, "none is lost")

    # ================================================================ transcript

    def say(self, line: str) -> None:
        if self.record:
            self.lines.append(line)

    def take_lines(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines

    # ================================================================ the engine's side

    def start(self, deadline_s: float, *, hello: bool = True) -> StageStep:
        """The engine spawns the ranks and waits for their Hellos (in the network, not yet
        delivered). `hello=False`: the ranks never say Hello (hung at load)."""
        step = self.call(I.Start(deadline_s))
        self.spawn(hello=hello)
        return step

    def restart(self, deadline_s: float, *, hello: bool = True, from_checkpoint: bool = False) -> StageStep:
        """The engine stops the old processes (an expected exit, no failure), steps Restart
        and spawns fresh ranks under the new epoch, from the stage's `start_weights`.
        Messages in flight stay in flight."""
        step = self.call(I.Restart(deadline_s, from_checkpoint=from_checkpoint))
        self.spawn(hello=hello)
        return step

    def stop(self) -> StageStep:
        """Shutdown as the engine does it: Shutdown to every live rank, then Stop."""
        for rank in self.stage.ranks:
            if rank not in self.dead:
                self.exiting.add(rank)
                self.send(None, rank, Shutdown(task_id=f"shutdown-{self.stage.epoch}-{rank}", epoch=self.stage.epoch))
        return self.call(I.Stop())

    def spawn(self, *, hello: bool = True) -> None:
        epoch = self.stage.epoch
        self.workers = [self.make_worker(rank, epoch) for rank in self.stage.ranks]
        self.spawn_epoch = {rank: epoch for rank in self.stage.ranks}
        self.dead, self.exiting, self.blocked = set(), set(), set()
        self.effects.clear()
        self.effect_command.clear()
        plan = self.stage.start_weights  # a restart's: what the shell starts each rank from
        for worker in self.workers:
            if plan is not None:
                worker.weights_version = plan.version  # as the shell builds its core
            error = self.load_errors.get(worker.rank)
            if error is None:
                worker.step(Loaded(needs_reload=plan is not None and plan.needs_reload))
            else:
                worker.step(LoadFailed(error))  # it still says Hello, in FAILED, with the reason
            if hello:
                self.send(worker.rank, None, self.hello(worker.rank))

    def hello(self, rank: int, **fields: Any) -> Hello:
        """What rank `rank`'s process says first; `fields` override (a forged or odd Hello)."""
        worker = self.workers[rank] if 0 <= rank < len(self.workers) else None
        base: dict[str, Any] = {
            "task_id": "hello",
            "epoch": self.stage.epoch,
            "rank": rank,
            "pid": 100 + rank,
            "device": f"cuda:{rank}",
            "backend": "portable",
            "tags": self.stage.tags,
        }
        if worker is not None:
            base.update(
                tags=worker.tags,
                state=worker.state,
                detail=self.load_errors.get(rank, ""),
                capabilities=tuple(sorted(worker.capabilities, key=lambda c: c.value)),
                weights_version=worker.weights_version,
            )
        base.update(fields)
        return Hello(**base)

    def call(self, event: I.EngineInput) -> StageStep:
        """One engine input into the stage core; then do what its step says. A call the core
        refuses (StageCommandError) changes nothing and is raised after it is recorded."""
        if isinstance(event, I.Submit):
            self.submitted.add(event.request_id)
        if not isinstance(event, I.Received):
            at = f" at t={fmt_s(self.now)}" if isinstance(event, I.Tick) else ""
            self.say(f"stage <- {describe_input(event)}{at}")
        stage = self.stage
        state, epoch, failure = stage.state, stage.epoch, stage.failure
        counters = _counters(stage.counters) if self.record else {}
        try:
            step = stage.step(event, self.now)
        except StageCommandError as exc:
            self.say(f"  refused: {type(exc).__name__}: {exc}")
            raise
        if self.record:
            if stage.epoch != epoch:
                self.say(f"  stage epoch {epoch} -> {stage.epoch}")
            if stage.state is not state:
                self.say(f"  stage {state.value} -> {stage.state.value}")
            self.lines += _changed("stage", counters, _counters(stage.counters))
        self.apply(step, failure=stage.failure if stage.failure != failure else "")
        return step

    def apply(self, step: StageStep, *, failure: str = "") -> None:
        """What the engine's shell does with a step: send, report, and tell the core which
        sends failed (as the orchestrator does, one SendFailed per task). `failure`: the
        stage's new failure, printed when no task outcome carries it."""
        unsent: dict[str, list[int]] = {}
        for out in step.sends:
            if out.rank in self.blocked:
                self.say(
                    f"  send failed: stage->r{out.rank} {describe(out.command)}: the engine's queue to "
                    f"r{out.rank} is full"
                )
                unsent.setdefault(out.command.task_id, []).append(out.rank)
            else:
                self.send(None, out.rank, out.command)
        if step.outcome is not None:
            recorded = self.outcomes.get(step.outcome.task_id) is step.outcome
            self.outcomes[step.outcome.task_id] = step.outcome
            self.say(f"  outcome{' (from the record)' if recorded else ''}: {describe_outcome(step.outcome)}")
        elif failure:  # no task outcome carries it: a failure while idle or starting
            self.say(f"  failure: {failure}")
        for answer in step.requests:
            if answer.request_id in self.answered:
                raise SimulationError(
                    f"request {answer.request_id} answered twice: {self.answered[answer.request_id]} and {answer}"
                )
            self.answered[answer.request_id] = answer
            if answer.ok:
                self.say(f"  answer {answer.request_id}: output {answer.output!r}")
            else:
                self.say(f"  answer {answer.request_id}: {answer.error.name}: {answer.detail}")  # type: ignore[union-attr]
        if step.started is not None:
            self.say(f"  started: {step.started.value}")
        for task_id, ranks in unsent.items():
            self.call(I.SendFailed(task_id, tuple(ranks)))

    def advance(self, dt_s: float) -> StageStep:
        """Time passes: the clock moves on and the stage gets a Tick."""
        if dt_s < 0:
            raise SimulationError(f"time runs forward only, not by {dt_s}")
        self.now += dt_s
        return self.call(I.Tick())

    def receive(self, message: Message) -> StageStep:
        """A message arrives at the stage straight away, not through the network (a forged or
        replayed reply); it still crosses the codec."""
        wire = decode(encode(message))
        self.say(f"recv (injected) {describe(wire)}")
        return self.call(I.Received(wire))  # type: ignore[arg-type]

    # ================================================================ the network

    def send(self, sender: int | None, to: int | None, message: Message) -> Envelope | None:
        """A message enters the network, through the codec; seeded faults apply here."""
        envelope = self._envelope(sender, to, encode(message), message)
        self.say(f"  send {envelope.line()}")
        faults = self.faults
        if faults.loss and self.rng.random() < faults.loss:
            self.counters["lost"] += 1
            self.say(f"  network loses #{envelope.id}")
            return None
        if faults.delay and self.rng.random() < faults.delay:
            held_s = round(self.rng.random() * faults.max_delay_s, 3)  # ms: transcripts stay readable
            envelope = dataclasses.replace(envelope, deliver_at=self.now + held_s)
            self.counters["delayed"] += 1
            self.say(f"  network holds #{envelope.id} until t={fmt_s(envelope.deliver_at)}")
        self.network.append(envelope)
        if faults.duplicate and self.rng.random() < faults.duplicate:
            self.duplicate(envelope, seeded=True)
        return envelope

    def _envelope(self, sender: int | None, to: int | None, data: bytes, message: Message) -> Envelope:
        self._ids += 1
        text = describe(message) if self.record else ""
        return Envelope(
            self._ids, sender, to, data, type(message).__name__, message.task_id, message.epoch, text, self.now
        )

    def deliverable(self) -> list[Envelope]:
        """Messages that may arrive now, oldest first: not held back, and (serial shell) not
        for a rank whose shell is inside an effect."""
        busy = self.effects if self.serial_shell else {}
        return [e for e in self.network if e.deliver_at <= self.now and (e.to is None or e.to not in busy)]

    def find(
        self,
        *,
        id: int | None = None,
        sender: int | str | None = "any",
        to: int | str | None = "any",
        rank: int | None = None,
        kind: str | None = None,
        task_id: str | None = None,
        deliverable: bool = False,
    ) -> list[Envelope]:
        """Messages in flight that match every given field ("any": not a criterion); `rank`
        matches a message from or to that rank."""
        found = self.deliverable() if deliverable else list(self.network)
        return [
            e
            for e in found
            if (id is None or e.id == id)
            and (sender == "any" or e.sender == sender)
            and (to == "any" or e.to == to)
            and (rank is None or rank in (e.sender, e.to))
            and (kind is None or e.kind == kind)
            and (task_id is None or e.task_id == task_id)
        ]

    def _take(self, envelope: Envelope) -> Envelope:
        for index, candidate in enumerate(self.network):
            if candidate.id == envelope.id:
                return self.network.pop(index)
        raise SimulationError(f"message #{envelope.id} is not in flight")

    def deliver(self, which: Envelope | int) -> StageStep | WorkerStep | None:
        """Deliver one message (an envelope, or an index into `network`): to the stage, its
        input's step; to a rank, the worker core's step; None if its rank is dead."""
        envelope = self.network.pop(which) if isinstance(which, int) else self._take(which)
        self.say(f"recv {envelope.line()}")
        if envelope.to is None:
            return self._to_stage(envelope)
        return self._to_rank(envelope)

    def deliver_all(self) -> int:
        """Deliver, oldest first, until nothing may arrive now (effects are not performed)."""
        count = 0
        while ready := self.deliverable():
            self.deliver(ready[0])
            count += 1
            if count > SETTLE_MAX_STEPS:
                raise SimulationError("deliver_all did not come to rest")
        return count

    def drop(self, envelope: Envelope) -> None:
        self._take(envelope)
        self.counters["lost"] += 1
        self.say(f"drop {envelope.line()}")

    def duplicate(self, envelope: Envelope, *, seeded: bool = False) -> Envelope:
        self._ids += 1
        copy = dataclasses.replace(envelope, id=self._ids)
        self.network.append(copy)
        self.counters["duplicated"] += 1
        self.say(
            f"  network duplicates #{envelope.id} as #{copy.id}" if seeded else f"dup {envelope.line()} as #{copy.id}"
        )
        return copy

    def delay(self, envelope: Envelope, by_s: float) -> None:
        """Hold a message back: it may arrive once the clock reaches now + by_s."""
        index = self.network.index(envelope)
        self.network[index] = held = dataclasses.replace(envelope, deliver_at=self.now + by_s)
        self.counters["delayed"] += 1
        self.say(f"delay {held.line()} until t={fmt_s(held.deliver_at)}")

    def corrupt(self, envelope: Envelope) -> None:
        """Flip the message into bytes no decoder accepts (P-10)."""
        index = self.network.index(envelope)
        self.network[index] = bad = dataclasses.replace(
            envelope, data=envelope.data[: len(envelope.data) // 2], corrupt=True
        )
        self.say(f"corrupt {bad.line()}")

    def _to_stage(self, envelope: Envelope) -> StageStep | None:
        try:
            message = decode(envelope.data)
        except ProtocolError as exc:
            # The engine's shell counts and drops what it cannot read; the core never sees it.
            self.counters["bad_replies"] += 1
            self.say(
                f"  engine drops undecodable bytes ({exc.reason.value}); bad_replies {self.counters['bad_replies']}"
            )
            return None
        return self.call(I.Received(message))  # type: ignore[arg-type]

    def _to_rank(self, envelope: Envelope) -> WorkerStep | None:
        rank = envelope.to
        assert rank is not None
        if rank in self.dead:
            self.counters["lost"] += 1
            self.say(f"  lost: r{rank} is dead")
            return None
        worker = self.workers[rank]
        state, counters = worker.state, _counters(worker.counters) if self.record else {}
        try:
            command = decode_command(envelope.data)
        except ProtocolError as exc:
            step = worker.step(BadFrame(exc))
        else:
            step = worker.step(CommandReceived(command))
            if step.effect is not None:
                self.effect_command[rank] = type(command).__name__
        self._report_worker(worker, state, counters, step)
        return step

    def _report_worker(self, worker: WorkerCore, state: Any, counters: dict[str, int], step: WorkerStep) -> None:
        rank = worker.rank
        if step.effect is not None:
            if rank in self.effects:
                raise SimulationError(f"r{rank} started a second effect while {self.effects[rank]} is pending")
            self.effects[rank] = step.effect
        if self.record:
            moved = f"r{rank} {state.value} -> {worker.state.value}" if worker.state is not state else ""
            effect = f"effect: {describe_effect(step.effect)}" if step.effect is not None else ""
            if moved or effect:
                self.say("  " + "; ".join(part for part in (moved, effect) if part))
            self.lines += _changed(f"r{rank}", counters, _counters(worker.counters))
        for reply in step.replies:
            self.send(rank, None, reply)

    # ================================================================ the ranks' side

    def busy_ranks(self) -> list[int]:
        """Live ranks whose shell is performing an effect."""
        return sorted(r for r in self.effects if r not in self.dead)

    def perform(
        self, rank: int, *, error: str | None = None, refuse: str | None = None, output: Any = ECHO
    ) -> WorkerStep:
        """Rank `rank`'s shell finishes its effect: done (an Execute answers with its payload
        unless `output` is given), raised in the backend (`error`), or, for a reload, refused
        by the runner before touching memory (`refuse`)."""
        if rank in self.dead or rank not in self.effects:
            raise SimulationError(f"r{rank} has no effect in progress" + (" (it is dead)" if rank in self.dead else ""))
        effect, command = self.effects.pop(rank), self.effect_command.pop(rank)
        worker = self.workers[rank]
        state, counters = worker.state, _counters(worker.counters) if self.record else {}
        what = f"r{rank} {command} {effect.task_id}"
        if refuse is not None:
            self.say(f"refuse {what}: {refuse}")
            step = worker.step(EffectDeclined(effect.task_id, refuse))
        elif error is not None:
            self.say(f"error {what}: {error}")
            step = worker.step(EffectRaised(effect.task_id, error))
        else:
            self.say(f"done {what}")
            if output is ECHO:
                output = effect.payload if isinstance(effect, ExecuteEffect) else None
            memory = None if command in _STATELESS else NO_MEMORY  # it touches no pool
            step = worker.step(
                EffectCompleted(
                    effect.task_id,
                    memory=memory,
                    output=output,
                    trace_paths=sim_trace_paths(self.stage.name, rank, effect, self.now),
                )
            )
        self._report_worker(worker, state, counters, step)
        if isinstance(effect, ShutdownEffect) and error is None:
            self.dead.add(rank)  # the process exits after its last ACK, as it was told to
            self.say(f"  r{rank} exits")
        return step

    def run_on_rank(self, rank: int, command: Command) -> list[Any]:
        """What rank `rank` answers to one command, its effect performed at once, outside the
        network: the replies, through the codec (for scripted unit tests)."""
        worker = self.workers[rank]
        step = worker.step(CommandReceived(decode_command(encode(command))))
        replies = list(step.replies)
        if step.effect is not None:
            output = step.effect.payload if isinstance(step.effect, ExecuteEffect) else None
            memory = None if isinstance(step.effect, ProfileEffect) else NO_MEMORY
            replies += worker.step(
                EffectCompleted(
                    step.effect.task_id,
                    memory=memory,
                    output=output,
                    trace_paths=sim_trace_paths(self.stage.name, rank, step.effect, self.now),
                )
            ).replies
        return [decode(encode(reply)) for reply in replies]

    def crash(self, rank: int, detail: str = "killed by the simulation") -> StageStep | None:
        """Rank `rank`'s process dies: its effect ends with it, messages to it are lost from
        now on, and the engine's process watch reports it to the stage (RankExited)."""
        if rank in self.dead:
            raise SimulationError(f"r{rank} is dead already")
        self.dead.add(rank)
        self.effects.pop(rank, None)
        self.effect_command.pop(rank, None)
        self.say(f"crash r{rank}: {detail}")
        if rank in self.exiting:
            return None  # told to exit: the engine expects it
        return self.call(I.RankExited(rank, detail, self.spawn_epoch.get(rank, self.stage.epoch)))

    def settle(self, max_steps: int = SETTLE_MAX_STEPS) -> int:
        """A calm (or, with faults, not so calm) stretch: deliver every message that may
        arrive and perform every effect until nothing is left to do now. In order (oldest
        message first, then effects by rank) unless `faults.reorder`; held messages wait for
        the clock. Returns the number of steps taken."""
        faults = self.faults
        for taken in range(max_steps):
            ready, busy = self.deliverable(), self.busy_ranks()
            if not ready and not busy:
                return taken
            alive = [r for r in self.stage.ranks if r not in self.dead]
            if faults.crash and alive and self.rng.random() < faults.crash:
                self.crash(alive[self.rng.randrange(len(alive))], "crashed (seeded fault)")
                continue
            pick = self.rng.randrange(len(ready) + len(busy)) if faults.reorder else 0
            if pick < len(ready):
                self.deliver(ready[pick])
                continue
            rank = busy[pick - len(ready)]
            if faults.effect_error and self.rng.random() < faults.effect_error:
                self.perform(rank, error="backend raised (seeded fault)")
            else:
                self.perform(rank)
        raise SimulationError(f"the network did not come to rest in {max_steps} steps")

    # ================================================================ reading it

    def status_lines(self) -> list[str]:
        stage = self.stage
        asleep = fmt_tags(sorted(stage.residency.asleep))
        weights = "valid" if stage.residency.weights_valid else "invalid"
        lines = [
            f"t={fmt_s(self.now)} stage {stage.state.value} epoch {stage.epoch} policy {stage.policy.value} "
            f"task {stage.task_id or '-'} asleep {asleep} weights {weights}",
            f"  requests: {len(stage.in_flight)} in flight {sorted(stage.in_flight)}, {len(stage.queue)} queued "
            f"{[r.request_id for r in stage.queue]}; {len(self.answered)} of {len(self.submitted)} "
            "answered",
        ]
        if stage.failure:
            lines.append(f"  failure: {stage.failure}")
        ranks = []
        for worker in self.workers:
            rank = worker.rank
            what = "dead" if rank in self.dead else worker.state.value
            effect = self.effects.get(rank)
            busy = f" busy({self.effect_command[rank]} {effect.task_id})" if effect else ""
            ranks.append(f"r{rank} {what} e{worker.epoch}{busy}")
        lines.append("  ranks: " + ", ".join(ranks))
        counters = {k: v for k, v in _counters(stage.counters).items() if v}
        if counters:
            lines.append("  stage counters: " + " ".join(f"{k}={v}" for k, v in counters.items()))
        network = {k: v for k, v in self.counters.items() if v}
        if network:
            lines.append("  network counters: " + " ".join(f"{k}={v}" for k, v in network.items()))
        for envelope in self.network:
            held = f" (held until t={fmt_s(envelope.deliver_at)})" if envelope.deliver_at > self.now else ""
            lines.append(f"  in flight: {envelope.line()}{held}")
        return lines
