"""One WorkerCore driven by hypothesis with random commands, task_ids from a small pool (so
duplicates and reuse happen), older/same/newer epochs, effects that complete or fail at
random times, and copies of earlier commands; compared after every step with the
independent reference model in `reference_models.py` and checked against the protocol's
properties. The same machine run against deliberately broken workers must fail."""

from __future__ import annotations

import itertools

import pytest
from broken_variants import BROKEN, NoEpochFenceWorker, NoReplyCacheWorker
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from reference_models import Expect, ModelMismatch, PropertyViolation, WorkerModel, require, same_command

from omni_core.fsm import (
    ExecuteEffect,
    ReloadEffect,
    ShutdownEffect,
    SleepEffect,
    StatusEffect,
    WakeEffect,
    WorkerCore,
)
from omni_core.fsm.effects import Effect
from omni_core.fsm.worker import BadFrame, CommandReceived, EffectCompleted, EffectRaised, Loaded, LoadFailed
from omni_core.protocol import (
    Ack,
    AckStatus,
    Capability,
    Command,
    Execute,
    Nack,
    NackReason,
    ProtocolError,
    ReloadWeights,
    Reply,
    Result,
    Shutdown,
    Sleep,
    Status,
    UpdateWeights,
    Wake,
    WorkerState,
    decode,
    decode_command,
    encode,
)

W = WorkerState
TAGS = ("weights", "kv_cache", "scratch")
TAG_CHOICES = [
    None,
    None,
    None,
    ("weights",),
    ("kv_cache",),
    ("scratch",),
    ("weights", "kv_cache"),
    ("kv_cache", "scratch"),
    ("scratch", "weights"),
    ("kv_cache", "weights", "scratch"),
    ("kv_cache", "kv_cache"),
    ("weights", "lora"),
]
KINDS = ["sleep"] * 5 + ["wake"] * 5 + ["reload"] * 3 + ["execute"] * 4 + ["status"] * 2 + ["shutdown"]
# What usually moves a worker on from each state: the `progress` rule draws from these, so
# runs get deep (level-2 sleep, partial wake, reload) instead of bouncing off refusals.
PROGRESS = {
    W.ACTIVE: ["sleep", "sleep", "sleep", "execute", "reload"],
    W.SLEEPING: ["wake", "wake", "wake", "sleep"],
    W.PARTIAL: ["wake", "wake", "sleep", "execute"],
    W.NEEDS_RELOAD: ["reload", "reload", "wake", "sleep", "execute"],
}
POOL = [f"t{i}" for i in range(6)]


def effect_tuple(effect: Effect) -> tuple:
    if isinstance(effect, SleepEffect):
        return ("sleep", effect.offload, effect.discard)
    if isinstance(effect, WakeEffect):
        return ("wake", effect.tags)
    if isinstance(effect, ReloadEffect):
        return ("reload", effect.source)
    if isinstance(effect, ExecuteEffect):
        return ("execute", effect.payload)
    if isinstance(effect, StatusEffect):
        return ("status",)
    if isinstance(effect, ShutdownEffect):
        return ("shutdown",)
    raise ModelMismatch(f"unknown effect {effect!r}")


