"""Generated command sequences, answered as the reference model answers them (P-11).

Hypothesis draws a sequence of lifecycle commands (Sleep of a level and tags, Wake of tags,
an unknown tag among them at times, ReloadWeights, Execute, Status, a copy of the command
before and another command under its task id: P-2) and sends it to the worker; each reply is
compared with the one omni-core's own worker core gives (`omni_core.fsm.worker.WorkerCore`,
built from the worker's Hello: its tags and capabilities, the tables `fsm/worker_table.py`
drive), whose effects the model completes at once. The reply's kind, state, Ack status,
asleep tags and Nack reason must agree; where the model says Result, the runner's own
`EXECUTE_ERROR` in ACTIVE may answer instead (the payload is the user's). So a rule the
tables gain is checked here without a case of its own.

Each sequence starts from ACTIVE with nothing asleep and ends back there. The run is
bounded (`SuiteOptions.model_examples` sequences of `MIN_COMMANDS` to `MAX_COMMANDS`) and
reproducible: the examples come from `SuiteOptions.model_seed`, which a failure names, with
the sequence that failed. Without hypothesis installed (it is a test dependency of
omni-core) the case is skipped, saying so.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omni_core.conformance.cases import Ctx, case
from omni_core.conformance.harness import CaseFailure
from omni_core.protocol import (
    Ack,
    Capability,
    Command,
    Execute,
    Message,
    Nack,
    NackReason,
    ReloadWeights,
    Result,
    Sleep,
    Status,
    Wake,
    WorkerState,
)

MIN_COMMANDS, MAX_COMMANDS = 6, 16  # per sequence: enough to reach every settled state and back
KINDS = ("sleep", "wake", "reload", "execute", "status", "again", "reuse")
MAX_BACK = 3  # a copy repeats one of the last four commands: a Status between them must change nothing
UNKNOWN_TAG = "conformance-unknown-tag"  # a tag no worker declares: refused UNKNOWN_TAG, no effect


def _capabilities(values: Iterable[str]) -> tuple[Capability, ...]:
    known = {c.value: c for c in Capability}
    return tuple(known[v] for v in values if v in known)


class Model:
    """The reference worker: omni-core's worker core, its effects completed at once."""

    def __init__(self, ctx: Ctx) -> None:
        # Imported here, when this case runs: importing the suite loads nothing of omni-core's
        # own worker (tests/conformance/test_targets.py), and a third party may run without it.
        from omni_core.fsm.worker import Loaded, WorkerCore

        worker = ctx.worker
        self.core = WorkerCore(
            worker.rank, tags=tuple(worker.tags), epoch=worker.epoch, capabilities=_capabilities(worker.capabilities)
        )
        self.core.step(Loaded())

    def answer(self, command: Command) -> Message:
        from omni_core.fsm.worker import CommandReceived, EffectCompleted

        step = self.core.step(CommandReceived(command))
        replies = list(step.replies)
        if step.effect is not None:
            output: Any = {"model": True} if isinstance(command, Execute) else ()
            replies += self.core.step(EffectCompleted(command.task_id, output=output)).replies
        (reply,) = replies  # exactly one terminal reply (P-1): the core's invariant
        return reply


# (kind, a Sleep's level, tags: None for every tag, how far back a copy goes)
Draw = tuple[str, int, tuple[str, ...] | None, int]


def _build(ctx: Ctx, draw: Draw, earlier: list[Command]) -> Command:
    kind, level, tags, back = draw
    last = earlier[-1] if earlier else None
    if kind == "again" and earlier:
        return earlier[-1 - min(back, len(earlier) - 1)]  # a copy: answered from the reply cache (P-2)
    if kind == "reuse" and last is not None:  # another command under a used task_id (P-2)
        if isinstance(last, Execute):
            return ReloadWeights(task_id=last.task_id, epoch=last.epoch)
        return Execute(task_id=last.task_id, epoch=last.epoch, payload=ctx.options.execute_payload)
    if kind == "sleep":
        return ctx.cmd(Sleep, level=level, tags=tags)
    if kind == "wake":
        return ctx.cmd(Wake, tags=tags)
    if kind == "reload":
        return ctx.cmd(ReloadWeights)
    if kind == "execute":
        return ctx.cmd(Execute, payload=ctx.options.execute_payload)
    return ctx.cmd(Status)


