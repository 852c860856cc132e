"""engine/incoming.py: one incoming wake per device at a time, first come first served,
bounded, each waiting swap refused once its deadline passes (naming what it waited for)."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from omni_core.engine import StageSpec
from omni_core.engine.errors import TaskAbandonedError
from omni_core.engine.incoming import IncomingSlots, SwapCall, incoming_bytes, stage_devices
from omni_core.engine.orchestrator import Orchestrator
from omni_core.fsm.inputs import SleepCall, WakeCall
from omni_core.protocol import Capability
from omni_core.workers.simulated_device import SimulatedDevice

GPU0, GPU1 = frozenset({"gpu:0"}), frozenset({"gpu:1"})


def test_stage_devices_per_rank_gpu_simulated_directory_or_none():
    sim = SimulatedDevice("/tmp/dev/./gpu0", 1 << 20)
    assert stage_devices(StageSpec("a", simulated_device=sim), None) == {"simulated:/tmp/dev/gpu0"}
    assert stage_devices(StageSpec("a"), "0,1") == frozenset()  # CPU: nothing to run out of
    assert stage_devices(StageSpec("a", ranks=2, device="cuda", devices=("3,4", "5")), None) == {"gpu:3", "gpu:5"}
    assert stage_devices(StageSpec("a", device="cuda:1"), "6,7") == {"gpu:7"}
    assert stage_devices(StageSpec("a", device="cuda:1"), None) == {"gpu:1"}


def test_each_outgoing_rank_is_told_what_the_incoming_ranks_on_its_device_wake():
    out = StageSpec("a", ranks=3, device="cuda", devices=("0", "1", "2"))
    into = StageSpec("b", ranks=3, device="cuda", devices=("1", "1", "3"))
    # b's ranks 0 and 1 both wake on GPU 1; nothing of b on GPUs 0 and 2; b's GPU 3 holds no a
    assert incoming_bytes(out, into, {0: 5, 1: 7, 2: 11}, None) == {1: 12}
    assert incoming_bytes(out, into, {0: 0, 1: 0, 2: 11}, None) == {}  # nothing asleep there
    sim = SimulatedDevice("/tmp/dev/gpu0", 1 << 20)
    assert incoming_bytes(StageSpec("a", simulated_device=sim), StageSpec("b", simulated_device=sim), {0: 9}, None) == {
        0: 9
    }
    assert incoming_bytes(StageSpec("a"), StageSpec("b"), {0: 9}, None) == {}  # CPU: no device shared


def test_a_second_swap_into_a_held_device_waits_until_the_first_wake_ends():
    slots: IncomingSlots[str] = IncomingSlots()
    assert slots.offer(("b", "s1/in"), "s1", GPU0, 0.0, 10.0, "first")
    assert slots.offer(("x", "s0/in"), "s0", GPU1, 0.0, 10.0, "other GPU")  # another device: at once
    assert not slots.offer(("c", "s2/in"), "s2", GPU0, 1.0, 10.0, "second")
    assert not slots.offer(("a", "s3/in"), "s3", GPU0, 1.0, 10.0, "third")
    assert slots.waiting("c") == [
        {"swap": "s2", "behind": "device gpu:0, held by the incoming wake of swap 's1' into stage 'b'"}
    ]
    assert slots.advance(5.0) == ([], [])
    slots.release(("b", "other/in"))  # another task of stage b ending frees nothing
    slots.release(("x", "s0/in"))
    assert slots.advance(5.0) == ([], [])
    slots.release(("b", "s1/in"))
    due, expired = slots.advance(5.0)
    assert [e.item for e in due] == ["second"] and expired == []  # one at a time, in arrival order
    assert slots.waiting("a")[0]["behind"].endswith("swap 's2' into stage 'c'")
    slots.release(due[0].key)
    assert [e.item for e in slots.advance(5.0)[0]] == ["third"]


def test_first_come_first_served_on_a_shared_device():
    slots: IncomingSlots[str] = IncomingSlots()
    assert slots.offer(("b", "s1/in"), "s1", GPU0, 0.0, 10.0, "first")
    assert not slots.offer(("c", "s2/in"), "s2", GPU0 | GPU1, 0.0, 10.0, "both")
    # GPU1 is free, but s2 came first and waits for it too: s3 waits behind it.
    assert not slots.offer(("d", "s3/in"), "s3", GPU1, 0.0, 10.0, "gpu1")
    assert "for which swap 's2' waits already" in slots.waiting("d")[0]["behind"]
    slots.release(("b", "s1/in"))
    assert [e.item for e in slots.advance(1.0)[0]] == ["both"]


def test_a_waiting_swap_is_refused_at_its_deadline_naming_the_swap_it_waited_for():
    slots: IncomingSlots[str] = IncomingSlots()
    assert slots.offer(("b", "s1/in"), "s1", GPU0, 0.0, 10.0, "first")
    assert not slots.offer(("c", "s2/in"), "s2", GPU0, 2.0, 3.0, "second")
    assert slots.advance(4.9) == ([], [])
    due, expired = slots.advance(5.0)
    assert due == [] and [e.item for e in expired] == ["second"] and slots.waiting("c") == []
    message = str(slots.expired_error(expired[0]))
    assert "swap 's2' did not start within its deadline of 3.000 s" in message
    assert "held by the incoming wake of swap 's1' into stage 'b'" in message
    # Even when the device frees at the same moment, a swap past its deadline is not issued.
    assert not slots.offer(("c", "s3/in"), "s3", GPU0, 5.0, 1.0, "late")
    slots.release(("b", "s1/in"))
    assert [e.item for e in slots.advance(6.0)[1]] == ["late"]


def test_the_queue_is_bounded_and_drained_at_shutdown():
    slots: IncomingSlots[int] = IncomingSlots(limit=2)
    assert slots.offer(("b", "s1/in"), "s1", GPU0, 0.0, 10.0, 0)
    for k in (1, 2):
        assert not slots.offer(("c", f"q{k}/in"), f"q{k}", GPU0, 0.0, 10.0, k)
    with pytest.raises(
        TaskAbandonedError,
        match=r"swap 'q3' refused: 2 swaps already wait .*device gpu:0, held by "
        r"the incoming wake of swap 's1'",
    ):
        slots.offer(("c", "q3/in"), "q3", GPU0, 0.0, 10.0, 3)
    assert [e.item for e in slots.drain()] == [1, 2] and slots.waiting("c") == []


def test_a_copy_of_a_wake_in_flight_waits_for_it():
    slots: IncomingSlots[str] = IncomingSlots()
    assert slots.offer(("b", "s1/in"), "s1", GPU0, 0.0, 10.0, "first")
    assert not slots.offer(("b", "s1/in"), "s1", GPU0, 0.0, 10.0, "copy")
    slots.release(("b", "s1/in"))
    assert [e.item for e in slots.advance(1.0)[0]] == ["copy"]


def test_a_swap_issued_late_gets_what_is_left_of_its_deadline_and_keeps_the_waits_share():
    call = SwapCall(
        Future(), "a", SleepCall("s/out", 1, None, 10.0), Future(), "b", WakeCall("s/in", None, 10.0, 4.0), Future()
    )
    late = call.shortened(2.5)
    assert (late.sleep.deadline_s, late.wake.deadline_s, late.wake.memory_wait_s) == (2.5, 2.5, 1.0)
    assert (late.sleep.task_id, late.wake.task_id, late.future) == ("s/out", "s/in", call.future)


class _Slot:
    """What Orchestrator._incoming_of reads of a stage: its spec, which ranks declared
    'swap' in their Hello, and the bytes each incoming rank's wake maps."""

    def __init__(self, spec: StageSpec, swap_ranks: set[int], asleep: dict[int, int]) -> None:
        self.spec, self.swap_ranks, self.asleep = spec, swap_ranks, asleep

    def declares(self, rank: int, capability: Capability) -> bool:
        return capability is Capability.SWAP and rank in self.swap_ranks

    def asleep_bytes(self) -> dict[int, int]:
        return self.asleep


