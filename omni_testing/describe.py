"""One line per message, engine input, effect and task outcome: the words of the simulator's
transcripts, the same for every run."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from omni_core.fsm import inputs as I
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.effects import (
    AdapterEffect,
    CommandEffect,
    Effect,
    ExecuteEffect,
    ProfileEffect,
    ReloadEffect,
    ShareEffect,
    ShutdownEffect,
    SleepEffect,
    StatusEffect,
    UpdateEffect,
    WakeEffect,
    WeightGroupEffect,
)
from omni_core.fsm.stage import TaskOutcome
from omni_core.protocol import (
    Ack,
    DiskSource,
    Execute,
    Hello,
    InitWeightGroup,
    Message,
    Nack,
    Profile,
    ReloadWeights,
    Result,
    ShareWeights,
    Sleep,
    UpdateWeights,
    Wake,
    arguments,
    source_kind,
)
from omni_core.protocol.weights import source_tensors


def fmt_address(rank: int | None) -> str:
    return "stage" if rank is None else f"r{rank}"


def fmt_s(seconds: float) -> str:
    return f"{seconds:g}s"


def fmt_tags(tags: Iterable[str] | None) -> str:
    return "all" if tags is None else "[" + ",".join(tags) + "]"


def describe(message: Message) -> str:
    """One line per message, the same for every run."""
    head = f"{message.task_id} e{message.epoch}"
    if isinstance(message, Sleep):
        return f"Sleep {head} level={message.level} tags={fmt_tags(message.tags)}"
    if isinstance(message, Wake):
        wait = f" memory_wait={fmt_s(message.memory_wait_s)}" if message.memory_wait_s else ""
        return f"Wake {head} tags={fmt_tags(message.tags)}{wait}"
    if isinstance(message, ReloadWeights):
        return f"ReloadWeights {head} source={message.source or 'default'}"
    if isinstance(message, Execute):
        adapter = f" adapter={message.adapter}" if message.adapter is not None else ""
        return f"Execute {head} payload={message.payload!r}{adapter}"
    if isinstance(message, Profile):
        return f"Profile {head} {'start' if message.start else 'stop'} prefix={message.prefix or '-'}"
    if isinstance(message, UpdateWeights):
        return f"UpdateWeights {head} version={message.version} source={_source(message.source)}"
    if isinstance(message, InitWeightGroup):
        return (
            f"InitWeightGroup {head} group={message.group} {message.address}:{message.port} "
            f"world={message.world_size} offset={message.rank_offset} {message.backend}"
        )
    if isinstance(message, ShareWeights):
        return f"ShareWeights {head} bucket_bytes={message.bucket_bytes}"
    version = f" v{message.weights_version}" if getattr(message, "weights_version", 0) else ""
    if isinstance(message, Ack):
        detail = f" ({message.detail})" if message.detail else ""
        paths = f" traces={list(message.trace_paths)}" if message.trace_paths else ""
        return (
            f"Ack {message.command} {head} {message.status.value} {message.state.value} "
            f"asleep={fmt_tags(message.asleep_tags)}{version}{paths}{_adapters(message)}{detail}"
        )
    if isinstance(message, Nack):
        reason, state = message.reason.value, message.state.value
        return f"Nack {message.command} {head} {reason} in {state}{version}: {message.detail}"
    if isinstance(message, Result):
        adapter = f" adapter={message.adapter} v{message.adapter_version}" if message.adapter is not None else ""
        return f"Result {head} output={message.output!r}{version}{adapter}"
    if isinstance(message, Hello):
        detail = f": {message.detail}" if message.detail else ""
        at = f" v{message.weights_version}" if message.weights_version else ""
        return f"Hello e{message.epoch} {message.state.value} tags={fmt_tags(message.tags)}{at}{detail}"
    return f"{type(message).__name__} {head}{fmt_fields(arguments(message))}"


def _adapters(ack: Ack) -> str:
    """An adapter command's listing (P-20): each adapter as name:status, and what was evicted."""
    if not ack.command.endswith("Adapter") and ack.command != "ListAdapters":
        return ""
    listed = ",".join(f"{a.name}:{a.status}{'(pinned)' if a.pinned else ''}" for a in ack.adapters)
    evicted = f" evicted={list(ack.adapters_evicted)}" if ack.adapters_evicted else ""
    return f" adapters=[{listed}]{evicted}"


def fmt_fields(fields: dict[str, Any]) -> str:
    """` name=value` for each field, in order: the line of a message, input or effect that has
    no words of its own (None is `-`, a tuple is a list)."""

    def value(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, tuple):
            return "[" + ",".join(map(str, v)) + "]"
        return format(v, "g") if isinstance(v, float) else str(v)

    return "".join(f" {name}={value(v)}" for name, v in fields.items())


def _source(source: Any) -> str:
    """A weight source in one line: its kind and what names it (a path, a bucket count)."""
    kind = source_kind(source)
    if isinstance(source, DiskSource):
        return f"{kind}:{source.path}"
    return f"{kind}:{len(source_tensors(source))} tensors"


