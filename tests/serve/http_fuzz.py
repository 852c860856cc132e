"""Schema-driven HTTP fuzzing: Schemathesis generates requests for every route of the app's
OpenAPI document, valid ones and ones that break the schema; every answer is checked.

Rules for an answer: never a 500; a 5xx only as the engine's own 503/504 (a stage FAILED, a
deadline); every error a JSON body `{"error": {"code", "type", "message"}}` whose code is the
status; a 422 names each field it refuses (`error.fields`, each in the message).

Used by tests/serve/test_fuzz_http.py (in process, fixed seed, bounded examples) and by
scripts/fuzz_http.py (over a socket against `omni-core serve`, long campaign).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import hypothesis
import hypothesis.strategies as st
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.generation import GenerationMode

# /v1/events: an endless event stream, no answer to check. The weight-group inits: every rank
# joins a process group at the address the body names and waits for its rendezvous, so each
# fuzzed example would wait out a group timeout; their bodies' decoding is tested in
# tests/serve/test_weight_routes.py.
SKIPPED_ROUTES = {
    ("GET", "/v1/events"),
    ("POST", "/init_weight_transfer_engine"),
    ("POST", "/init_weights_update_group"),
}
# 503/504: the engine's (failed, overloaded, deadline); 501: an anchor's route omni-core does not
# serve (NotServed, docs/http_routes.md), on purpose and saying why.
ENGINE_5XX = {501, 503, 504}


def problem_with(status: int, body: bytes) -> str:
    """What is wrong with one answer, or ''."""
    if status < 400:
        return ""
    if status >= 500 and status not in ENGINE_5XX:
        return f"HTTP {status}"
    try:
        error = json.loads(body)["error"]
        code, kind, message = error["code"], error["type"], error["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} without a JSON error body: {body[:200]!r}"
    if code != status or not isinstance(kind, str) or not kind or not isinstance(message, str) or not message:
        return f"HTTP {status} with a malformed error: {error!r:.300}"
    if status == 422:
        fields = error.get("fields")
        if not fields or not all(_named(str(f), message) for f in fields):
            return f"422 that does not name its fields: {error!r:.300}"
    return ""


def _named(field_path: str, message: str) -> bool:
    """Whether `message` names the field: whole, or its name after the location (query.,
    body.), or its last part; as written or as Python's repr escapes it."""
    place, _, name = field_path.partition(".")
    candidates = {field_path, name or place, field_path.rsplit(".", 1)[-1]}
    return any(c and (c in message or repr(c)[1:-1] in message) for c in candidates)


# Raised by the client before a byte is sent (JSON has no infinity, UTF-8 no lone surrogate):
# such a case is skipped, not blamed on the server.
UNSENDABLE: tuple[type[BaseException], ...] = (UnicodeEncodeError,)
try:
    import requests

    UNSENDABLE += (requests.exceptions.InvalidJSONError,)
except ImportError:  # pragma: no cover - schemathesis depends on requests
    pass


@dataclass
class Tally:
    requests: int = 0
    unsendable: int = 0
    by_status: Counter = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    hangs: int = 0

    def record(self, route: str, case: Any, status: int | None, body: bytes) -> None:
        self.requests += 1
        if status is None:
            self.hangs += 1
            self.problems.append(f"{route}: no answer (hang) to {_describe(case)}")
            return
        self.by_status[status] += 1
        problem = problem_with(status, body)
        if problem and len(self.problems) < 200:
            self.problems.append(f"{route}: {problem} for {_describe(case)}")


def _describe(case: Any) -> str:
    body = case.body if not isinstance(case.body, type(schemathesis.core.NOT_SET)) else None
    return (
        f"{case.method} {case.formatted_path} query={case.query!r:.200} body={body!r:.300} "
        f"headers={case.headers!r:.200}"
    )


def operations(schema: Any) -> Iterator[Any]:
    for result in schema.get_all_operations():
        operation = result.ok()
        if (operation.method.upper(), operation.path) not in SKIPPED_ROUTES:
            yield operation


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


# What a schema does not say but a wire or an OS cannot take: integers past 64 bits, control
# characters (NUL), nesting past the limits; put into one field of an otherwise generated body.
HOSTILE_VALUES = st.one_of(
    st.integers(min_value=2**63 - 2, max_value=2**80),
    st.integers(min_value=-(2**80), max_value=-(2**63) + 2),
    st.text(st.characters(categories=["Cc"]), min_size=1, max_size=4),
    st.text(max_size=8).map(lambda text: f"/tmp/{text}\x00"),
    st.integers(min_value=50, max_value=1200).map(_nested),
    st.booleans(),
    st.just(None),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=3),
)


def _with_hostile_field(case: Any) -> st.SearchStrategy:
    body = case.body
    if not isinstance(body, dict) or not body:
        return st.just(case)

    def put(key_value: tuple[str, Any]) -> Any:
        key, value = key_value
        changed = dict(body)
        if key == "payload" and isinstance(changed.get("payload"), dict):  # reach inside the runner's request
            changed["payload"] = {**changed["payload"], "n": value}
        else:
            changed[key] = value
        case.body = changed
        return case

    return st.tuples(st.sampled_from(sorted(body)), HOSTILE_VALUES).map(put)


def strategies_for(operation: Any, stage_names: list[str]) -> list[st.SearchStrategy]:
    """Two campaigns per route: the schema's cases of both modes, and valid cases with one
    body field made hostile. A route with {name} also gets the real stages, so lifecycle
    commands run on the engine and do not only fall on 404."""
    modes = [GenerationMode.POSITIVE, GenerationMode.NEGATIVE]
    names: list[dict[str, str] | None] = [None]
    if "{name}" in operation.path:
        names += [{"name": name} for name in stage_names]
    schema_cases = st.one_of(
        [operation.as_strategy(generation_mode=mode, path_parameters=path) for mode in modes for path in names]
    )
    hostile_cases = st.one_of(
        [operation.as_strategy(path_parameters=path).flatmap(_with_hostile_field) for path in names[1:] or names]
    )
    return [schema_cases, hostile_cases]


def fuzz(
    schema: Any,
    call: Callable[[Any], tuple[int | None, bytes]],
    *,
    stage_names: list[str],
    seed: int,
    examples_per_route: int,
    tally: Tally,
    until: float | None = None,
) -> Tally:
    """Run every operation's cases through `call` (returns status and body, status None on a
    hang); answers go to `tally`. `until` (a time.monotonic deadline) stops early."""
    for operation in operations(schema):
        if until is not None and time.monotonic() > until:
            break
        _fuzz_one(operation, call, stage_names, seed, examples_per_route, tally, until)
    return tally


def _fuzz_one(
    operation: Any,
    call: Callable[[Any], tuple[int | None, bytes]],
    stage_names: list[str],
    seed: int,
    examples: int,
    tally: Tally,
    until: float | None,
) -> None:
    for strategy in strategies_for(operation, stage_names):
        _fuzz_cases(f"{operation.method.upper()} {operation.path}", strategy, call, seed, examples, tally, until)


def _fuzz_cases(
    route: str,
    strategy: st.SearchStrategy,
    call: Callable[[Any], tuple[int | None, bytes]],
    seed: int,
    examples: int,
    tally: Tally,
    until: float | None,
) -> None:
    @hypothesis.seed(seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.given(strategy)
    def run(case: Any) -> None:
        if until is not None and time.monotonic() > until:
            return
        try:
            status, body = call(case)
        except UNSENDABLE:
            tally.unsendable += 1
            return
        tally.record(route, case, status, body)

    run()
