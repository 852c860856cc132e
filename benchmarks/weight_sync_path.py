"""Where an update's time goes between `Engine.update_weights` and its return.

The engine and its ranks append to one trace (`Engine(trace_path=...)`), each line stamped
with its process's `time.monotonic()`: on Linux one system-wide clock, so the engine's and a
rank's stamps subtract. `update_path` cuts one update task into consecutive phases that add
up to the caller's wall time, and counts the frames the task sent and received: one command
per rank and one reply per rank is the whole conversation of an update, and any other frame
the engine exchanged while the caller waited is counted as well.

`python -m benchmarks --weight-sync` on a machine without CUDA runs `cpu_update_path`: a
stage on the CPU updated over shared memory with 291 tensors (an 8B model's count), small
enough that copying is not the cost, back to back and then as the GPU bench spaces them, and
writes the phases as Markdown.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_core.fsm.trace_records import (
    EffectDone,
    ReplySent,
    StageIssued,
    StageReceived,
    StageSent,
    TaskEnded,
    TraceLine,
    WorkerReceived,
)
from omni_core.trace import read_trace

# (key, what the phase holds), in the order they follow each other: they partition the call.
PHASES: tuple[tuple[str, str], ...] = (
    ("api_s", "API call to the core's issue: source checked, the call queued, the loop woken"),
    ("to_rank_s", "issue to the rank's receipt: the command encoded, sent, received, decoded"),
    ("rank_extra_s", "the rank's time around the apply: memory figures, the ACK built"),
    ("apply_s", "the rank's own time (the Ack's duration_s)"),
    ("to_engine_s", "the ACK sent to the engine's receipt"),
    ("commit_s", "the ACK received to the task's end (commit)"),
    ("return_s", "the task's end to the caller's return"),
)


@dataclass
class UpdatePath:
    """One update's phases (seconds, for the slowest rank) and its frames."""

    task_id: str
    wall_s: float
    phases: dict[str, float]
    commands_sent: int  # StageSent lines of this task (one per rank)
    replies_received: int  # StageReceived lines of this task
    ranks: int
    other_frames: list[str] = field(default_factory=list)  # other tasks' frames while the caller waited


def update_path(lines: Sequence[TraceLine], task_id: str, called_at_s: float, returned_at_s: float) -> UpdatePath:
    """The phases of update `task_id`, called at `called_at_s` and returned at `returned_at_s`
    (both `time.monotonic()` of the caller). Raises ValueError naming a record the trace lacks."""

    def first(kind: type, rank: int | None = None) -> TraceLine:
        for line in lines:
            record = line.record
            mine = isinstance(record, kind) and getattr(record, "task_id", None) == task_id
            if mine and (rank is None or line.rank == rank):
                return line
        raise ValueError(f"the trace has no {kind.__name__} of task {task_id!r} (rank {rank}); was it traced?")

    sent = [line for line in lines if isinstance(line.record, StageSent) and line.record.task_id == task_id]
    received = [line for line in lines if isinstance(line.record, StageReceived) and line.record.task_id == task_id]
    for kind, found in ((StageSent, sent), (StageReceived, received)):
        if not found:
            raise ValueError(f"the trace has no {kind.__name__} of task {task_id!r}; was it traced?")
    issued = first(StageIssued)
    ended = first(TaskEnded)
    last = max(received, key=lambda line: line.mono_s)  # the slowest rank's reply: the commit waited for it
    rank = last.record.rank  # type: ignore[union-attr]
    got = first(WorkerReceived, rank)
    done = first(EffectDone, rank)
    replied = first(ReplySent, rank)
    apply_s = done.record.duration_s  # type: ignore[union-attr]
    phases = {
        "api_s": issued.mono_s - called_at_s,
        "to_rank_s": got.mono_s - issued.mono_s,
        "rank_extra_s": (replied.mono_s - got.mono_s) - apply_s,
        "apply_s": apply_s,
        "to_engine_s": last.mono_s - replied.mono_s,
        "commit_s": ended.mono_s - last.mono_s,
        "return_s": returned_at_s - ended.mono_s,
    }
    others = [
        f"{type(line.record).__name__}:{getattr(line.record, 'command', '') or getattr(line.record, 'reply', '')}"
        f" {getattr(line.record, 'task_id', '')}"
        for line in lines
        if isinstance(line.record, (StageSent, StageReceived))
        and line.record.task_id != task_id
        and called_at_s <= line.mono_s <= returned_at_s
    ]
    ranks = len({line.record.rank for line in sent})  # type: ignore[union-attr]
    return UpdatePath(task_id, returned_at_s - called_at_s, phases, len(sent), len(received), ranks, others)


