"""The memory gate (omni_core/workers/memory_gate.py) against tla/OmniSwap.tla, mechanically.

TLC dumps each swap model's full state graph; omni_core/formal/swap_graph.py turns every
behaviour into what the incoming stage's gate observed and did (queries and the free memory
they read, admissions from the running budget, maps and the driver's OOMs, the deadline).
Each distinct sequence is replayed through the real MemoryGate with a fake free-memory
source, a fake clock and a fake driver: the source answers each query with what the spec's
query read, the driver refuses exactly the maps the spec's driver refused, and the clock
passes the deadline exactly where the spec's deadline passed. The gate must make the same
queries (none where the spec admits from its budget), admit where the spec admits, wait
where it waits, and end AWAKE or REFUSED as the spec's stage does. It must also disagree
with the spec's bug models (oom_fatal, oom_refund), and mutated gates must disagree with the
spec: so the replay can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_core.formal import check, swap_graph
from omni_core.formal.tlc import TlcNotFoundError
from omni_core.workers import memory_gate
from omni_core.workers.device_memory import SimulatedOutOfMemory
from omni_core.workers.simulated_device import HolderList

CHUNK_BYTES = 1 << 20
WAIT_S = 5.0  # any positive wait: the replay's clock stands still until the spec's deadline
STUCK_POLLS = 4  # polls of a stage that can never get its memory before the replay stops it
SPEC = check.tla_dir() / "OmniSwap.tla"


class Disagree(AssertionError):
    """The gate did something the spec's behaviour does not do at that point."""


class _StillWaiting(Exception):
    """The spec's stage waits for ever here; the gate kept polling: stop the replay."""


class Replay:
    """A free-memory source, clock, sleep and driver that play one behaviour of the spec."""

    def __init__(self, events: tuple[tuple, ...], reserve_chunks: int) -> None:
        self.events = events
        self.at = 0
        self.reserve_bytes = reserve_chunks * CHUNK_BYTES
        self.now_s = 0.0
        self.last_free_bytes = 0
        self.stuck_polls = 0

    def _peek(self) -> tuple:
        return self.events[self.at] if self.at < len(self.events) else ("end",)

    def _take(self, kind: str) -> tuple:
        event = self._peek()
        if event[0] != kind:
            raise Disagree(
                f"the gate did {kind!r} where the spec's next step is {event} (step {self.at} of {self.events})"
            )
        self.at += 1
        return event

    def _deadline_if_next(self) -> None:
        if self._peek()[0] == "expire":
            self.now_s = 1e9  # memory_wait_s passes here, before the gate looks at the clock

    # FreeMemorySource
    def free_bytes(self) -> int:
        if self._peek()[0] == "stuck":
            self.stuck_polls += 1
            if self.stuck_polls > STUCK_POLLS:
                raise _StillWaiting
            return self.last_free_bytes
        self.last_free_bytes = self._take("query")[1] * CHUNK_BYTES
        self._deadline_if_next()
        return self.last_free_bytes

    def holders(self) -> HolderList:
        return HolderList(())

    def describe(self) -> str:
        return "the spec's device"

    def clock(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        if self.now_s > WAIT_S:
            raise Disagree(f"the gate slept after its deadline passed (step {self.at} of {self.events})")

    # the driver
    def allocate(self) -> None:
        if self._peek()[0] == "admit":
            self.at += 1  # from the running budget: the gate made no query (it would have failed)
        if self._take("map")[1]:
            return
        self._deadline_if_next()
        raise SimulatedOutOfMemory("out of memory (the spec's driver refused this map)")


def replay(events: tuple[tuple, ...], model: swap_graph.SwapModel, stage: str, gate_class=None) -> str:
    """Play one behaviour through a MemoryGate; the outcome, or raise Disagree."""
    source = Replay(events, model.reserve)
    gate = (gate_class or memory_gate.MemoryGate)(
        source, memory_wait_s=WAIT_S if model.may_wait else 0.0, clock=source.clock, sleep=source.sleep
    )
    try:
        for chunks in model.allocs[stage]:
            gate.admit(chunks * CHUNK_BYTES, source.allocate)
        outcome = "awake"
    except memory_gate.MemoryWaitExpired:
        source._take("expire")
        outcome = "refused"
    except _StillWaiting:
        source._take("stuck")
        outcome = "waiting"
    if source.at != len(events):
        raise Disagree(f"the gate ended {outcome} after step {source.at}; the spec goes on: {events}")
    return outcome


def disagreements(model, behaviours, stage, gate_class=None) -> list[str]:
    found = []
    for events in sorted(behaviours):
        try:
            replay(events, model, stage, gate_class)
        except Disagree as exc:
            found.append(str(exc))
    return found


def _graph(config: str, bug: str | None = None):
    path = check.tla_dir() / config
    try:
        dot = swap_graph.dump(SPEC, path, bug=bug)
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))
    return swap_graph.SwapModel.from_config(path.read_text()), dot


