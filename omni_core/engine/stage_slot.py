"""What the orchestrator keeps for each stage beside its core: the rank processes, the callers
waiting on its tasks, requests and start, each rank's proven Hello and the state its latest
reply named; the link plan of a command it sends, and the stage's part of `Engine.status()`."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from omni_core.engine.adapter_view import AdapterView
from omni_core.engine.launch import RankHandle
from omni_core.engine.link_plan import LinkLedger, RankView, rank_view, share_bytes
from omni_core.engine.report import ExecuteResult, RestartReport
from omni_core.engine.spec import StageSpec
from omni_core.fsm import StageCore
from omni_core.fsm.trace_records import LinkPlanned, PlannedLink
from omni_core.protocol import Capability, Command, Hello, Sleep, Wake, WorkerState

# A rank's state in status() once its process is gone (beside WorkerState's values).
RANK_EXITED = "EXITED"


@dataclass
class StageSlot:
    spec: StageSpec
    core: StageCore
    procs: list[RankHandle] = field(default_factory=list)
    # lifecycle task_id -> callers: each holds a LifecycleReport, a ProfileCall's a ProfileReport
    waiters: dict[str, list[Future[Any]]] = field(default_factory=dict)
    requests: dict[str, Future[ExecuteResult]] = field(default_factory=dict)  # request_id -> caller
    start_waiters: list[Future[RestartReport]] = field(default_factory=list)
    hellos: dict[int, Hello] = field(default_factory=dict)  # each rank's proven Hello of this epoch
    # rank -> the state its own latest reply named (Hello, Ack, Nack). The core keeps the
    # committed state; after a task failed part-way the ranks may be elsewhere, and status
    # shows where they said they are.
    reported: dict[int, WorkerState] = field(default_factory=dict)
    adapters: AdapterView = field(default_factory=AdapterView)  # P-20: as rank 0 listed them last

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
            dummy_weights=spec.dummy_weights,
        )
        return cls(spec, core)

    @property
    def nodes(self) -> dict[int, str]:
        """rank -> the node its process runs on."""
        return {p.rank: p.node for p in self.procs}

    def rank_view(self, rank: int, engine_visible: str | None, relay_peers: tuple[int, ...] = ()) -> RankView:
        spec = self.spec
        return rank_view(spec.devices[rank] if spec.devices else None, engine_visible, spec.device, relay_peers)

    def with_links(
        self,
        ledger: LinkLedger,
        stages: Iterable[StageSlot],
        rank: int,
        command: Command,
        engine_visible: str | None,
    ) -> Command:
        """A Sleep or Wake with the rank's link plan (P-18), planned once per task over the
        node's idle GPUs (`stages`' ranks with no task, engine/link_plan.py); every other
        command as it is."""
        if not isinstance(command, (Sleep, Wake)) or not self.spec.multi_path:
            return command
        plan = ledger.planned(self.spec.name, command.task_id)
        if plan is None:  # the task's first send: every rank's view and the busy GPUs, once
            views = {
                r: self.rank_view(r, engine_visible, hello.relay_peers)
                for r, hello in self.hellos.items()
                if Capability.MULTI_PATH in hello.capabilities
            }
            # This stage's GPUs (its ranks without MULTI_PATH, unplanned, copy over their own
            # links too) and those of every stage with a task in flight.
            busy = {
                other.rank_view(r, engine_visible).own_gpu
                for other in (self, *stages)
                if other is self or other.core.task_id is not None
                for r in range(other.spec.ranks)
            }
            plan = ledger.plan(self.spec.name, command.task_id, views, busy)
        links = plan.links.get(rank)
        return msgspec.structs.replace(command, links=links) if links else command

    def link_record(self, rank: int, command: Command, engine_visible: str | None) -> LinkPlanned | None:
        """A Sleep or Wake as sent to `rank` (after `with_links` and the swap's incoming
        bytes), with what its plan was made from, for the trace; None for other commands."""
        if not isinstance(command, (Sleep, Wake)):
            return None
        hello = self.hellos.get(rank)
        capabilities = hello.capabilities if hello else ()
        view = self.rank_view(rank, engine_visible, hello.relay_peers if hello else ())
        pools = hello.pool_bytes if hello else {}
        pool_bytes = sum(n for t, n in pools.items() if command.tags is None or t in command.tags)
        split = share_bytes(pool_bytes, [s.share for s in command.links])
        return LinkPlanned(
            command.task_id,
            rank,
            type(command).__name__,
            visible=view.visible,
            own=view.own,
            relay_peers=view.relay_peers,
            multi_path=self.spec.multi_path and Capability.MULTI_PATH in capabilities,
            swap=Capability.SWAP in capabilities,
            pool_bytes=pool_bytes,
            links=tuple(PlannedLink(s.peer, s.share, n) for s, n in zip(command.links, split, strict=True)),
            incoming_bytes=command.incoming_bytes if isinstance(command, Sleep) else 0,
        )

    def asleep_bytes(self) -> dict[int, int]:
        """Per rank, what its Hello's pools hold in the tags asleep now: what a wake of every
        tag maps (0 for a rank whose Hello reported no pool sizes)."""
        asleep = self.core.residency.asleep
        return {r: sum(n for t, n in hello.pool_bytes.items() if t in asleep) for r, hello in self.hellos.items()}

    def declares(self, rank: int, capability: Capability) -> bool:
        hello = self.hellos.get(rank)
        return hello is not None and capability in hello.capabilities

    def fail_callers(self, error: BaseException) -> None:
        """Every caller waiting on this stage (requests, tasks, the start) gets `error`."""
        callers: list[Future[Any]] = [*self.requests.values(), *self.start_waiters]
        for future in [*callers, *(f for fs in self.waiters.values() for f in fs)]:
            settle(future, error=error)
        self.requests.clear()
        self.waiters.clear()
        self.start_waiters.clear()

    def status(self, swaps_waiting: list[dict[str, Any]]) -> dict[str, Any]:
        """The stage's entry in `Engine.status()`."""
        core = self.core
        return {
            "state": core.state.value,
            "paused": core.paused,  # a pause holds until resume(), asleep or not
            "epoch": core.epoch,
            "task_id": core.task_id,
            "admission": core.policy.value,
            "failure": core.failure,
            "queued": len(core.queue),
            "in_flight": len(core.in_flight),
            "counters": asdict(core.counters),
            "weights_version": core.weights_version,
            # Where that version lives ('checkpoint', 'disk', 'memory'), the floor a restart set
            # when it lived in memory only, and the version a from_checkpoint restart dropped.
            "weights_source": core.versions.kind,
            "version_floor": core.versions.floor,
            "version_reset_from": core.versions.last_reset.from_version if core.versions.last_reset else None,
            "asleep_tags": sorted(core.residency.asleep),
            "weights_valid": core.residency.weights_valid,
            "ranks": {p.rank: self.rank_status(p) for p in self.procs},
            "swaps_waiting": swaps_waiting,
            "adapters": self.adapters.rows(core.epoch, core.residency.asleep, self.spec.tags),
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
            "pool_bytes": dict(self.core.rank_pool_bytes.get(proc.rank, {})),
            "runner_counters": dict(self.core.rank_counters.get(proc.rank, {})),
            "backend": hello.backend if hello else "-",
            "backend_reason": hello.backend_reason if hello else "",
        }


def settle(future: Future[Any], *, result: Any = None, error: BaseException | None = None) -> None:
    """Give a caller its answer once; a future already settled keeps the first."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
