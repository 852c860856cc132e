"""Stage-to-stage transfers under the lifecycle (P-22), as tables and two components.

A pipeline request crosses stages: the producer's ranks export its tensors into buckets they
hold (TransferOut), the consumer's ranks open and copy them (TransferIn) and its request runs
on them, and the producer drops them (TransferRelease). What the lifecycle asks of it:

- `TransferHolds` (a producer stage's component): the transfers whose buckets its ranks hold.
  While one is held the stage neither sleeps nor takes an update: its ranks' exported tensors
  came from the weights it holds now, and the buckets live outside the pools a sleep moves.
  A hold ends when its TransferRelease is answered; a restart (fresh ranks) holds nothing.
- `TRANSFER_TRANSITIONS` and `TransferCore`: one request's transfer, from the producer's
  export to the release of its buckets. Where it lands is decided by the consumer's own
  admission tables (`fsm/admission.py`): RUNNING lands; a sleeping consumer queues or is woken
  per its policy (QUEUE_RULES' AUTO_WAKE), a PAUSED one queues, a refusing one refuses. A
  request declared for a producer version runs only on it (a mismatch is refused); every end,
  a consumer that died included, answers the request exactly once and releases the producer's
  buckets. `tla/OmniTransfers.tla` checks the rules (its generated rows: TransferTable.tla).

No IO, no clock: the engine's pipeline (`engine/pipeline.py`) performs what `TransferCore`
asks and steps it with what happened.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from omni_core.fsm.admission import AdmissionPolicy, Admit, QueueAction, admit, queue_rule
from omni_core.fsm.stage_step import StageBusyError
from omni_core.fsm.table import Lifecycle, Transition
from omni_core.protocol import Command, StageState, TransferOut, TransferRelease

MAX_HELD_TRANSFERS = 64  # a producer stage's transfers in flight at once


class TransferHolds:
    """A producer stage's transfers in flight: request id -> the weights version they carry."""

    def __init__(self, max_held: int = MAX_HELD_TRANSFERS) -> None:
        self.max_held = max_held
        self.held: dict[str, int] = {}

    def room_problem(self, stage: str, request_id: str) -> str | None:
        if request_id in self.held or len(self.held) < self.max_held:
            return None
        return (
            f"stage {stage!r} holds {len(self.held)} transfers already (at most {self.max_held}); "
            "release one (TransferRelease) before exporting another"
        )

    def settled(self, command: Command, acked: bool, all_acked: bool, version: int) -> None:
        """A TransferOut or TransferRelease task ended. An export any rank ACKed is held (its
        buckets live there until released, even where other ranks refused); a release holds
        on until every rank has dropped its buckets."""
        if isinstance(command, TransferOut) and acked:
            self.held[command.request_id] = version
        elif isinstance(command, TransferRelease) and all_acked:
            self.held.pop(command.request_id, None)

    def require_none(self, stage: str, verb: str) -> None:
        """Refuse a sleep or an update while a transfer is in flight (P-22)."""
        if self.held:
            named = sorted(self.held)[:4]
            raise StageBusyError(
                f"stage {stage!r} cannot {verb}: {len(self.held)} transfer(s) in flight ({named}) hold its "
                "ranks' exported tensors; they land or are abandoned (TransferRelease) first, then retry"
            )

    def clear(self) -> None:
        """Fresh ranks hold nothing (a restart)."""
        self.held.clear()


class TransferState(str, enum.Enum):
    """Where one request's transfer is."""

    NEW = "NEW"
    OFFERING = "OFFERING"  # TransferOut sent to the producer
    HELD = "HELD"  # the producer holds the buckets: where do they land?
    QUEUED = "QUEUED"  # the consumer is not RUNNING and its admission waits
    WAKING = "WAKING"  # the consumer's policy wakes it for the transfer
    LANDING = "LANDING"  # TransferIn sent to the consumer
    RUNNING = "RUNNING"  # the consumer's request runs on what landed
    RELEASING = "RELEASING"  # answered; TransferRelease sent to the producer (and consumer)
    DONE = "DONE"  # released


T = TransferState
_WAITING = (T.HELD, T.QUEUED, T.WAKING)
_OPEN = (T.OFFERING, *_WAITING, T.LANDING, T.RUNNING)