@pytest.fixture(scope="module")
def graphs() -> dict[str, tuple]:
    return {
        name: _graph(f"models/{name}.cfg")
        for name in ("swap", "swap_zero_wait", "swap_two", "swap_succeeds", "swap_two_serial")
    }


@pytest.mark.parametrize("name", ["swap", "swap_zero_wait", "swap_two", "swap_succeeds", "swap_two_serial"])
def test_every_behaviour_of_the_spec_replays_on_the_gate(graphs, name):
    model, dot = graphs[name]
    for stage in model.allocs:
        found = swap_graph.behaviours(model, dot, stage)
        # In swap_two_serial C's wake starts once B's ended: it meets A's end or B's, no race.
        assert len(found) >= (4 if name == "swap_two_serial" else 10), (name, stage, found)
        kinds = {e[0] for events in found for e in events}
        assert kinds >= {"query", "map"} and "fail" not in kinds, (name, stage, kinds)
        bad = disagreements(model, found, stage)
        assert not bad, f"{len(bad)} of {len(found)} behaviours of {name}/{stage} disagree; first: {bad[0]}"


def test_the_models_cover_budget_admissions_ooms_and_immediate_refusals(graphs):
    every = {
        name: {e for s in model.allocs for events in swap_graph.behaviours(model, dot, s) for e in events}
        for name, (model, dot) in graphs.items()
    }
    assert ("admit",) in every["swap"] and ("map", False) in every["swap"]
    assert any(e[0] == "query" and e[2] == "admit" for e in every["swap_two"])
    assert ("expire",) in every["swap_zero_wait"] and ("map", False) in every["swap_zero_wait"]
    assert ("expire",) not in every["swap_succeeds"]


@pytest.mark.parametrize("bug", ["oom_fatal", "oom_refund"])
def test_the_gate_disagrees_with_the_spec_bug_models(bug):
    model, dot = _graph(f"bugs/swap_{bug}.cfg", bug=bug)
    found = swap_graph.behaviours(model, dot, "B")
    assert disagreements(model, found, "B"), f"the gate replays every behaviour of bug {bug}"


def _mutant_gates():
    gate = memory_gate.MemoryGate

    class NoBudget(gate):  # queries before every allocation
        def acquire(self, nbytes: int) -> None:
            super().acquire(nbytes)
            self._budget_bytes = None

    class RefundOnOom(gate):  # keeps its stale budget after the driver refused a map
        def driver_refused(self, nbytes: int, error: BaseException) -> None:
            budget = self._budget_bytes
            super().driver_refused(nbytes, error)
            self._budget_bytes = (budget or 0) + nbytes

    class NoWaitAfterOom(gate):  # an OOM ends the wake at once
        def driver_refused(self, nbytes: int, error: BaseException) -> None:
            raise memory_gate.MemoryWaitExpired(
                "mutant", needed_bytes=nbytes, free_bytes=0, waited_s=0.0, holders=HolderList(())
            )

    return {"NoBudget": NoBudget, "RefundOnOom": RefundOnOom, "NoWaitAfterOom": NoWaitAfterOom}


@pytest.mark.parametrize("mutant", ["NoBudget", "RefundOnOom", "NoWaitAfterOom"])
def test_mutated_gates_disagree_with_the_spec(graphs, mutant):
    model, dot = graphs["swap"]
    found = swap_graph.behaviours(model, dot, "B")
    assert disagreements(model, found, "B", _mutant_gates()[mutant]), f"mutant {mutant} agrees with the spec"


def test_a_gate_that_ignores_the_reserve_disagrees(graphs):
    model, dot = graphs["swap"]
    assert model.reserve == 1
    no_reserve = swap_graph.SwapModel(model.cap, 0, model.may_wait, model.allocs)
    found = swap_graph.behaviours(model, dot, "B")
    assert disagreements(no_reserve, found, "B")


def test_spec_path_is_the_manifest_module():
    assert Path(SPEC).is_file()
    _, models = check.load_manifest(check.tla_dir())
    assert {m.spec for m in models if m.name.startswith(("swap", "bug/swap_"))} == {"OmniSwap.tla"}
