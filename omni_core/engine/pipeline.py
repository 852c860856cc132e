"""A request across stages (P-22): each stage's output moves to the next by a transfer, the
engine moving the intermediate rank to rank, under both stages' lifecycles.

    engine.pipeline([
        PipelineStage("text", {"prompt": "a red cube"}, export=("prompt_embeds",)),
        PipelineStage("image", {"seed": 0, "steps": 20}),
    ])

Hop by hop, the producer's ranks export (TransferOut; the producer then neither sleeps nor
takes an update until the hop is released), the consumer is admitted by its own admission
rules as a request would be (RUNNING: lands; asleep: queued or woken per its policy; PAUSED:
queued), its ranks land a copy (TransferIn), and the producer's buckets are dropped
(TransferRelease) at every end, a failure included. The last stage runs its payload with
`"transfer"` naming what landed. `fsm/transfers.py` (TransferCore) decides each move; this
module only performs them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

from omni_core.engine.errors import InvalidArgumentError, OmniCoreError
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.inputs import CommandCall
from omni_core.fsm.transfers import Land, TransferCore, TransferState
from omni_core.protocol import StageState, TransferIn, TransferOut, TransferRelease
from omni_core.protocol.messages import DEFAULT_TRANSFER_BYTES, ConnectorName, TransferBytes
from omni_core.protocol.weights import WeightsVersion

if TYPE_CHECKING:
    from omni_core.engine.api import Engine

QUEUE_POLL_S = 0.01  # how often a queued transfer looks at its consumer's state again


class PipelineError(OmniCoreError):
    """A pipeline request ended without a result; `hop` names where, `producer_version` what
    the producer held (None: nothing was exported)."""

    def __init__(self, message: str, hop: int, producer_version: int | None) -> None:
        super().__init__(message)
        self.hop, self.producer_version = hop, producer_version


@dataclass(frozen=True)
class PipelineStage:
    """One stage of a pipeline request: its payload, and (for every stage but the last) the
    connector names it exports to the next. `expect_version`: the producer weights version the
    next stage's request is declared for (None: any; the result names it)."""

    stage: str
    payload: Any = None
    export: tuple[str, ...] = ()
    expect_version: int | None = None
    max_bytes: int = DEFAULT_TRANSFER_BYTES


MAX_PIPELINE_STAGES = 8


