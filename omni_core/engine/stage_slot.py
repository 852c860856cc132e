"""What the orchestrator keeps for each stage beside its core: the rank processes, the callers
waiting on its tasks, requests and start, each rank's proven Hello and the state its latest
reply named; and the stage's part of `Engine.status()`."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

from omni_core.engine.launch import RankHandle
from omni_core.engine.spec import StageSpec
from omni_core.fsm import StageCore
from omni_core.protocol import Hello, WorkerState

# A rank's state in status() once its process is gone (beside WorkerState's values).
RANK_EXITED = "EXITED"


@dataclass
class StageSlot:
    spec: StageSpec
    core: StageCore
    procs: list[RankHandle] = field(default_factory=list)
    waiters: dict[str, list[Future]] = field(default_factory=dict)  # lifecycle task_id -> callers
    requests: dict[str, Future] = field(default_factory=dict)  # request_id -> caller
    start_waiters: list[Future] = field(default_factory=list)
    hellos: dict[int, Hello] = field(default_factory=dict)  # each rank's proven Hello of this epoch
    # rank -> the state its own latest reply named (Hello, Ack, Nack). The core keeps the
    # committed state; after a task failed part-way the ranks may be elsewhere, and status
    # shows where they said they are.
    reported: dict[int, WorkerState] = field(default_factory=dict)

    @classmethod
    def of(cls, spec: StageSpec) -> StageSlot:
        core = StageCore(
            spec.name,
            spec.ranks,
            tags=spec.tags,
            policy=spec.admission,
            queue_limit=spec.queue_limit,
            max_in_flight=spec.max_in_flight,
            wake_deadline_s=spec.deadline_s,
        )
        return cls(spec, core)

    @property
    def nodes(self) -> dict[int, str]:
        """rank -> the node its process runs on."""
        return {p.rank: p.node for p in self.procs}

    def fail_callers(self, error: BaseException) -> None:
        """Every caller waiting on this stage (requests, tasks, the start) gets `error`."""
        for future in [*self.requests.values(), *self.start_waiters, *(f for fs in self.waiters.values() for f in fs)]:
            settle(future, error=error)
        self.requests.clear()
        self.waiters.clear()
        self.start_waiters.clear()

    def status(self, swaps_waiting: list[dict[str, Any]]) -> dict[str, Any]:
        """The stage's entry in `Engine.status()`."""
        core = self.core
        return {
            "state": core.state.value,
            "epoch": core.epoch,
            "task_id": core.task_id,
            "admission": core.policy.value,
            "failure": core.failure,
            "queued": len(core.queue),
            "in_flight": len(core.in_flight),
            "counters": asdict(core.counters),
            "weights_version": core.weights_version,
            "asleep_tags": sorted(core.residency.asleep),
            "weights_valid": core.residency.weights_valid,
            "ranks": {p.rank: self.rank_status(p) for p in self.procs},
            "swaps_waiting": swaps_waiting,
        }

    def rank_status(self, proc: RankHandle) -> dict[str, Any]:
        """`state`: where the rank is, as far as the engine knows: EXITED once its process is
        gone, else the state its latest reply named; `committed_state`: the state the stage
        last committed for it (the two differ after a task failed part-way)."""
        alive = proc.is_alive()
        committed = self.core.rank_state.get(proc.rank)
        reported = self.reported.get(proc.rank)
        known = reported or committed
        state = RANK_EXITED if not alive else known.value if known else "-"
        hello = self.hellos.get(proc.rank)
        return {
            "pid": proc.pid,
            "alive": alive,
            "node": proc.node,
            "state": state,
            "committed_state": committed.value if committed else "-",
            "weights_version": self.core.rank_versions.get(proc.rank, 0),
            "backend": hello.backend if hello else "-",
            "backend_reason": hello.backend_reason if hello else "",
        }


def settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Give a caller its answer once; a future already settled keeps the first."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