def test_only_ranks_that_declared_swap_are_told_the_incoming_bytes():
    """A worker that predates Sleep.incoming_bytes refuses a Sleep carrying it (BAD_MESSAGE):
    the hint goes only to ranks whose Hello declared 'swap', though every rank shares a GPU."""
    out = _Slot(StageSpec("a", ranks=2, device="cuda", devices=("0", "1")), {0}, {})
    into = _Slot(StageSpec("b", ranks=2, device="cuda", devices=("0", "1")), set(), {0: 5, 1: 7})
    slots = {"a": out, "b": into}
    orchestrator = SimpleNamespace(stage=slots.__getitem__, _engine_visible=None)
    assert Orchestrator._incoming_of(orchestrator, "a", "b") == {0: 5}  # rank 1 did not declare it
    out.swap_ranks = set()
    assert Orchestrator._incoming_of(orchestrator, "a", "b") == {}


def test_a_waiting_incoming_wake_is_traced_holding_its_devices_until_its_task_ends():
    """What trace validation checks one incoming wake per device by (formal/trace_admission.py):
    IncomingHeld before the wake is issued, IncomingFreed when its task ended; a swap whose
    wake may not wait holds nothing and writes neither."""
    from omni_core.engine.calls import SwapRequest
    from omni_core.engine.swaps import Swaps
    from omni_core.fsm import trace_records as T

    written: list[tuple[str, object]] = []
    issued: list[tuple[str, str]] = []

    def lifecycle(future, name, event):  # type: ignore[no-untyped-def]
        issued.append((name, event.task_id))
        written.append((name, f"issue {event.task_id}"))

    swaps = Swaps(lifecycle, lambda out, into: {}, lambda stage, record: written.append((stage, record)))

    def swap(task: str, wait_s: float) -> SwapRequest:
        sleep = SleepCall(f"{task}/out", 1, None, 10.0)
        return SwapRequest("a", sleep, Future(), "b", WakeCall(f"{task}/in", None, 10.0, wait_s), Future())

    swaps.offer(Future(), swap("s1", 5.0), GPU0)
    assert written == [
        ("a", "issue s1/out"),
        ("b", T.IncomingHeld("s1/in", ("gpu:0",))),
        ("b", "issue s1/in"),
    ]
    swaps.ended("b", "s1/in")
    assert written[-1] == ("b", T.IncomingFreed("s1/in"))
    swaps.ended("b", "s1/in")  # once only
    assert written.count(("b", T.IncomingFreed("s1/in"))) == 1
    written.clear()
    swaps.offer(Future(), swap("s2", 0.0), frozenset())
    assert written == [("a", "issue s2/out"), ("b", "issue s2/in")]
