"""Engine.swap on the orchestrator's thread: both halves issued in one turn of the loop, so
that the outgoing stage's copies and the incoming stage's wait for memory start together,
and one incoming wake per device at a time (`IncomingSlots`): a swap into a held device
waits for it first, within its deadline. No IO; the halves go out through `lifecycle`.

The outgoing stage's Sleep tells each rank what the incoming stage wakes on its device
(`Sleep.incoming_bytes`, from the incoming ranks' Hello pool sizes): a rank whose device has
room for that keeps its memory until its last copy, so that its releases do not slow the
incoming copies; a rank whose device has not releases as its copies land (the incoming
stage waits for that memory). Only ranks that declare Capability.SWAP are told."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import msgspec

from omni_core.engine.calls import LifecycleCall, SwapRequest
from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.incoming import IncomingSlots, SwapCall
from omni_core.engine.report import LifecycleReport
from omni_core.engine.stage_slot import settle
from omni_core.fsm import InvariantViolation, StageCommandError
from omni_core.fsm.trace_records import IncomingFreed, IncomingHeld, TraceRecord
from omni_core.protocol import Command, Sleep

# Hand one lifecycle call to a stage's core: (the caller's future, stage name, the call).
Lifecycle = Callable[[Future[LifecycleReport], str, LifecycleCall], None]


# Per rank of a swap's outgoing stage, what the incoming stage wakes on its device: (out, in).
IncomingOf = Callable[[str, str], dict[int, int]]


# A shell record for a stage's trace (IncomingHeld, IncomingFreed), by the stage's name.
Traced = Callable[[str, TraceRecord], None]


class Swaps:
    def __init__(self, lifecycle: Lifecycle, incoming_of: IncomingOf, traced: Traced | None = None) -> None:
        self._lifecycle = lifecycle
        self._incoming_of = incoming_of
        self._traced = traced or (lambda stage, record: None)
        self._slots: IncomingSlots[SwapCall] = IncomingSlots()
        self._announced: set[tuple[str, str]] = set()  # incoming wakes whose IncomingHeld is written
        # (outgoing stage, its sleep's task id) -> rank -> Sleep.incoming_bytes, until the
        # sleep ends: one entry per swap in flight, so bounded by the stages.
        self._incoming: dict[tuple[str, str], dict[int, int]] = {}

    def offer(self, future: Future[None], request: SwapRequest, in_devices: frozenset[str]) -> None:
        """Issue the swap now, or queue it until `in_devices` are free (none: at once);
        `future` settles once both halves are sent."""
        swap = SwapCall(
            future,
            request.out_name,
            request.sleep,
            request.out_future,
            request.in_name,
            request.wake,
            request.in_future,
        )
        key = (request.in_name, request.wake.task_id)
        swap_id = request.wake.task_id.removesuffix("/in")
        if self._slots.offer(key, swap_id, in_devices, time.monotonic(), request.wake.deadline_s, swap):
            self._issue(key, swap)

    def advance(self) -> None:
        """Issue the waiting swaps whose devices are free, with what is left of their deadline
        (the wait for memory keeps its share of it); refuse those whose deadline passed."""
        while True:
            now = time.monotonic()
            due, expired = self._slots.advance(now)
            for entry in expired:
                settle(entry.item.future, error=self._slots.expired_error(entry))
            if not due:
                return
            for entry in due:
                self._issue(entry.key, entry.item.shortened(entry.deadline_at_s - now))

    def ended(self, stage: str, task_id: str) -> None:
        """A task of `stage` ended: when it was a swap's incoming wake, its devices are free."""
        self._release((stage, task_id))
        self._incoming.pop((stage, task_id), None)

    def _release(self, key: tuple[str, str]) -> None:
        self._slots.release(key)
        if key in self._announced:
            self._announced.discard(key)
            self._traced(key[0], IncomingFreed(key[1]))

    def with_incoming(self, stage: str, rank: int, command: Command) -> Command:
        """A swap's outgoing Sleep with what the incoming stage wakes on `rank`'s device;
        every other command as it is."""
        if not isinstance(command, Sleep):
            return command
        nbytes = self._incoming.get((stage, command.task_id), {}).get(rank, 0)
        return msgspec.structs.replace(command, incoming_bytes=nbytes) if nbytes else command

    def drain(self, error: BaseException) -> None:
        """Refuse every waiting swap with `error` (the engine is closing)."""
        for entry in self._slots.drain():
            settle(entry.item.future, error=error)
        self._incoming.clear()

    def waiting(self, in_stage: str) -> list[dict[str, Any]]:
        """The swaps into `in_stage` that wait, for status()."""
        return self._slots.waiting(in_stage)

    def _issue(self, key: tuple[str, str], swap: SwapCall) -> None:
        """The sleep goes first: when it is refused nothing was sent. When the wake is refused
        the sleep goes on (its outcome comes in `out_future`) and the refusal is the wake's."""
        out_key = (swap.out_name, swap.sleep.task_id)
        try:
            self._incoming[out_key] = self._incoming_of(swap.out_name, swap.in_name)
            self._lifecycle(swap.out_future, swap.out_name, swap.sleep)
        except InvariantViolation:
            raise
        except BaseException as exc:
            self._incoming.pop(out_key, None)
            self._release(key)
            settle(swap.future, error=_as_caller_error(exc))
            return
        if swap.wake.memory_wait_s > 0:
            self._announced.add(key)
            self._traced(swap.in_name, IncomingHeld(swap.wake.task_id, tuple(sorted(self._slots.held(key)))))
        try:
            self._lifecycle(swap.in_future, swap.in_name, swap.wake)
        except InvariantViolation:
            raise
        except BaseException as exc:  # the sleep goes on; the caller hears both halves
            self._release(key)
            settle(swap.in_future, error=_as_caller_error(exc))
        settle(swap.future, result=None)


def _as_caller_error(exc: BaseException) -> BaseException:
    return InvalidArgumentError(str(exc)) if isinstance(exc, StageCommandError) else exc
