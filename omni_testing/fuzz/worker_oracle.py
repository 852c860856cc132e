"""The fuzzer's oracle: between batches of fuzzed frames, commands of its own in lockstep. A
Status probe (the hang check), a return to ACTIVE (wake, reload) where fuzzed commands left
the worker elsewhere, an Execute whose result must equal the reference taken at start, every
few rounds a full sleep/wake cycle, and the worker's RSS sampled."""

from __future__ import annotations

from typing import Any, Protocol

from omni_core.protocol import (
    Ack,
    Command,
    Execute,
    Message,
    Profile,
    ReloadWeights,
    Result,
    Sleep,
    Status,
    Wake,
    WorkerState,
)
from omni_testing.fuzz.common import FuzzReport
from omni_testing.fuzz.generate import Frame
from omni_testing.fuzz.worker_expect import short
from omni_testing.fuzz.worker_spawn import LOG_TAIL_LINES, WorkerCrashed


class WorkerFuzzConfig(Protocol):
    """The settings the oracle reads (worker_target.py's WorkerFuzzConfig)."""

    lifecycle_every_rounds: int
    warmup_frames: int


REFERENCE_PAYLOAD = {"seed": 11, "batch": 2}


class OracleRounds:
    """The oracle's part of `WorkerFuzzer`, which provides the state and the link below."""

    config: WorkerFuzzConfig
    report: FuzzReport
    epoch: int  # the worker's epoch, followed by the core's fencing rule
    state: WorkerState  # last state a reply reported
    weights_dirty: bool  # a fuzzed ReloadWeights refilled them from another source
    reference: Any  # the reference Execute's output
    rounds: int

    def _lockstep(self, command: Command) -> Message:
        raise NotImplementedError

    def _task_id(self, kind: str) -> str:
        raise NotImplementedError

    def _violation(self, kind: str, detail: str, frame: Frame | None = None) -> None:
        raise NotImplementedError

    def _log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        raise NotImplementedError

    def _sample_rss(self, final: bool) -> None:
        raise NotImplementedError

    def _oracle_round(self, *, final: bool = False) -> None:
        self.rounds += 1
        status = self._lockstep(Status(task_id=self._task_id("probe"), epoch=self.epoch))
        self._expect_ack(status, "Status")
        self._to_active()
        self._check_execute()
        if self.rounds % self.config.lifecycle_every_rounds == 0:
            level = 1 if (self.rounds // self.config.lifecycle_every_rounds) % 2 else 2
            reply = self._lockstep(Sleep(task_id=self._task_id("sleep"), epoch=self.epoch, level=level))
            self._expect_ack(reply, "Sleep", WorkerState.SLEEPING)
            reply = self._lockstep(Wake(task_id=self._task_id("wake"), epoch=self.epoch))
            self._expect_ack(reply, "Wake", WorkerState.ACTIVE if level == 1 else WorkerState.NEEDS_RELOAD)
            if level == 2:
                reply = self._lockstep(ReloadWeights(task_id=self._task_id("reload"), epoch=self.epoch))
                self._expect_ack(reply, "ReloadWeights", WorkerState.ACTIVE)
            self._check_execute()
        if self.report.rss_before_bytes is None and self.report.frames_sent >= self.config.warmup_frames:
            self._warm_profiler()
        self._sample_rss(final)

    def _warm_profiler(self) -> None:
        """Start and stop the rank's profiler once before the RSS baseline: torch's profiler sets
        itself up at its first start (about 70 MiB on CPU, kept for the process's life), which
        counted as growth whenever a fuzzed Profile happened to start it after the warm-up."""
        for start in (True, False):
            reply = self._lockstep(
                Profile(
                    task_id=self._task_id("profile"), epoch=self.epoch, start=start, prefix="warmup" if start else None
                )
            )
            self._expect_ack(reply, "Profile")

    def _to_active(self) -> None:
        """Undo what fuzzed (valid) commands did: wake, reload, until ACTIVE with the seed's weights."""
        for _ in range(4):
            if self.state is WorkerState.ACTIVE and not self.weights_dirty:
                return
            if self.state in (WorkerState.SLEEPING, WorkerState.PARTIAL):
                reply = self._lockstep(Wake(task_id=self._task_id("wake"), epoch=self.epoch))
                self._expect_ack(reply, "Wake")
            elif self.state is WorkerState.NEEDS_RELOAD or (self.state is WorkerState.ACTIVE and self.weights_dirty):
                reply = self._lockstep(ReloadWeights(task_id=self._task_id("reload"), epoch=self.epoch))
                if self._expect_ack(reply, "ReloadWeights"):
                    self.weights_dirty = False
            else:
                self._violation(
                    "worker_state", f"the worker is {self.state.value} after fuzzed frames; log:\n{self._log_tail(10)}"
                )
                raise WorkerCrashed
        self._violation("worker_state", f"the worker did not return to ACTIVE (now {self.state.value})")

    def _check_execute(self) -> None:
        reply = self._lockstep(Execute(task_id=self._task_id("exec"), epoch=self.epoch, payload=REFERENCE_PAYLOAD))
        if not isinstance(reply, Result):
            self._violation("wrong_reply", f"the reference Execute got {short(reply)}")
        elif reply.output != self.reference:
            self._violation("wrong_result", "the reference Execute's output differs from the reference")
        else:
            self.report.valid_answered += 1

    def _expect_ack(self, reply: Message, command: str, state: WorkerState | None = None) -> bool:
        ok = isinstance(reply, Ack) and reply.command == command and (state is None or reply.state is state)
        if ok:
            self.report.valid_answered += 1
        else:
            want = f"Ack {command}" + (f" -> {state.value}" if state else "")
            self._violation(
                "wrong_reply", f"the oracle's {command} (epoch {self.epoch}) got {short(reply)}, expected {want}"
            )
        return ok
