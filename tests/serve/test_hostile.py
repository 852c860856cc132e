"""Hostile HTTP input against the app in process (no ranks): nothing a client sends may grow
the metrics, the idempotency record or the answers beyond their bounds, and every refusal is
a 4xx JSON error naming what to change."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from omni_core.serve import create_app
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
