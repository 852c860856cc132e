"""`Idempotency-Key`: a retried POST gets the first answer and has no second effect.

The first request with a key runs as a task of its own (a client that disconnects does not
cancel it); every later request with the same key waits for that task and gets its recorded
answer, byte for byte. Lifecycle commands also pass the key to the engine as the task id,
so the engine's own record (per stage) answers a retry that arrives after this cache has
evicted the key. Bounded in entries and in bytes; entries still running are never evicted.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
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


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def answer_bytes(answer: Answer) -> int:
    return len(answer.body) + sum(len(k) + len(v) for k, v in answer.headers)


@dataclass
class _Entry:
    fingerprint: str
    described: str
    task: asyncio.Future
    size_bytes: int = 0


def check_key(key: str) -> str:
    if not KEY_PATTERN.match(key):
        raise ApiError(400, f"Idempotency-Key {key[:120]!r} must be 1-100 characters of [A-Za-z0-9_.:-] "
                            "(a UUID fits)", kind="InvalidIdempotencyKey")  # fmt: skip
    return key


def task_id_for(key: str) -> str:
    """The engine task id for a key: prefixed, so it never collides with the engine's own."""
    return TASK_ID_PREFIX + key


def fingerprint(method: str, path: str, query: str, body: bytes) -> str:
    return hashlib.sha256(b"\0".join([method.encode(), path.encode(), query.encode(), body])).hexdigest()


class IdempotencyCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._bytes = 0
        self.replays = 0  # answers served from the cache (metrics)

    def __len__(self) -> int:
        return len(self._entries)

    async def run(self, key: str, fp: str, described: str,
                  work: Callable[[], Awaitable[Answer]]) -> tuple[Answer, bool]:  # fmt: skip
        """`work()`'s answer for the first request with `key`, and the same answer for later
        ones; the flag says whether this one was such a replay."""
        entry = self._entries.get(key)
        if entry is not None:
            if entry.fingerprint != fp:
                raise ApiError(409, f"Idempotency-Key {key!r} was used for {entry.described}, now for {described}; "
                                    "use a fresh key per request", kind="IdempotencyKeyReused")  # fmt: skip
            self._entries.move_to_end(key)
            self.replays += 1
            return await asyncio.shield(entry.task), True
        task = asyncio.ensure_future(work())
        if len(described) > DESCRIBED_CHARS:
            described = described[:DESCRIBED_CHARS] + "..."
        entry = _Entry(fp, described, task)
        # Everything the entry keeps counts, from the moment it is kept: key, fingerprint,
        # description; the answer is added once there is one.
        entry.size_bytes = len(key) + len(fp) + len(described) + ENTRY_OVERHEAD_BYTES
        self._bytes += entry.size_bytes
        self._entries[key] = entry
        task.add_done_callback(lambda t, k=key, e=entry: self._settled(k, e, t))
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
            done.set_exception(ApiError(409, f"the request with Idempotency-Key {key!r} ran once; its answer "
                                             f"({size} bytes) was too large to keep, so a retry cannot repeat it",
                                        kind="AnswerNotKept"))  # fmt: skip
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
