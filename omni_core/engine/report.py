"""What sleep/wake/reload return: the committed state and every rank's own figures; what
profile returns: every rank's trace files."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from omni_core.fsm.stage import TaskOutcome
from omni_core.protocol import Ack, AdapterInfo, VersionSpan


@dataclass(frozen=True)
class ExecuteResult:
    """A request's answer with the weights that produced it (`Engine.execute(with_version=True)`):
    every rank answered on `weights_version`, the stage's committed version (P-17)."""

    output: Any
    weights_version: int
    adapter: str | None = None  # the LoRA adapter it ran with and that adapter's version (P-20)
    adapter_version: int = 0
    # Held through an update (pause mode keep): tokens from each span's start_token on were
    # computed under its weights_version (empty: all under `weights_version`); the tokens a
    # hold with clear_cache discarded before the request restarted from its prompt.
    version_spans: tuple[VersionSpan, ...] = ()
    discarded_tokens: int = 0

    def spans_json(self) -> list[dict[str, int]]:
        """The spans as JSON objects, for the HTTP answers."""
        return [{"weights_version": s.weights_version, "start_token": s.start_token} for s in self.version_spans]


@dataclass(frozen=True)
class RankReport:
    rank: int
    state: str
    status: str
    duration_s: float
    pool_bytes_before: dict[str, int] = field(default_factory=dict)
    pool_bytes_after: dict[str, int] = field(default_factory=dict)
    process_bytes_before: int | None = None
    process_bytes_after: int | None = None
    process_bytes_source: str = "none"
    weights_version: int = 0  # the version this rank held after the command (P-17)
    shared: Any = None  # ShareWeights: the ShmSource/IpcSource holding this rank's weights
    # A reload or an update: the runner's weight-derived caches dropped before the Ack
    caches_dropped: tuple[str, ...] = ()
    # The adapter commands (P-20): every adapter the rank holds after it, and those evicted.
    adapters: tuple[AdapterInfo, ...] = ()
    adapters_evicted: tuple[str, ...] = ()

    @property
    def freed_bytes(self) -> int:
        """Pool bytes this command released, summed over the pools that shrank; never
        negative (a wake's mapped bytes are `restored_bytes`)."""
        return sum(max(0, n - self.pool_bytes_after.get(tag, 0)) for tag, n in self.pool_bytes_before.items())

    @property
    def restored_bytes(self) -> int:
        """Pool bytes this command mapped back, summed over the pools that grew; never negative."""
        return sum(max(0, n - self.pool_bytes_before.get(tag, 0)) for tag, n in self.pool_bytes_after.items())

    @classmethod
    def from_ack(cls, ack: Ack) -> RankReport:
        m = ack.memory
        return cls(
            rank=ack.rank,
            state=ack.state.value,
            status=ack.status.value,
            duration_s=ack.duration_s,
            pool_bytes_before=dict(m.pool_bytes_before) if m else {},
            pool_bytes_after=dict(m.pool_bytes_after) if m else {},
            process_bytes_before=m.process_bytes_before if m else None,
            process_bytes_after=m.process_bytes_after if m else None,
            process_bytes_source=m.process_bytes_source if m else "none",
            weights_version=ack.weights_version,
            shared=ack.shared,
            caches_dropped=tuple(ack.caches_dropped),
            adapters=tuple(ack.adapters),
            adapters_evicted=tuple(ack.adapters_evicted),
        )


@dataclass(frozen=True)
class LifecycleReport:
    """Outcome of one sleep, wake or reload: `status` is OK, or ALREADY when nothing was sent."""

    stage: str
    task_id: str
    command: str
    status: str
    state: str
    duration_s: float
    ranks: dict[int, RankReport]
    weights_version: int = 0  # the stage's weights version after the task (P-17)

    @property
    def adapters(self) -> tuple[AdapterInfo, ...]:
        """An adapter command's listing (P-20), as the lowest rank holds them (ranks of one
        stage hold the same adapters: every adapter command goes to all of them)."""
        return self.ranks[min(self.ranks)].adapters if self.ranks else ()

    @classmethod
    def from_outcome(cls, stage: str, outcome: TaskOutcome, weights_version: int = 0) -> LifecycleReport:
        return cls(
            stage=stage,
            task_id=outcome.task_id,
            command=outcome.command,
            status=outcome.status.value,
            state=outcome.state.value,
            duration_s=outcome.duration_s,
            ranks={r: RankReport.from_ack(a) for r, a in sorted(outcome.acks.items())},
            weights_version=weights_version,
        )


@dataclass(frozen=True)
class RestartReport:
    """Outcome of a restart: the fresh ranks' epoch and state, and what became of the version.

    `weights_version` is the version the stage holds now; `version_floor` is above 0 when the
    version it held lived in memory only (state NEEDS_RELOAD: nothing runs until an update at or
    above the floor); `version_reset_from` names the version a `from_checkpoint` restart dropped
    (None when it dropped none); `weights_source` is where the version was loaded from
    ('checkpoint', 'disk', or 'memory' when lost)."""

    stage: str
    state: str
    epoch: int
    weights_version: int
    version_floor: int = 0
    version_reset_from: int | None = None
    weights_source: str = "checkpoint"
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class ProfileReport:
    """Outcome of one profile start or stop. `status` is ALREADY when every rank was already
    where the call asked (profiling, or not); `paths` maps rank -> the traces its stop wrote
    (empty on a start). A path exists once its rank has compressed it (`missing`)."""

    stage: str
    task_id: str
    start: bool
    status: str
    state: str
    duration_s: float
    paths: dict[int, tuple[str, ...]]

    @property
    def all_paths(self) -> tuple[str, ...]:
        return tuple(p for _, paths in sorted(self.paths.items()) for p in paths)

    def missing(self) -> tuple[str, ...]:
        """The traces not (yet) on disk: compression writes a temporary name and renames it,
        so a path that exists is complete. Seen from this host: ranks on other hosts write
        theirs there."""
        return tuple(p for p in self.all_paths if not os.path.exists(p))

    def wait_for_files(self, timeout_s: float, *, poll_s: float = 0.05) -> tuple[str, ...]:
        """Wait until every trace exists or `timeout_s` passes; return those still missing."""
        deadline = time.monotonic() + timeout_s
        missing = self.missing()
        while missing and time.monotonic() < deadline:
            time.sleep(poll_s)
            missing = self.missing()
        return missing

    @classmethod
    def from_outcome(cls, stage: str, outcome: TaskOutcome, start: bool) -> ProfileReport:
        return cls(
            stage=stage,
            task_id=outcome.task_id,
            start=start,
            status=outcome.status.value,
            state=outcome.state.value,
            duration_s=outcome.duration_s,
            paths={r: tuple(a.trace_paths) for r, a in sorted(outcome.acks.items())},
        )


@dataclass(frozen=True)
class SwapReport:
    """Both halves of one `Engine.swap`: the outgoing stage's sleep and the incoming stage's
    wake, which ran at the same time; `duration_s` is from issuing both to the later end."""

    task_id: str
    outgoing: LifecycleReport
    incoming: LifecycleReport
    duration_s: float
