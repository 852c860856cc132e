"""What crosses the simulated network (`network.py`): a message in flight, the seeded faults
that shape a run, the worker shell's memory report and profiler traces, and the error a
script's mistake raises."""

from __future__ import annotations

from dataclasses import dataclass

from omni_core.fsm.effects import Effect, ProfileEffect
from omni_core.protocol import MemoryReport
from omni_testing.describe import fmt_address

# What a worker shell reports around an effect; the stage trusts no ACK without one (P-12).
# The simulated ranks hold no memory, so the pools are empty.
NO_MEMORY = MemoryReport(pool_bytes_before={}, pool_bytes_after={})


class SimulationError(RuntimeError):
    """The caller asked for something the simulation cannot do (no such message, no effect in
    progress): a mistake in the script, not a finding about the cores."""


@dataclass(frozen=True)
class Faults:
    """Seeded faults. `loss`, `duplicate` and `delay` are probabilities for each message that
    enters the network; `reorder`, `crash` and `effect_error` shape `Simulator.settle`. The
    generator is consulted only for faults whose rate is above zero, so a fault-free run does
    not depend on its seed."""

    loss: float = 0.0  # the message never arrives
    duplicate: float = 0.0  # it arrives twice
    delay: float = 0.0  # it is held back for up to `max_delay_s`
    max_delay_s: float = 0.0
    reorder: bool = False  # settle delivers any message that may arrive, not the oldest
    crash: float = 0.0  # per settle step: a live rank crashes
    effect_error: float = 0.0  # a performed effect raises in the backend


@dataclass(frozen=True)
class Envelope:
    """One message in flight: its bytes and, for selecting and printing, what they say."""

    id: int
    sender: int | None  # a rank, or None for the stage
    to: int | None
    data: bytes
    kind: str  # the message's type name
    task_id: str
    epoch: int
    text: str  # `describe(message)`, kept for the transcript
    deliver_at: float = 0.0  # held back until the clock reaches this
    corrupt: bool = False

    @property
    def route(self) -> str:
        return f"{fmt_address(self.sender)}->{fmt_address(self.to)}"

    def line(self) -> str:
        return f"#{self.id} {self.route} {self.text}{' [corrupted]' if self.corrupt else ''}"


def sim_trace_paths(stage: str, rank: int, effect: Effect, now: float) -> tuple[str, ...]:
    """What a simulated rank's profiler stop writes: one trace, named as a real rank names it
    (time: the simulated clock)."""
    if not isinstance(effect, ProfileEffect) or effect.start:
        return ()
    return (f"/profiles/{stage}-rank{rank}-t{now:g}.json.gz",)


ECHO = object()  # perform(): an Execute answers with its own payload
