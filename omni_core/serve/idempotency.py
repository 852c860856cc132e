"""`Idempotency-Key`: a retried POST gets the first answer and has no second effect.

The first request with a key runs as a task of its own (a client that disconnects does not
cancel it); every later request with the same key waits for that task and gets its recorded
answer, byte for byte. Lifecycle commands also pass the key to the engine as the task id,
so the engine's own record (per stage) answers a retry that arrives after this cache has
evicted the key. Bounded in entries and in bytes; entries still running are never evicted.

"The same request" is compared by meaning, not by bytes: a JSON body is taken apart into its
top-level fields, a null field counts as absent (every field that takes null has null as its
default), numbers compare as JSON numbers (10 and 10.0 are one number) and key order and
spacing do not count; query parameters compare in any order. So `curl -d '{"out": "a", "in":
"b"}'` and a client that also sends `"tags": null` are one request. A 409 names the fields
that differ.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from omni_core.serve.errors import ApiError

KEY_PATTERN = re.compile(r"^[A-Za-z0-9_.:-]{1,100}$")  # fits the protocol's 128-char task id with a prefix
TASK_ID_PREFIX = "idem-"
NOT_KEPT_SHARE = 16  # an answer larger than 1/16 of the byte budget is not kept, only its fact
DESCRIBED_CHARS = 200  # what a 409 tells of the first request; a query string can be 16 KiB
# Per entry, beyond the bytes of its strings: the entry, its future and the dict slot. An
# estimate on the high side, so the budget errs towards keeping less.
ENTRY_OVERHEAD_BYTES = 512
FIELDS_KEPT = 32  # top-level fields whose digests a 409 can compare; the fingerprint covers all
EXACT_FLOAT_INT = 2**53  # an integral float below this is the same JSON number as the integer
RAW_BODY = "(body)"  # a body that is not a JSON object is compared as a whole


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def answer_bytes(answer: Answer) -> int:
    return len(answer.body) + sum(len(k) + len(v) for k, v in answer.headers)


@dataclass(frozen=True)
class Fingerprint:
    """What makes two requests the same: `digest` over all of it; `fields`, each top-level
    body field's digest, to say which differ."""

    digest: str
    fields: tuple[tuple[str, str], ...] = ()


@dataclass
class _Entry:
    fingerprint: Fingerprint
    described: str
    task: asyncio.Future
    size_bytes: int = 0


def check_key(key: str) -> str:
    if not KEY_PATTERN.match(key):
        raise ApiError(
            400,
            f"Idempotency-Key {key[:120]!r} must be 1-100 characters of [A-Za-z0-9_.:-] (a UUID fits)",
            kind="InvalidIdempotencyKey",
        )
    return key


def task_id_for(key: str) -> str:
    """The engine task id for a key: prefixed, so it never collides with the engine's own."""
    return TASK_ID_PREFIX + key


def fingerprint(method: str, path: str, query: str, body: bytes) -> Fingerprint:
    pairs = sorted(urllib.parse.parse_qsl(query, keep_blank_values=True), key=lambda kv: kv[0])
    fields = sorted(_body_fields(body).items())
    whole = hashlib.sha256(b"\0".join([method.encode(), path.encode(), urllib.parse.urlencode(pairs).encode()]))
    for name, digest in fields:
        whole.update(b"\0" + name.encode(errors="surrogatepass") + b"=" + digest.encode())
    return Fingerprint(whole.hexdigest(), tuple(fields))


def _body_fields(body: bytes) -> dict[str, str]:
    """Each top-level field of a JSON object body (null ones left out) to a digest of its
    canonical JSON; any other body as one field."""
    try:
        parsed = json.loads(body) if body.strip() else None
    except (ValueError, RecursionError):
        parsed = body
    if parsed is None:
        return {}
    if isinstance(parsed, dict):
        try:
            return {name: _digest(value) for name, value in parsed.items() if value is not None}
        except RecursionError:  # nested deeper than the canonical form can walk: the bytes decide
            pass
    return {RAW_BODY: hashlib.sha256(body).hexdigest()[:32]}


