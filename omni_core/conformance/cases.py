"""What a case is and what it works with; the cases themselves live in the `cases_*` modules,
one function each, naming the requirement of `specs/protocol.md` it checks.

A case talks to the worker through a `Ctx` (send, wait for the reply, check it) and raises
`CaseFailure` with what it sent and what came back. Cases of scope `shared` run on one
worker kept across cases and must leave it ACTIVE with nothing asleep (the runner checks,
and starts a fresh worker when a case did not); `own` cases start their own workers;
`consume` cases end the shared worker (Shutdown). `needs` lists capabilities from Hello a
case requires: a worker that does not declare them gets a reported skip, never a pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from omni_core.conformance.harness import CaseFailure, CaseSkip, Harness, Peer, SuiteOptions
from omni_core.conformance.requirements import REQUIREMENTS
from omni_core.protocol import (
    Ack,
    AckStatus,
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

Scope = Literal["shared", "own", "consume", "global"]
EPOCH_WINDOW = 64  # P-13's words, not the implementation's constant: a worker that widens it fails
# No runner can read this: the NUL byte is not valid in a path, a seed or a URL.
UNUSABLE_SOURCE = "\0omni-core-conformance: no runner can use this source"
WEIGHTS = "weights"
LEVEL2 = "level2"
PARTIAL_WAKE = "partial_wake"


@dataclass(frozen=True)
class Case:
    req: str  # "P-n"
    name: str  # short id, unique
    title: str
    run: Callable[[Ctx], None]
    needs: tuple[str, ...] = ()  # capabilities the worker must declare, else SKIP
    unless: tuple[str, ...] = ()  # capabilities whose presence makes the case not apply
    scope: Scope = "shared"

    @property
    def id(self) -> str:
        return f"{self.req}/{self.name}"


CASES: list[Case] = []


def case(
    req: str,
    name: str,
    title: str,
    *,
    needs: tuple[str, ...] = (),
    unless: tuple[str, ...] = (),
    scope: Scope = "shared",
) -> Callable[[Callable[[Ctx], None]], Callable[[Ctx], None]]:
    def register(fn: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        assert all(c.name != name for c in CASES), f"duplicate case name {name}"
        CASES.append(Case(req, name, title, fn, needs, unless, scope))
        return fn

    return register


def _a(name: str) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


class Ctx:
    """What a case works with: the worker, a way to start more, and checks that explain."""

    _task_ids = itertools.count(1)

    def __init__(
        self,
        case: Case,
        worker: Peer | None,
        harness: Harness | None,
        options: SuiteOptions,
        new_harness: Callable[[], Harness],
    ) -> None:
        self.case = case
        self._worker = worker
        self.harness = harness
        self.options = options
        self._new_harness = new_harness
        self.stray_note: str = ""  # global cases get the run's record here
        self.failing_factory: Callable[[str, int, int], Any] | None = None  # a worker that greets FAILED
        self.needs_reload_factory: Callable[[str, int, int], Any] | None = None  # one that greets NEEDS_RELOAD
        self.pressure_factory: Callable[[], Any] | None = None  # memory-pressure hooks (P-16)

    @property
    def worker(self) -> Peer:
        assert self._worker is not None, f"case {self.case.id} has no shared worker"
        return self._worker

    def own_harness(self) -> Harness:
        if self.harness is None:
            self.harness = self._new_harness()
        return self.harness

    # ------------------------------------------------------------------ commands

    def task(self, what: str) -> str:
        return f"{self.case.name}-{what}-{next(self._task_ids)}"

    def cmd(self, cls: type[Command], what: str = "", *, peer: Peer | None = None, **fields: Any) -> Any:
        peer = peer or self.worker
        fields.setdefault("epoch", peer.epoch)
        return cls(task_id=self.task(what or cls.__name__.lower()), **fields)

    def request(self, command: Command, peer: Peer | None = None) -> Message:
        return (peer or self.worker).request(command)

    def execute(self, peer: Peer | None = None) -> tuple[Execute, Message]:
        command = self.cmd(Execute, peer=peer, payload=self.options.execute_payload)
        return command, self.request(command, peer)

    def status(self, peer: Peer | None = None) -> Ack:
        return self.status_exchange(peer)[1]

    def status_exchange(self, peer: Peer | None = None) -> tuple[Status, Ack]:
        """A Status, checked against the reply before it: a Status changes nothing, so a state
        it reports that the previous answer did not is blamed on the Status (or on that answer's
        misreport), not on whatever the case sent before."""
        peer = peer or self.worker
        before = peer.last_stated
        command = self.cmd(Status, peer=peer)
        ack = self.ack(self.request(command, peer), command)
        if before is not None:
            said_tags = set(before.asleep_tags) if isinstance(before, Ack) else set(ack.asleep_tags)
            if ack.state is not before.state or set(ack.asleep_tags) != said_tags:
                said = f"{before.state.value}" + (f", asleep {sorted(said_tags)}" if isinstance(before, Ack) else "")
                raise CaseFailure(
                    f"the Status reports {ack.state.value}, asleep {sorted(ack.asleep_tags)}, but the answer just "
                    f"before it ({type(before).__name__} of {before.command} {before.task_id!r}) said {said}: a "
                    "Status must change nothing, so either this Status changed the worker or that answer misreported "
                    "its state",
                    sent=command,
                    got=ack,
                    expected=f"Ack of Status in {said}",
                )
        return command, ack

    # ------------------------------------------------------------------ checks

    def check(self, condition: bool, problem: str, *, sent: Any = None, got: Any = None, expected: Any = None) -> None:
        if not condition:
            raise CaseFailure(problem, sent=sent, got=got, expected=expected)

    def skip(self, reason: str) -> NoReturn:
        raise CaseSkip(reason)

    def ack(
        self, reply: Message, sent: Command, *, state: WorkerState | None = None, status: AckStatus | None = None
    ) -> Ack:
        name = type(sent).__name__
        want = (
            f"Ack of {name}"
            + (f" with state {state.value}" if state else "")
            + (f", status {status.value}" if status else "")
        )
        self.check(isinstance(reply, Ack), f"{name} was not acknowledged", sent=sent, got=reply, expected=want)
        assert isinstance(reply, Ack)
        self.check(
            reply.task_id == sent.task_id and reply.command == name,
            f"the Ack does not answer the {name} sent",
            sent=sent,
            got=reply,
            expected=want,
        )
        if state is not None:
            self.check(
                reply.state is state,
                f"{name} ended in state {reply.state.value}, not {state.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        if status is not None:
            self.check(
                reply.status is status,
                f"{name} was acknowledged with status {reply.status.value}, not {status.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        return reply

    def nack(
        self,
        reply: Message,
        sent: Any,
        reason: NackReason,
        *,
        state: WorkerState | None = None,
        names_state: bool = False,
        task_id: str | None = None,
    ) -> Nack:
        want = (
            f"Nack {reason.value}"
            + (f" in state {state.value}" if state else "")
            + (" whose detail names the state" if names_state else "")
        )
        self.check(
            isinstance(reply, Nack),
            f"expected a refusal ({reason.value}), got {_a(type(reply).__name__)}",
            sent=sent,
            got=reply,
            expected=want,
        )
        assert isinstance(reply, Nack)
        self.check(
            reply.reason is reason,
            f"refused with {reply.reason.value}, not {reason.value}",
            sent=sent,
            got=reply,
            expected=want,
        )
        if task_id is not None:
            self.check(
                reply.task_id == task_id,
                f"the refusal carries task_id {reply.task_id!r}, not {task_id!r}",
                sent=sent,
                got=reply,
                expected=want,
            )
        if state is not None:
            self.check(
                reply.state is state,
                f"the refusal says state {reply.state.value}, not {state.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        if names_state:
            self.check(
                reply.state.value in reply.detail,
                f"the refusal's detail does not name the state {reply.state.value}",
                sent=sent,
                got=reply,
                expected=want,
            )
        return reply

    def executed_or_runner_error(self, sent: Execute, reply: Message) -> None:
        """In ACTIVE an Execute runs: a Result, or the runner's own EXECUTE_ERROR (the payload
        is the user's), never a state refusal."""
        ok = isinstance(reply, Result) or (
            isinstance(reply, Nack) and reply.reason is NackReason.EXECUTE_ERROR and reply.state is WorkerState.ACTIVE
        )
        self.check(
            ok and reply.task_id == sent.task_id,
            "Execute in ACTIVE was not run",
            sent=sent,
            got=reply,
            expected="Result (or Nack EXECUTE_ERROR from the runner, state ACTIVE)",
        )

    def same_output(self, first: tuple[Execute, Message], what: str, peer: Peer | None = None) -> None:
        """Execute runs again and gives the output it gave `first` (where that ran at all)."""
        first_run, first_reply = first
        last_run, last = self.execute(peer)
        self.executed_or_runner_error(last_run, last)
        if isinstance(first_reply, Result):
            self.check(
                isinstance(last, Result) and last.output == first_reply.output,
                f"Execute's output changed {what}",
                sent=[first_run, last_run],
                got=last,
                expected=first_reply,
            )

    def sleep(self, level: int = 1, peer: Peer | None = None, **fields: Any) -> tuple[Sleep, Ack]:
        command = self.cmd(Sleep, peer=peer, level=level, **fields)
        return command, self.ack(self.request(command, peer), command)

    def wake(self, peer: Peer | None = None, **fields: Any) -> tuple[Wake, Ack]:
        command = self.cmd(Wake, peer=peer, **fields)
        return command, self.ack(self.request(command, peer), command)

    def back_to_active(self, peer: Peer | None = None) -> None:
        """Wake (and reload, after level 2) until ACTIVE: cases leave the worker usable."""
        _, woke = self.wake(peer)
        if woke.state is WorkerState.NEEDS_RELOAD:
            command = self.cmd(ReloadWeights, peer=peer)
            self.ack(self.request(command, peer), command, state=WorkerState.ACTIVE)
        else:
            self.check(
                woke.state is WorkerState.ACTIVE,
                f"Wake of every tag ended in {woke.state.value}",
                got=woke,
                expected="ACTIVE",
            )


def run_wide(c: Case) -> bool:
    """A check over the whole run's record, not of one requirement's cases: it always runs."""
    return c.scope == "global"


REQUIREMENT_ORDER = tuple(REQUIREMENTS)  # as the spec numbers them
_SCOPE_ORDER = {"shared": 0, "own": 1, "consume": 2, "global": 3}


def ordered_cases() -> list[Case]:
    """Shared-worker cases first, then own-worker ones, the Shutdown, and the run-wide check."""
    return sorted(CASES, key=lambda c: _SCOPE_ORDER[c.scope])