def describe_input(event: I.EngineInput) -> str:
    if isinstance(event, I.Restart) and event.from_checkpoint:
        return f"Restart deadline={fmt_s(event.deadline_s)} from_checkpoint"
    if isinstance(event, (I.Start, I.Restart)):
        return f"{type(event).__name__} deadline={fmt_s(event.deadline_s)}"
    if isinstance(event, I.Submit):
        adapter = f" adapter={event.adapter}" if event.adapter is not None else ""
        return f"Submit {event.request_id} payload={event.payload!r} timeout={fmt_s(event.timeout_s)}{adapter}"
    if isinstance(event, I.SleepCall):
        abort = " abort_in_flight" if event.abort_in_flight else ""
        return (
            f"SleepCall {event.task_id} level={event.level} tags={fmt_tags(event.tags)} "
            f"deadline={fmt_s(event.deadline_s)}{abort}"
        )
    if isinstance(event, I.WakeCall):
        wait = f" memory_wait={fmt_s(event.memory_wait_s)}" if event.memory_wait_s else ""
        return f"WakeCall {event.task_id} tags={fmt_tags(event.tags)} deadline={fmt_s(event.deadline_s)}{wait}"
    if isinstance(event, I.PauseCall):
        return f"PauseCall {event.task_id} mode={event.mode} deadline={fmt_s(event.deadline_s)}"
    if isinstance(event, I.ResumeCall):
        return f"ResumeCall {event.task_id}"
    if isinstance(event, I.ReloadCall):
        return f"ReloadCall {event.task_id} source={event.source or 'default'} deadline={fmt_s(event.deadline_s)}"
    if isinstance(event, I.UpdateCall):
        return (
            f"UpdateCall {event.task_id} version={event.version} source={_source(event.source)} "
            f"deadline={fmt_s(event.deadline_s)}"
        )
    if isinstance(event, I.WeightGroupCall):
        return (
            f"WeightGroupCall {event.task_id} group={event.group} {event.address}:{event.port} "
            f"world={event.world_size} offset={event.rank_offset} {event.backend}"
        )
    if isinstance(event, I.ShareCall):
        return f"ShareCall {event.task_id} bucket_bytes={event.bucket_bytes} deadline={fmt_s(event.deadline_s)}"
    if isinstance(event, I.ProfileCall):
        return (
            f"ProfileCall {event.task_id} {'start' if event.start else 'stop'} prefix={event.prefix or '-'} "
            f"deadline={fmt_s(event.deadline_s)}"
        )
    if isinstance(event, I.SetAdmission):
        return f"SetAdmission {AdmissionPolicy(event.policy).value}"
    if isinstance(event, I.RankExited):
        return f"RankExited r{event.rank} e{event.epoch}: {event.detail}"
    if isinstance(event, I.SendFailed):
        return f"SendFailed {event.task_id} ranks={list(event.ranks)}"
    if isinstance(event, I.Received):
        return f"Received {describe(event.message)}"
    if isinstance(event, I.CommandCall):
        command = event.command
        own = fmt_fields(arguments(command))
        return f"CommandCall {type(command).__name__} {command.task_id}{own} deadline={fmt_s(event.deadline_s)}"
    return type(event).__name__ + fmt_fields({f.name: getattr(event, f.name) for f in dataclasses.fields(event)})


def describe_effect(effect: Effect) -> str:
    if isinstance(effect, SleepEffect):
        return f"offload {fmt_tags(sorted(effect.offload))}, discard {fmt_tags(sorted(effect.discard))}"
    if isinstance(effect, WakeEffect):
        return f"map back {fmt_tags(sorted(effect.tags))}"
    if isinstance(effect, ReloadEffect):
        return f"reload weights from {effect.source or 'the default source'}"
    if isinstance(effect, UpdateEffect):
        return f"write weights version {effect.version} from {_source(effect.source)}"
    if isinstance(effect, WeightGroupEffect):
        return f"join weight group {effect.command.group}"
    if isinstance(effect, ShareEffect):
        return f"share the weights in buckets of {effect.bucket_bytes} bytes"
    if isinstance(effect, ExecuteEffect):
        return f"run request {effect.task_id}"
    if isinstance(effect, StatusEffect):
        return "measure memory"
    if isinstance(effect, ShutdownEffect):
        return "release every pool and exit"
    if isinstance(effect, ProfileEffect):
        return "start the profiler" if effect.start else "stop the profiler, write its trace"
    if isinstance(effect, CommandEffect):
        return f"perform {type(effect.command).__name__}"
    if isinstance(effect, AdapterEffect):
        evict = f", evicting {list(effect.evict)}" if effect.evict else ""
        name = f" {effect.command.name}" if hasattr(effect.command, "name") else ""
        return f"perform {type(effect.command).__name__}{name}{evict}"
    return type(effect).__name__ + fmt_fields({f.name: getattr(effect, f.name) for f in dataclasses.fields(effect)})


def describe_outcome(outcome: TaskOutcome) -> str:
    head = f"{outcome.command} {outcome.task_id}"
    if outcome.ok:
        return (
            f"{head}: {outcome.status.value}, stage {outcome.state.value}, ACKs from {sorted(outcome.acks)}, "
            f"took {fmt_s(outcome.duration_s)}"
        )
    verdict = "refused" if outcome.refused else "failed"
    return f"{head}: {verdict}, stage {outcome.state.value}: {outcome.error}"
