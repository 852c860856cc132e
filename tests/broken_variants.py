"""Deliberately broken workers and stages. The stateful machines must catch each one by a
protocol-property check (a `PropertyViolation` naming the property), not by a crash."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, Phase, settings

from omni_core.fsm import BoundedCache, StageCore, StageStep, WorkerCore
from omni_core.fsm.worker import CommandReceived, WorkerInput, WorkerStep
from omni_core.protocol import Reply

# Deterministic and without shrinking: we only need to know that a failure is found.
BROKEN = settings(
    max_examples=500,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    print_blob=False,
)


class ForgetfulCache(BoundedCache):
    """A reply cache that stores nothing."""

    def get(self, key):  # type: ignore[no-untyped-def]
        return None


class NoReplyCacheWorker(WorkerCore):
    """Answers a duplicate as if it were new (P-2 broken)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.cache = ForgetfulCache(self.cache.max_entries)


class NoEpochFenceWorker(WorkerCore):
    """Treats a command from an older epoch as current (P-6 broken)."""

    def step(self, event: WorkerInput) -> WorkerStep:
        if isinstance(event, CommandReceived) and event.command.epoch < self.epoch:
            event = CommandReceived(msgspec.structs.replace(event.command, epoch=self.epoch))
        return super().step(event)


class NoEpochFenceStage(StageCore):
    """Applies a reply from any epoch as if it were current (P-6 broken)."""

    def _on_reply(self, reply: Reply, now: float) -> StageStep:
        return super()._on_reply(msgspec.structs.replace(reply, epoch=self.epoch), now)


class CommitsOnFirstAckStage(StageCore):
    """Commits as soon as one rank ACKs, as if the others had said the same (P-5 broken)."""

    def _on_reply(self, reply: Reply, now: float) -> StageStep:
        step = super()._on_reply(reply, now)
        task = self._task
        if task is not None and reply.rank in task.acks:
            for rank in self.ranks:
                if rank not in task.acks:
                    step = super()._on_reply(msgspec.structs.replace(reply, rank=rank), now)
        return step
