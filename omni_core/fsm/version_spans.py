"""Which weights computed which tokens of a request held through an update (pause mode keep).

A rank's requests run under the version it holds. HoldRequests(hold=True) freezes them
where they are (the runner says how many output tokens each has: the boundary), an update
of the weights may run beside them (worker_table.BESIDE_HELD), and HoldRequests(hold=False)
lets them go on under the version held then: from its boundary on, each request's tokens
are that version's. This component of the worker core keeps, per running request, its
spans (version, first token) and the tokens a hold with clear_cache made it discard; the
Result carries them (`Result.version_spans`, `Result.discarded_tokens`). It does no IO.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from omni_core.protocol import MAX_VERSION_SPANS, VersionSpan


@dataclass
class _Spans:
    spans: list[VersionSpan]
    boundary_tokens: int = 0  # its output tokens when it was last held
    discarded_tokens: int = 0


@dataclass
class VersionSpans:
    """The spans of every request running on a rank, by task id."""

    _by_task: dict[str, _Spans] = field(default_factory=dict)

    def started(self, task_id: str, version: int) -> None:
        self._by_task[task_id] = _Spans([VersionSpan(weights_version=version, start_token=0)])

    def held(self, boundaries: Mapping[str, int], clear_cache: bool) -> None:
        """Each held request's output tokens so far, as the runner counted them. With
        clear_cache its KV is gone: it restarts from its prompt, its tokens so far discarded."""
        for task_id, tokens in boundaries.items():
            entry = self._by_task.get(task_id)
            if entry is None:
                continue  # a request the core no longer holds: answered already
            if clear_cache:
                entry.discarded_tokens += tokens
                entry.spans, entry.boundary_tokens = [], 0
            else:
                entry.boundary_tokens = tokens

    def released(self, version: int) -> list[str]:
        """The held requests go on under `version`: a span starts at each boundary where the
        version changed. Returns the requests that would pass MAX_VERSION_SPANS (the caller
        fails them: their Result could not say which weights computed which tokens)."""
        over = []
        for task_id, entry in self._by_task.items():
            if entry.spans and entry.spans[-1].weights_version == version:
                continue
            if len(entry.spans) >= MAX_VERSION_SPANS:
                over.append(task_id)
                continue
            entry.spans.append(VersionSpan(weights_version=version, start_token=entry.boundary_tokens))
        return over

    def finished(self, task_id: str) -> tuple[tuple[VersionSpan, ...], int]:
        """A request's spans and discarded tokens for its Result; no spans when one version
        computed every token and nothing was discarded (the Result's weights_version says it)."""
        entry = self._by_task.pop(task_id, None)
        if entry is None or (len(entry.spans) <= 1 and not entry.discarded_tokens):
            return (), 0
        return tuple(entry.spans), entry.discarded_tokens

    def forget(self, task_id: str) -> None:
        self._by_task.pop(task_id, None)

    def check_invariants(self, running: Mapping[str, object], version: int, held: bool) -> str:
        """What is wrong, or "": spans only for running requests, in token order, each
        request's last span under the version held (unless held: the update may be newer)."""
        if not self._by_task.keys() <= running.keys():
            return f"version spans of requests not running: {sorted(self._by_task.keys() - running.keys())}"
        for task_id, entry in self._by_task.items():
            starts = [span.start_token for span in entry.spans]
            if starts != sorted(starts):
                return f"request {task_id!r}: version spans out of token order {starts}"
            if not held and (not entry.spans or entry.spans[-1].weights_version != version):
                return f"request {task_id!r} runs under version {version}, which its spans do not record"
        return ""