def _summary(reply: Message) -> str:
    if isinstance(reply, Ack):
        return f"Ack {reply.status.value} {reply.state.value} asleep={sorted(reply.asleep_tags)}"
    if isinstance(reply, Nack):
        return f"Nack {reply.reason.value} {reply.state.value}"
    return type(reply).__name__


def _agrees(got: Message, want: Message) -> bool:
    if isinstance(want, Result):
        return isinstance(got, Result) or (
            isinstance(got, Nack) and got.reason is NackReason.EXECUTE_ERROR and got.state is WorkerState.ACTIVE
        )
    return _summary(got) == _summary(want) and type(got) is type(want)


def run_sequence(ctx: Ctx, draws: list[Draw]) -> None:
    """Send the drawn commands, each checked against the model; then back to ACTIVE."""
    model, earlier, sent = Model(ctx), list[Command](), list[str]()
    for draw in draws:
        command = _build(ctx, draw, earlier)
        want = model.answer(command)
        got = ctx.request(command)
        sent.append(f"{type(command).__name__} {command.task_id}: {_summary(want)}")
        if not _agrees(got, want):
            steps = "\n".join(f"  {i}. {s}" for i, s in enumerate(sent, start=1))
            raise CaseFailure(
                f"command {len(sent)} of a generated sequence (seed {ctx.options.model_seed}) was answered "
                f"{_summary(got)}; the reference model answers {_summary(want)}. The sequence, with the "
                f"model's answers:\n{steps}",
                sent=command,
                got=got,
                expected=want,
            )
        earlier.append(command)
    ctx.back_to_active()


@case(
    "P-11",
    "generated_commands_match_the_tables",
    "generated sequences of Sleep, Wake, ReloadWeights, Execute, Status and copies: every reply as the "
    "reference model (the worker core on the tables) gives it",
)
def generated_commands_match_the_tables(ctx: Ctx) -> None:
    try:
        from hypothesis import HealthCheck, Phase, given, seed, settings
        from hypothesis import strategies as st
    except ImportError:
        ctx.skip("hypothesis is not installed (pip install hypothesis): no sequences to generate")
    if ctx.options.model_examples == 0:
        ctx.skip("model_examples is 0: no sequences asked for")
    tags = (*ctx.worker.tags, UNKNOWN_TAG)
    subsets = st.one_of(st.none(), st.sets(st.sampled_from(tags), min_size=1).map(lambda s: tuple(sorted(s))))
    draw = st.tuples(st.sampled_from(KINDS), st.sampled_from((1, 2)), subsets, st.integers(0, MAX_BACK))
    failures: list[Exception] = []

    @seed(ctx.options.model_seed)
    @settings(
        max_examples=ctx.options.model_examples,
        database=None,  # a third party's machine: the seed makes the run reproducible instead
        deadline=None,
        phases=(Phase.generate,),  # each example costs round trips: no shrinking, the seed replays it
        suppress_health_check=list(HealthCheck),
    )
    @given(st.lists(draw, min_size=MIN_COMMANDS, max_size=MAX_COMMANDS))
    def sequences(draws: list[Draw]) -> None:
        # Hypothesis only generates here: the first failure is kept and the rest skipped, so
        # that a worker left broken by it is not replayed into a different answer.
        if not failures:
            try:
                run_sequence(ctx, draws)
            except Exception as failure:  # the runner reports it, with the sequence where it has one
                failures.append(failure)

    sequences()
    if failures:
        raise failures[0]