TRANSFER_TRANSITIONS: tuple[Transition[T], ...] = (
    Transition("offer", (T.NEW,), T.OFFERING, "TransferOut sent to every producer rank"),
    Transition("offered", (T.OFFERING,), T.HELD, "every producer rank ACKed: the buckets are held"),
    Transition("offer_refused", (T.OFFERING,), T.RELEASING, "a producer rank refused: answered, released"),
    Transition(
        "version_refused", (T.HELD,), T.RELEASING, "the export's version is not the one declared: refused, released"
    ),
    Transition("land", (T.HELD, T.QUEUED), T.LANDING, "the consumer is RUNNING: TransferIn sent"),
    Transition("queue", (T.HELD,), T.QUEUED, "the consumer's admission queues (asleep under queue, PAUSED, busy)"),
    Transition("wake", (T.HELD, T.QUEUED), T.WAKING, "the consumer's policy wakes it (asleep under wake)"),
    Transition("woke", (T.WAKING,), T.HELD, "the wake ended: decide again"),
    Transition("refuse", _WAITING, T.RELEASING, "the consumer's admission refuses: answered, released"),
    Transition("landed", (T.LANDING,), T.RUNNING, "every consumer rank holds the copy: the request runs"),
    Transition("land_failed", (T.LANDING,), T.RELEASING, "a consumer rank refused or died: answered once"),
    Transition("answered", (T.RUNNING,), T.RELEASING, "the request's result or error: answered once"),
    Transition("expired", _OPEN, T.RELEASING, "the request's deadline passed: answered, abandoned"),
    Transition("released", (T.RELEASING,), T.DONE, "every rank dropped what it held for the request"),
)


class Land(str, enum.Enum):
    """What a transfer does at its consumer now: the consumer's admission, read for it."""

    LAND = "land"
    QUEUE = "queue"
    WAKE = "wake"
    REFUSE = "refuse"


def landing(state: StageState, policy: AdmissionPolicy) -> tuple[Land, str]:
    """Where a held transfer goes, by the consumer's ADMISSION row (and QUEUE_RULES for a
    queue a policy wakes): no table of its own, so a transfer is admitted as a request is."""
    row = admit(state, policy)
    if row.decision is Admit.RUN:
        return Land.LAND, row.why
    if row.decision is Admit.QUEUE:
        if queue_rule(state, policy).action is QueueAction.AUTO_WAKE:
            return Land.WAKE, queue_rule(state, policy).why
        return Land.QUEUE, row.why
    return Land.REFUSE, row.why


@dataclass(frozen=True)
class Answer:
    """The request's one answer: its output, or the error that ended it."""

    ok: bool
    output: Any = None
    error: str = ""
    producer_version: int | None = None


class TransferCore:
    """One pipeline request's transfer: legal moves by TRANSFER_TRANSITIONS, one answer."""

    def __init__(self, request_id: str, expect_version: int | None = None) -> None:
        self.request_id = request_id
        self.expect_version = expect_version
        self.lifecycle: Lifecycle[T] = Lifecycle(T, TRANSFER_TRANSITIONS, T.NEW)
        self.producer_version: int | None = None
        self.answer: Answer | None = None
        self.answers = 0  # how many times the request was answered: exactly once by DONE

    @property
    def state(self) -> T:
        return self.lifecycle.state

    def _fire(self, trigger: str) -> T:
        if not self.lifecycle.allows(trigger):
            raise StageBusyError(f"transfer {self.request_id!r} cannot {trigger} in {self.state.value}")
        return self.lifecycle.fire(trigger)

    def offer(self) -> None:
        self._fire("offer")

    def offered(self, producer_version: int) -> None:
        """The producer's ranks ACKed its export at `producer_version`: held; a request declared
        for another version is refused here, before anything lands."""
        self._fire("offered")
        self.producer_version = producer_version
        if self.expect_version is not None and producer_version != self.expect_version:
            self._end(
                "version_refused",
                f"request {self.request_id!r} was declared for producer weights version {self.expect_version}, "
                f"the producer exported at version {producer_version}; nothing landed: run it again on that "
                "version, or declare none",
            )

    def decide(self, consumer: StageState, policy: AdmissionPolicy) -> Land:
        """Where the held (or queued) transfer goes now, by the consumer's state and policy."""
        land, why = landing(consumer, policy)
        if land is Land.QUEUE and self.state is T.QUEUED:
            return land
        if land is Land.REFUSE:
            self._end("refuse", f"request {self.request_id!r}: the consumer is {consumer.value}: {why}")
        else:
            self._fire(land.value)
        return land

    def woke(self) -> None:
        self._fire("woke")

    def landed(self) -> None:
        self._fire("landed")

    def failed(self, error: str) -> None:
        """The offer, the landing or the request failed (a refusal, a consumer that died)."""
        trigger = {T.OFFERING: "offer_refused", T.LANDING: "land_failed", T.RUNNING: "answered"}.get(
            self.state, "refuse"
        )
        self._end(trigger, error)

    def finished(self, output: Any) -> None:
        self.answer = Answer(True, output, producer_version=self.producer_version)
        self.answers += 1
        self._fire("answered")

    def expired(self, budget_s: float) -> None:
        self._end("expired", f"request {self.request_id!r} did not finish within {budget_s:.3g} s; abandoned")

    def released(self) -> None:
        self._fire("released")

    def _end(self, trigger: str, error: str) -> None:
        self._fire(trigger)
        self.answer = Answer(False, error=error, producer_version=self.producer_version)
        self.answers += 1

    @property
    def release_due(self) -> bool:
        """Answered and not yet released: the producer's buckets must be dropped now."""
        return self.state is T.RELEASING