class WorkerMachine(RuleBasedStateMachine):
    """Subclasses swap `make_worker` for a broken worker; the checks stay the same."""

    examples = 0

    @staticmethod
    def make_worker(**kwargs: object) -> WorkerCore:
        return WorkerCore(0, **kwargs)  # type: ignore[arg-type]

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1
        self._fresh = itertools.count()
        self._booms = itertools.count()
        self.sent: list[Command] = []
        self.recorded: dict[str, tuple[Command, Reply]] = {}  # terminal replies, by task_id
        self.effects: dict[str, int] = {}  # non-Status effects emitted, by task_id
        self.weights_garbage = False  # a level-2 sleep discarded the weights; no reload since

    @initialize(
        level2=st.sampled_from([True, True, True, False]),
        partial_wake=st.sampled_from([True, True, True, False]),
        epoch=st.integers(0, 2),
        loaded=st.sampled_from([True] * 5 + [False]),
    )
    def start(self, level2: bool, partial_wake: bool, epoch: int, loaded: bool) -> None:
        caps = tuple(c for c, on in ((Capability.LEVEL2, level2), (Capability.PARTIAL_WAKE, partial_wake)) if on)
        self.worker = self.make_worker(tags=TAGS, epoch=epoch, capabilities=caps)
        self.model = WorkerModel(TAGS, epoch=epoch, level2=level2, partial_wake=partial_wake)
        if loaded:  # most runs start serving; the rest explore LOADING first
            self.load(True)

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: self.model.state is W.LOADING)
    @rule(ok=st.sampled_from([True] * 5 + [False]))
    def load(self, ok: bool) -> None:
        if ok:
            self.model.loaded()
            self.worker.step(Loaded())
        else:
            text = f"load-boom-{next(self._booms)}"
            self.model.load_failed(text)
            self.worker.step(LoadFailed(text))

    @rule(
        kind=st.sampled_from(KINDS),
        tags=st.sampled_from(TAG_CHOICES),
        level=st.sampled_from([1, 1, 2]),
        task=st.integers(0, 11),
        epoch_delta=st.sampled_from([0] * 12 + [1, -1]),
        finish_now=st.sampled_from([True, True, False]),
    )
    def send(
        self, kind: str, tags: tuple[str, ...] | None, level: int, task: int, epoch_delta: int, finish_now: bool
    ) -> None:
        self._send(kind, tags, level, task, epoch_delta, finish_now)

    @precondition(lambda self: self.model.state in PROGRESS)
    @rule(
        pick=st.integers(0, 4),
        tags=st.sampled_from(TAG_CHOICES[:-1]),
        level=st.sampled_from([1, 2]),
        task=st.integers(0, 11),
        finish_now=st.sampled_from([True, True, False]),
    )
    def progress(self, pick: int, tags: tuple[str, ...] | None, level: int, task: int, finish_now: bool) -> None:
        options = PROGRESS[self.model.state]
        self._send(options[pick % len(options)], tags, level, task, 0, finish_now)

    @precondition(lambda self: self.model.state in (W.FAILED, W.STOPPED) and self.model.pending is None)
    @rule()
    def restart(self) -> None:
        """A fresh worker process under a newer epoch (the only way out of FAILED/STOPPED)."""
        old = self.model
        self.start(old.level2, old.partial_wake, old.epoch + 1, loaded=True)
        self.recorded.clear()  # a new process: new cache, new tasks
        self.effects.clear()
        self.weights_garbage = False

    def _send(
        self, kind: str, tags: tuple[str, ...] | None, level: int, task: int, epoch_delta: int, finish_now: bool
    ) -> None:
        task_id = POOL[task] if task < len(POOL) else f"fresh-{next(self._fresh)}"
        epoch = max(0, self.model.epoch + epoch_delta)
        command: Command = {
            "sleep": lambda: Sleep(task_id=task_id, epoch=epoch, level=level, tags=tags),
            "wake": lambda: Wake(task_id=task_id, epoch=epoch, tags=tags),
            "reload": lambda: ReloadWeights(task_id=task_id, epoch=epoch, source=None if level == 1 else "ckpt"),
            "execute": lambda: Execute(task_id=task_id, epoch=epoch, payload=task),
            "status": lambda: Status(task_id=task_id, epoch=epoch),
            "shutdown": lambda: Shutdown(task_id=task_id, epoch=epoch),
        }[kind]()
        self.sent.append(command)
        self._deliver(command)
        if finish_now and self.model.pending is not None and self.model.pending.command is command:
            self.finish(fail=False, output=task)  # the shell did it right away

    @precondition(lambda self: self.sent)
    @rule(back=st.integers(0, 3))
    def redeliver(self, back: int) -> None:
        """The network delivers an earlier command again (most often a recent one)."""
        self._deliver(self.sent[max(-len(self.sent), -1 - back)])

    @precondition(lambda self: self.model.pending is not None)
    @rule(fail=st.sampled_from([False] * 4 + [True]), output=st.integers(0, 9))
    def finish(self, fail: bool, output: int) -> None:
        """The shell finishes the pending effect, successfully or not."""
        pending = self.model.pending
        assert pending is not None
        command = pending.command
        if fail:
            text = f"boom-{next(self._booms)}"
            expect = self.model.error(text)
            step = self.worker.step(EffectRaised(command.task_id, text))
        else:
            expect = self.model.done()
            # A weights write completes with the names of the caches it dropped (none here).
            result = None if isinstance(command, (ReloadWeights, UpdateWeights)) else output
            step = self.worker.step(EffectCompleted(command.task_id, output=result, duration_s=0.5))
        require(
            step.effect is None and len(step.replies) == 1,
            "P-1",
            f"completing {command!r} must give exactly one reply, got {step}",
        )
        (reply,) = step.replies
        self._compare(expect, command, step.replies, None)
        if isinstance(reply, Result):
            require(reply.output == output, "model", f"Result output {reply.output!r} != {output!r}")
        if fail:
            require(text in reply.detail, "P-11", f"the failure reply {reply!r} does not say {text!r}")
        if not isinstance(command, Status):
            self.recorded[command.task_id] = (command, reply)
        if not fail and pending.effect[0] == "sleep" and "weights" in pending.effect[2]:
            self.weights_garbage = True
        if not fail and pending.effect[0] == "reload":
            self.weights_garbage = False
        self._check_failure_text(step.replies)

    @rule(data=st.binary(max_size=24), mangle=st.booleans())
    def bad_bytes(self, data: bytes, mangle: bool) -> None:
        """P-10: bytes that do not decode are refused and change nothing."""
        if mangle and self.sent:
            data = encode(self.sent[-1])[: len(data) % 8 + 1]
        try:
            decode(data)
        except ProtocolError as err:
            before = (self.worker.state, self.worker.busy)
            step = self.worker.step(BadFrame(err))
            require(len(step.replies) == 1 and step.effect is None, "P-10", f"bad bytes gave {step}")
            (nack,) = step.replies
            require(
                isinstance(nack, Nack) and nack.reason in (NackReason.BAD_MESSAGE, NackReason.UNSUPPORTED_VERSION),
                "P-10",
                f"bad bytes answered with {nack!r}",
            )
            require((self.worker.state, self.worker.busy) == before, "P-10", "bad bytes changed the worker")
            self._check_failure_text(step.replies)

    # ------------------------------------------------------------------ one command

    def _deliver(self, command: Command) -> None:
        model, worker = self.model, self.worker
        stale = command.epoch < model.epoch
        state_before = model.state
        in_flight = model.pending.command if model.pending is not None else None
        recorded = self.recorded.get(command.task_id)
        expect = model.command(command)
        step = worker.step(CommandReceived(decode_command(encode(command))))
        replies, effect = step.replies, step.effect

        require(len(replies) + (effect is not None) <= 1, "P-1", f"{command!r} got {step}")
        if stale:
            require(
                effect is None
                and len(replies) == 1
                and isinstance(replies[0], Nack)
                and replies[0].reason is NackReason.STALE_EPOCH,
                "P-6",
                f"{command!r} from epoch {command.epoch} < {model.epoch} got {step}",
            )
        elif in_flight is not None and in_flight.task_id == command.task_id:
            if same_command(in_flight, command):
                require(
                    not replies and effect is None,
                    "P-1",
                    f"a copy of the task in progress was answered on its own: {step}",
                )
            else:
                require(
                    len(replies) == 1 and getattr(replies[0], "reason", None) is NackReason.TASK_ID_REUSED,
                    "P-2",
                    f"{command!r} reuses the task_id in progress, got {step}",
                )
        elif recorded is not None and not isinstance(command, Status):
            require(effect is None, "P-2", f"second effect {effect!r} for answered task {command.task_id!r}")
            if same_command(recorded[0], command):
                require(
                    len(replies) == 1 and replies[0] is recorded[1],
                    "P-2",
                    f"duplicate of {command.task_id!r} got {replies}, not the recorded {recorded[1]!r}",
                )
            else:
                require(
                    len(replies) == 1 and getattr(replies[0], "reason", None) is NackReason.TASK_ID_REUSED,
                    "P-2",
                    f"{command!r} reuses answered task_id, got {step}",
                )
        if effect is not None and not isinstance(effect, StatusEffect):
            self.effects[command.task_id] = self.effects.get(command.task_id, 0) + 1
            require(self.effects[command.task_id] == 1, "P-2", f"second effect for {command.task_id!r}")
        if isinstance(effect, ExecuteEffect):
            require(state_before is W.ACTIVE, "P-7", f"Execute ran in {state_before.value}")
            require(not self.weights_garbage, "P-8", "Execute ran after a level-2 sleep, before a reload")
        if expect.kind == "ack" and expect.status is AckStatus.ALREADY:
            require(
                len(replies) == 1
                and isinstance(replies[0], Ack)
                and replies[0].status is AckStatus.ALREADY
                and effect is None,
                "P-4",
                f"{command!r} has nothing to do and must be an ALREADY no-op, got {step}",
            )

        self._compare(expect, command, replies, effect)
        if expect.kind == "ack" and expect.status is AckStatus.ALREADY:
            self.recorded[command.task_id] = (command, replies[0])
        if expect.kind == "nack" and expect.reason is NackReason.BUSY and isinstance(command, Execute):
            self.recorded[command.task_id] = (command, replies[0])  # kept: the BUSY hole (issue 11)
        if expect.kind != "cached":
            self._check_failure_text(replies)

    def _compare(self, expect: Expect, command: Command, replies: tuple[Reply, ...], effect: Effect | None) -> None:
        what = f"{command!r} in model state {self.model.state.value}"
        if expect.kind in ("ignore", "effect"):
            if replies:
                raise ModelMismatch(f"{what}: expected no reply, got {replies}")
            if expect.kind == "ignore":
                if effect is not None:
                    raise ModelMismatch(f"{what}: expected nothing, got {effect!r}")
                return
            if effect is None or effect.task_id != command.task_id or effect_tuple(effect) != expect.effect:
                raise ModelMismatch(f"{what}: expected effect {expect.effect}, got {effect!r}")
            return
        if effect is not None or len(replies) != 1:
            raise ModelMismatch(f"{what}: expected one {expect.kind} reply, got {replies} {effect!r}")
        (reply,) = replies
        decode(encode(reply))  # every reply is valid on the wire
        if reply.task_id != command.task_id:
            raise ModelMismatch(f"{what}: reply names task {reply.task_id!r}")
        if expect.kind == "cached":
            recorded = self.recorded.get(command.task_id)
            if recorded is None or reply is not recorded[1]:
                raise ModelMismatch(f"{what}: expected the recorded reply, got {reply!r}")
        elif expect.kind == "result":
            if not isinstance(reply, Result):
                raise ModelMismatch(f"{what}: expected a Result, got {reply!r}")
        elif expect.kind == "nack":
            if not isinstance(reply, Nack) or reply.reason is not expect.reason or reply.state is not expect.state:
                raise ModelMismatch(f"{what}: expected NACK {expect.reason} in {expect.state}, got {reply!r}")
            if reply.reason is NackReason.INVALID_STATE and reply.state.value not in reply.detail:
                raise PropertyViolation("P-11", f"INVALID_STATE does not name the state: {reply!r}")
        elif expect.kind == "ack":
            asleep = tuple(sorted(self.model.asleep))
            if (
                not isinstance(reply, Ack)
                or reply.status is not expect.status
                or reply.state is not expect.state
                or reply.asleep_tags != asleep
            ):
                raise ModelMismatch(
                    f"{what}: expected Ack {expect.status} in {expect.state} with {asleep}, got {reply!r}"
                )

    def _check_failure_text(self, replies: tuple[Reply, ...]) -> None:
        """P-11: once the worker failed, every new reply says why."""
        failure = self.model.failure
        for reply in replies:
            detail = getattr(reply, "detail", None)
            if failure and detail is not None:
                require(failure in detail, "P-11", f"reply after failure {failure!r} does not say so: {reply!r}")

    # ------------------------------------------------------------------ invariants

    @invariant()
    def agrees_with_the_model(self) -> None:
        w, m = self.worker, self.model
        if w.state is not m.state:
            raise ModelMismatch(f"worker in {w.state.value}, model in {m.state.value}")
        if w.residency.asleep != m.asleep or w.residency.weights_valid != m.weights_valid:
            raise ModelMismatch(
                f"worker asleep={sorted(w.residency.asleep)} valid={w.residency.weights_valid}, "
                f"model asleep={sorted(m.asleep)} valid={m.weights_valid}"
            )
        if w.busy != (m.pending is not None) or w.epoch != m.epoch:
            raise ModelMismatch(f"worker busy={w.busy} epoch={w.epoch}, model pending={m.pending} epoch={m.epoch}")

    @invariant()
    def execution_only_when_resident(self) -> None:
        pending = self.model.pending
        if pending is not None and isinstance(pending.command, Execute):
            require(
                self.worker.state is W.ACTIVE
                and not self.worker.residency.asleep
                and self.worker.residency.weights_valid,
                "P-7",
                "Execute in flight outside ACTIVE",
            )
        if self.weights_garbage:
            require(self.worker.state is not W.ACTIVE, "P-8", "ACTIVE with discarded weights")


def test_worker_against_the_reference_model() -> None:
    WorkerMachine.examples = 0
    run_state_machine_as_test(WorkerMachine, settings=settings())
    assert WorkerMachine.examples >= settings.default.max_examples, WorkerMachine.examples  # type: ignore[union-attr]


# ============================================================================ broken variants


def _machine_with(worker_cls: type[WorkerCore]) -> type[WorkerMachine]:
    return type(
        f"WorkerMachineWith{worker_cls.__name__}",
        (WorkerMachine,),
        {"make_worker": staticmethod(lambda **kw: worker_cls(0, **kw))},
    )


@pytest.mark.parametrize(
    ("worker_cls", "prop"),
    [(NoReplyCacheWorker, "P-2"), (NoEpochFenceWorker, "P-6")],
    ids=["no-reply-cache", "no-epoch-fence"],
)
def test_broken_worker_is_caught_by_the_invariants(worker_cls: type[WorkerCore], prop: str) -> None:
    with pytest.raises(PropertyViolation) as info:
        run_state_machine_as_test(_machine_with(worker_cls), settings=BROKEN)
    assert info.value.prop == prop, info.value