class PipelineHop(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage of a declared pipeline (`[[pipelines]]` in a config): what it exports to the
    next, the producer version the next is declared for, the hop's byte bound."""

    stage: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    export: Annotated[tuple[ConnectorName, ...], msgspec.Meta(max_length=16)] = ()
    expect_version: WeightsVersion | None = None
    max_bytes: TransferBytes = DEFAULT_TRANSFER_BYTES


class PipelineRoute(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A pipeline declared once, by name: its stages in order. `request(payloads)` makes the
    `PipelineStage`s of one request, a payload per stage."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    stages: Annotated[tuple[PipelineHop, ...], msgspec.Meta(min_length=2, max_length=MAX_PIPELINE_STAGES)]

    def __post_init__(self) -> None:
        for hop in self.stages[:-1]:
            if not hop.export:
                raise ValueError(f"stage {hop.stage!r} exports nothing to the next: name its `export`")

    def request(self, payloads: Sequence[Any]) -> list[PipelineStage]:
        if len(payloads) != len(self.stages):
            raise InvalidArgumentError(
                f"pipeline {self.name!r} has {len(self.stages)} stages; give one payload each, got {len(payloads)}"
            )
        return [
            PipelineStage(h.stage, payload, tuple(h.export), h.expect_version, h.max_bytes)
            for h, payload in zip(self.stages, payloads, strict=True)
        ]


@dataclass(frozen=True)
class PipelineResult:
    """The last stage's output, and each hop's producer weights version, in order."""

    output: Any
    producer_versions: tuple[int, ...] = field(default=())


def run_pipeline(
    engine: Engine, stages: Sequence[PipelineStage], request_id: str, timeout_s: float | None
) -> PipelineResult:
    if len(stages) < 2 or len({s.stage for s in stages}) != len(stages):
        raise InvalidArgumentError(
            f"a pipeline names two or more distinct stages in order, got {[s.stage for s in stages]}"
        )
    landed: list[tuple[TransferCore, str, str | None]] = []  # each hop's core, producer, consumer to release
    try:
        payload = stages[0].payload
        for hop, (producer, consumer) in enumerate(itertools.pairwise(stages)):
            if not producer.export:
                raise InvalidArgumentError(
                    f"stage {producer.stage!r} exports nothing to {consumer.stage!r}: name `export`"
                )
            hop_id = f"{request_id}.{hop}"
            landed.append(
                (
                    _hop(engine, hop, producer, consumer.stage, payload, hop_id, timeout_s),
                    producer.stage,
                    consumer.stage,
                )
            )
            payload = _with_transfer(consumer.payload, hop_id)
        try:
            output = engine.execute(stages[-1].stage, payload, timeout_s=timeout_s)
        except OmniCoreError as exc:
            error = f"stage {stages[-1].stage!r} did not run the request: {exc}"
            for core, _, _ in landed:
                core.failed(error)
            raise PipelineError(error, len(landed) - 1, landed[-1][0].producer_version) from exc
        for core, _, _ in landed:
            core.finished(output)
        # The last stage's Execute named its hop's landing: its ranks dropped it when the
        # request ended (P-22, the worker's `_drop_landed`); nothing is left to release there.
        landed[-1] = (landed[-1][0], landed[-1][1], None)
        return PipelineResult(output, tuple(core.producer_version or 0 for core, _, _ in landed))
    finally:
        for core, _, _ in landed:
            if core.state is TransferState.RUNNING:
                core.failed(f"request {request_id!r} ended at a later hop")
        _release_hops(engine, landed, timeout_s)


def _with_transfer(payload: Any, hop_id: str) -> dict[str, Any]:
    if payload is None:
        return {"transfer": hop_id}
    if not isinstance(payload, dict) or "transfer" in payload:
        raise InvalidArgumentError("a consumer's payload is a dict without 'transfer': the engine names what landed")
    return {**payload, "transfer": hop_id}


def _hop(
    engine: Engine,
    hop: int,
    producer: PipelineStage,
    consumer: str,
    payload: Any,
    hop_id: str,
    timeout_s: float | None,
) -> TransferCore:
    """One hop, exported, admitted and landed (its core RUNNING), else PipelineError, the
    producer's buckets released."""
    core = TransferCore(hop_id, producer.expect_version)
    core.offer()
    deadline_at = time.monotonic() + (timeout_s or engine._spec(consumer).request_timeout_s)
    try:
        source = _offer(engine, core, producer, payload, hop_id, timeout_s)
        while core.state in (TransferState.HELD, TransferState.QUEUED, TransferState.WAKING):
            _admit(engine, core, consumer, deadline_at, timeout_s)
        if core.state is TransferState.LANDING:
            _land(engine, core, consumer, source, producer, hop_id, timeout_s)
    finally:
        if core.state is not TransferState.RUNNING:  # ended here: release, then tell
            _release(engine, producer.stage, hop_id, timeout_s)
    answer = core.answer
    if answer is not None and not answer.ok:
        core.released()
        raise PipelineError(answer.error, hop, answer.producer_version)
    return core


def _offer(
    engine: Engine, core: TransferCore, producer: PipelineStage, payload: Any, hop_id: str, timeout_s: float | None
) -> Any:
    task_id, deadline_s = engine._task(producer.stage, "transfer-out", f"{hop_id}/out", timeout_s)
    command = TransferOut(
        task_id=task_id,
        epoch=0,
        request_id=hop_id,
        names=producer.export,
        payload=payload,
        max_bytes=producer.max_bytes,
    )
    try:
        report = engine._lifecycle(producer.stage, CommandCall(command, deadline_s))
    except OmniCoreError as exc:
        core.failed(f"stage {producer.stage!r} did not export {list(producer.export)}: {exc}")
        return None
    source = report.ranks[0].shared if 0 in report.ranks else None
    if source is None:
        core.failed(f"stage {producer.stage!r} rank 0 exported no buckets for {hop_id!r}")
        return None
    core.offered(report.weights_version)
    return source


def _admit(engine: Engine, core: TransferCore, consumer: str, deadline_at: float, timeout_s: float | None) -> None:
    if core.state is TransferState.WAKING:
        core.woke()
        return
    state, policy = _stage_view(engine, consumer)
    land = core.decide(state, policy)
    if land is Land.WAKE:
        try:
            engine.wake(consumer, timeout_s=timeout_s)
        except OmniCoreError as exc:
            core.failed(f"stage {consumer!r} could not be woken for the transfer: {exc}")
    elif land is Land.QUEUE:
        if time.monotonic() >= deadline_at:
            core.expired(timeout_s or 0.0)
        else:
            time.sleep(QUEUE_POLL_S)  # waiting for a wake or resume that is someone else's to give


def _land(
    engine: Engine,
    core: TransferCore,
    consumer: str,
    source: Any,
    producer: PipelineStage,
    hop_id: str,
    timeout_s: float | None,
) -> None:
    task_id, deadline_s = engine._task(consumer, "transfer-in", f"{hop_id}/in", timeout_s)
    command = TransferIn(
        task_id=task_id,
        epoch=0,
        request_id=hop_id,
        producer_version=core.producer_version or 0,
        expect_version=producer.expect_version,
        source=source,
        max_bytes=producer.max_bytes,
    )
    try:
        engine._lifecycle(consumer, CommandCall(command, deadline_s))
    except OmniCoreError as exc:
        core.failed(f"the transfer {hop_id!r} did not land on stage {consumer!r}: {exc}")
        return
    core.landed()


def _stage_view(engine: Engine, stage: str) -> tuple[StageState, AdmissionPolicy]:
    """The stage core's state and policy, read where the loop thread keeps them: no round trip
    through the loop (a status() snapshot is as old by the time TransferIn arrives, and the
    core refuses a TransferIn anywhere but RUNNING either way, P-22)."""
    core = engine._orch.stage(stage).core
    return core.state, core.policy


Sent = tuple[str, "Future[Any]", float]  # a release's stage, its answer to come, the budget to wait it


def _release(engine: Engine, stage: str, hop_id: str, timeout_s: float | None) -> None:
    """Drop what `stage`'s ranks hold for the hop (`_released`)."""
    _released(engine, [_send_release(engine, stage, hop_id, timeout_s)])


def _release_hops(
    engine: Engine, hops: Sequence[tuple[TransferCore, str, str | None]], timeout_s: float | None
) -> None:
    """Every hop's releases (its producer's, and its consumer's unless None), in waves: a stage
    takes one task at a time, so each wave sends the next release of every stage at once, then
    waits for them together (a two-stage request: one wave). Each is sent whatever another
    answers; every hop's core is released at the end, then the first error is raised."""
    pending: dict[str, list[str]] = {}
    for core, producer, consumer in hops:
        for stage in (producer, consumer):
            if stage is not None:
                pending.setdefault(stage, []).append(core.request_id)
    error: OmniCoreError | None = None
    try:
        while any(pending.values()):
            wave = [_send_release(engine, stage, ids.pop(0), timeout_s) for stage, ids in pending.items() if ids]
            try:
                _released(engine, wave)
            except OmniCoreError as exc:
                error = error or exc
    finally:
        for core, _, _ in hops:
            core.released()
    if error is not None:
        raise error


def _send_release(engine: Engine, stage: str, hop_id: str, timeout_s: float | None) -> Sent:
    task_id, deadline_s = engine._task(stage, "transfer-release", None, timeout_s)
    call = CommandCall(TransferRelease(task_id=task_id, epoch=0, request_id=hop_id), deadline_s)
    return stage, engine._orch.submit(stage, call), deadline_s + engine._spec(stage).request_timeout_s


def _released(engine: Engine, sent: Sequence[Sent]) -> None:
    """Wait for each release sent; a stage that cannot be asked any more (FAILED, stopped) holds
    nothing a restart keeps. All are waited for before the first other error is raised."""
    error: OmniCoreError | None = None
    for stage, future, budget_s in sent:
        try:
            engine._wait(future, budget_s)
        except OmniCoreError as exc:
            if _stage_view(engine, stage)[0] not in (StageState.FAILED, StageState.STOPPED):
                error = error or exc
    if error is not None:
        raise error