def timed_update(engine: Any, stage: str, source: Any, version: int, task_id: str) -> tuple[Any, float, float]:
    """`engine.update_weights` with the caller's monotonic stamps around it."""
    called_at_s = time.monotonic()
    report = engine.update_weights(stage, source, version=version, task_id=task_id)
    return report, called_at_s, time.monotonic()


def render_paths(title: str, paths: Sequence[UpdatePath]) -> list[str]:
    """A Markdown table: one row per phase, the median over `paths` and the range."""
    lines = [
        f"### {title}",
        "",
        f"{len(paths)} updates; frames per update: {paths[0].commands_sent} command(s) sent, "
        f"{paths[0].replies_received} reply(ies) received, for {paths[0].ranks} rank(s); "
        f"other frames while the caller waited: {sum(len(p.other_frames) for p in paths)}.",
        "",
        "| phase | median | min | max |",
        "|---|---|---|---|",
    ]
    for key, what in (*PHASES, ("wall_s", "the caller's wall time")):
        values = [p.wall_s if key == "wall_s" else p.phases[key] for p in paths]
        lines.append(
            f"| {what} | {statistics.median(values) * 1e3:.3f} ms | {min(values) * 1e3:.3f} ms | "
            f"{max(values) * 1e3:.3f} ms |"
        )
    return lines


def cpu_update_path(
    updates: int = 20, ranks: int = 1, *, idle_s: float = 0.0, log: Callable[[str], None] = print
) -> list[UpdatePath]:
    """Update a CPU stage of `ranks` ranks `updates` times over shared memory (291 small
    tensors) with a trace, and cut each update into phases (the first two, which open the
    buckets, are left out). With `idle_s` > 0 each update follows what the GPU bench does
    between two: a request, a level-1 sleep and wake, a request, then `idle_s` of nothing
    (the bench computes its reference meanwhile), so every thread and process the update
    wakes has gone idle."""
    import torch

    from omni_core.engine import Engine, StageSpec
    from omni_core.runners.synthetic import SyntheticRunner
    from omni_core.weights_sender import WeightSender

    args = {"weights_bytes": 291 * 64 * 16 * 4, "tensor_count": 291, "hidden": 64, "kv_bytes": 1 << 16}
    args["cpu_threads"] = 1
    shapes = SyntheticRunner(torch.device("cpu"), **args).weight_specs()
    with tempfile.TemporaryDirectory(prefix="omni-ws-path-") as tmp:
        trace = str(Path(tmp) / "trace.jsonl")
        spec = StageSpec("rollout", runner_args=args, ranks=ranks, backend="portable", deadline_s=60.0)
        stamps = []
        with Engine([spec], trace_path=trace) as engine, WeightSender(bucket_bytes=1 << 20) as sender:
            for version in range(1, updates + 1):
                weights = {n: torch.full(s, float(version), dtype=d) for n, (s, d) in shapes.items()}
                source = sender.share(weights)
                _, called, returned = timed_update(engine, "rollout", source, version, f"update-{version}")
                stamps.append((f"update-{version}", called, returned))
                if idle_s > 0:
                    engine.execute("rollout", {"seed": 1, "batch": 1})
                    engine.sleep("rollout", level=1)
                    engine.wake("rollout")
                    engine.execute("rollout", {"seed": 1, "batch": 1})
                    time.sleep(idle_s)
        lines = read_trace(trace)
    paths = [update_path(lines, *stamp) for stamp in stamps[2:]]
    wall_ms = statistics.median(p.wall_s for p in paths) * 1e3
    apply_ms = statistics.median(p.phases["apply_s"] for p in paths) * 1e3
    log(f"cpu (idle {idle_s} s between): {len(paths)} updates, wall median {wall_ms:.2f} ms, apply {apply_ms:.2f} ms")
    return paths