def _digest(value: object) -> str:
    text = json.dumps(_canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode(errors="surrogatepass")).hexdigest()[:32]


def _canonical(value: object) -> object:
    if isinstance(value, float) and value.is_integer() and abs(value) < EXACT_FLOAT_INT:
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    return value


def _differing(first: Fingerprint, now: Fingerprint) -> list[str]:
    a, b = dict(first.fields), dict(now.fields)
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))[:FIELDS_KEPT]


def _shortened(described: str) -> str:
    return described[:DESCRIBED_CHARS] + "..." if len(described) > DESCRIBED_CHARS else described


def _reused(key: str, entry: _Entry, fp: Fingerprint, described: str) -> ApiError:
    described = _shortened(described)
    if entry.described != described:
        return ApiError(
            409,
            f"Idempotency-Key {key!r} was used for {entry.described}, now for {described}; use a fresh key per request",
            kind="IdempotencyKeyReused",
        )
    fields = _differing(entry.fingerprint, fp)
    what = f"field(s) {fields} differ" if fields else "its body differs"
    return ApiError(
        409,
        f"Idempotency-Key {key!r} was used for {described} with another body: {what} (a null "
        "field counts as absent; key order, spacing and 10 vs 10.0 do not count). A retry must "
        "send the same body; a new intent needs a fresh key",
        kind="IdempotencyKeyReused",
        extra={"fields": [f"body.{name}" for name in fields]},
    )


class IdempotencyCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.replays = 0  # answers served from the cache (metrics)

    def __len__(self) -> int:
        return len(self._entries)

    async def run(
        self, key: str, fp: Fingerprint, described: str, work: Callable[[], Awaitable[Answer]]
    ) -> tuple[Answer, bool]:
        """`work()`'s answer for the first request with `key`, and the same answer for later
        ones; the flag says whether this one was such a replay."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fingerprint.digest != fp.digest:
                raise _reused(key, entry, fp, described)
            self._entries.move_to_end(key)
            self.replays += 1
            return await asyncio.shield(entry.task), True
        task = asyncio.ensure_future(work())
        described = _shortened(described)
        fp = Fingerprint(fp.digest, fp.fields[:FIELDS_KEPT])
        entry = _Entry(fp, described, task)
        # Everything the entry keeps counts, from the moment it is kept: key, fingerprint,
        # description; the answer is added once there is one.
        entry.size_bytes = (
            len(key)
            + len(fp.digest)
            + sum(len(k) + len(v) for k, v in fp.fields)
            + len(described)
            + ENTRY_OVERHEAD_BYTES
        )
        self._bytes += entry.size_bytes
        self._entries[key] = entry
        task.add_done_callback(functools.partial(self._settled, key, entry))
        return await asyncio.shield(task), False

    def _settled(self, key: str, entry: _Entry, task: asyncio.Future) -> None:
        if self._entries.get(key) is not entry:
            return
        answer = None if task.cancelled() or task.exception() is not None else task.result()
        # A 429 means nothing ran: the retry should get its chance instead of the refusal.
        if answer is None or answer.status == 429:
            del self._entries[key]
            self._bytes -= entry.size_bytes
            return
        size = answer_bytes(answer)
        if size > self.max_bytes // NOT_KEPT_SHARE:
            done: asyncio.Future = asyncio.get_running_loop().create_future()
            done.set_exception(
                ApiError(
                    409,
                    f"the request with Idempotency-Key {key!r} ran once; its answer "
                    f"({size} bytes) was too large to keep, so a retry cannot repeat it",
                    kind="AnswerNotKept",
                )
            )
            done.exception()  # retrieved: only retries see it
            entry.task = done
        else:
            entry.size_bytes += size
            self._bytes += size
        self._evict()

    def _evict(self) -> None:
        for key in list(self._entries):
            if len(self._entries) <= self.max_entries and self._bytes <= self.max_bytes:
                return
            entry = self._entries[key]
            if not entry.task.done():
                continue
            del self._entries[key]
            self._bytes -= entry.size_bytes
