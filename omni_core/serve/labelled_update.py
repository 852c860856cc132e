"""An anchor's weight update as it is sent: an optional opaque version label (absent: the
next version), SGLang's `abort_all_requests`, and the label kept beside the integer version
the update committed (`versions.py`)."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from omni_core.protocol import WeightSource
from omni_core.serve.idempotency import Answer
from omni_core.serve.lifecycle import answer, error_answer, lifecycle_tid, on_stages
from omni_core.serve.rl_calls import paused_here, sub_task
from omni_core.serve.state import ServeState
from omni_core.serve.versions import check_label, next_version

# shape(per-stage reports, per-stage integer versions, the label or None) -> the answer's body
UpdateShape = Callable[[dict[str, Any], dict[str, int], str | None], Any]


@dataclass(frozen=True)
class LabelledUpdate:
    """What one update route asks: its source, its label (checked), or an integer version the
    client gave (omni-core's own field), whether in-flight requests are aborted first, and
    whether the caches the old weights produced are dropped (SGLang's flush_cache)."""

    source: WeightSource
    label: str | None = None
    version: int | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True

    @classmethod
    def of(cls, source: WeightSource, label: str | None, field: str, **kwargs: Any) -> LabelledUpdate:
        return cls(source, None if label is None else check_label(label, field), **kwargs)


def update_work(
    state: ServeState,
    request: Request,
    update: LabelledUpdate,
    shape: UpdateShape,
    failed: Callable[[Answer], Answer] | None = None,
) -> Callable[[], Awaitable[Answer]]:
    """Each stage acted on takes `update.source` as its next version (or the label's, or the
    client's integer); with `abort_all_requests` a RUNNING stage is paused with mode abort
    first (its callers hear 409 aborted, the update runs at once, nothing drains) and resumed
    after. The label is kept once the update committed."""
    engine, tid, fail = state.require_engine(), lifecycle_tid(request), failed or (lambda error: error)

    async def work() -> Answer:
        names = state.targets()
        try:
            status = await state.status()
        except Exception as exc:
            return fail(error_answer(exc))
        versions = {n: update.version or next_version(update.label, status[n]["weights_version"]) for n in names}
        paused = [n for n in names if update.abort_all_requests and status[n]["state"] == "RUNNING"]
        if paused:
            pause_id = sub_task(request, "abort")
            reports, error = await on_stages(
                state, paused, "pause", lambda n: functools.partial(engine.pause, n, "abort", task_id=pause_id)
            )
            if error is not None:
                return fail(error)
            paused = paused_here(reports)
        per_stage, error = await on_stages(
            state,
            names,
            "update",
            lambda n: functools.partial(
                engine.update_weights,
                n,
                update.source,
                version=versions[n],
                task_id=tid,
                flush_cache=update.flush_cache,
            ),
        )
        if paused:
            resume_id = sub_task(request, "resume")
            resumed, _ = await on_stages(
                state, paused, "resume", lambda n: functools.partial(engine.resume, n, task_id=resume_id)
            )
            for name, report in resumed.items():  # the update ran PAUSED; the stage serves again
                if isinstance(per_stage.get(name), dict) and isinstance(report, dict) and "state" in report:
                    per_stage[name] = dict(per_stage[name], state=report["state"])
        if error is not None:
            return fail(error)
        for name in names:
            state.labels.set(name, versions[name], update.label)
        return answer(200, shape(per_stage, versions, update.label))

    return work
