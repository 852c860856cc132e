"""Hostile HTTP input against the app in process (no ranks): nothing a client sends may grow
the metrics, the idempotency record or the answers beyond their bounds, and every refusal is
a 4xx JSON error naming what to change."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from omni_core.serve import create_app
from omni_core.serve.idempotency import Answer, IdempotencyCache, fingerprint
from tests.serve.conftest import make_config, stage_table

BASE_URL = "http://127.0.0.1:8000"


def _series(client: TestClient) -> int:
    text = client.get("/metrics").text
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = create_app(None, make_config(stage_table("talker"), stage_table("decoder")))
    with TestClient(app, base_url=BASE_URL) as c:
        yield c


def test_made_up_methods_and_paths_add_no_metric_series(client: TestClient) -> None:
    def noise(i: int) -> None:
        client.request(f"M{i}X", f"/made/up/{i}")
        client.get(f"/no/such/{i}")
        client.request(f"Z{i}", "/v1/stages")

    for i in range(5):  # the first of each kind may add its one series ("other", "unmatched")
        noise(i)
    _series(client)  # the scrape's own series appear from the next scrape on
    before = _series(client)
    for i in range(5, 2000):
        noise(i)
    assert _series(client) == before


def _kept_bytes(cache: IdempotencyCache) -> int:
    """What the record really holds, counted here from its entries, not by its own count."""
    total = 0
    for key, entry in cache._entries.items():
        total += len(key) + len(entry.fingerprint) + len(entry.described)
        if entry.task.done() and entry.task.exception() is None:
            answer = entry.task.result()
            total += len(answer.body) + sum(len(k) + len(v) for k, v in answer.headers)
    return total


def test_idempotency_record_counts_every_byte_it_keeps() -> None:
    budget_bytes = 64 << 10
    cache = IdempotencyCache(max_entries=4096, max_bytes=budget_bytes)
    query = "tags=" + "w" * 15_000  # a 15 KB query string, as a client may send

    async def keyed_requests() -> None:
        for i in range(200):
            described = f"POST /sleep?{query}{i}"
            fp = fingerprint("POST", "/sleep", query + str(i), b"")

            async def work() -> Answer:
                return Answer(200, b'{"status":"sleeping"}', (("X-Test", "1"),))

            await cache.run(f"key-{i}", fp, described, work)
            assert _kept_bytes(cache) <= cache._bytes <= budget_bytes

    asyncio.run(keyed_requests())
    assert 0 < len(cache) < 200  # the budget evicted; the newest are kept
    assert "key-199" in cache._entries
