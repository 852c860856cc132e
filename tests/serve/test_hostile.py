"""Hostile HTTP input against the app in process (no ranks): nothing a client sends may grow
the metrics, the idempotency record or the answers beyond their bounds, and every refusal is
a 4xx JSON error naming what to change."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient

from omni_core.serve import create_app
from omni_core.serve.idempotency import Answer, IdempotencyCache, fingerprint
from tests.serve.conftest import Served, make_config, serving, stage_table

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
        fp = entry.fingerprint
        total += len(key) + len(fp.digest) + sum(len(k) + len(v) for k, v in fp.fields) + len(entry.described)
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


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "field"),
    [
        ("POST", "/v1/stages/talker/sleep", {"level": "1"}, 422, "body.level"),  # never converted
        ("POST", "/v1/stages/talker/sleep", {"level": 1.0}, 422, "body.level"),
        ("POST", "/v1/omni/sleep", {"stage_ids": [True]}, 422, "body.stage_ids"),  # true is not stage 1
        ("POST", "/v1/omni/wakeup", {"stage_ids": [0], "tags": "weights"}, 422, "body.tags"),
        ("POST", "/v1/stages/talker/execute", {"payload": {"n": 2**64}}, 422, "payload.n"),
        ("POST", "/v1/stages/talker/execute", {"payload": [-(2**63) - 1]}, 422, "payload[0]"),
        ("POST", "/v1/stages/talker/execute", {"payload": {"s": "\ud800"}}, 422, "payload.s"),
        ("POST", "/v1/stages/talker/execute", {"payload": {"x": float("nan")}}, 422, "payload.x"),
        ("POST", "/v1/stages/talker/sleep", {"timeout_s": float("inf")}, 422, "body.timeout_s"),
        ("POST", "/v1/swap", {"out": "talker", "in": "decoder", "memory_wait_s": float("nan")}, 422, "memory_wait_s"),
        ("POST", "/v1/stages/talker/reload", {"source": "/tmp/ckpt\x00"}, 400, "source"),
        ("POST", "/v1/stages/talker/reload", {"source": "/tmp/\udcff\ud800"}, 400, "source"),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"source": "a\x00b"}}, 400, "source"),
        ("POST", "/collective_rpc", {"method": "reload_weights", "kwargs": {"source": 7}}, 422, "kwargs.source"),
        ("POST", "/sleep?level=1&lvl=2", None, 422, "lvl"),
        ("POST", "/v1/stages/talker/wake?pad=1", None, 422, "pad"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_field(
    client: TestClient, method: str, path: str, body: object, status: int, field: str
) -> None:
    content = json.dumps(body).encode() if body is not None else b""  # \u escapes: lone surrogates travel
    answer = client.request(method, path, content=content, headers={"Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["code"] == status and field in error["message"], error


def test_deep_nesting_is_refused_by_depth(client: TestClient) -> None:
    nested: object = 1
    for _ in range(200):
        nested = [nested]
    answer = client.post("/v1/stages/talker/execute", json={"payload": nested})
    assert answer.status_code == 422 and "nested deeper than" in answer.json()["error"]["message"], answer.text
    raw = b'{"payload": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # deeper than Python's recursion limit
    answer = client.post("/v1/stages/talker/execute", content=raw, headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "could not be read as JSON" in answer.json()["error"]["message"], answer.text


def test_a_body_that_is_not_json_is_400(client: TestClient) -> None:
    answer = client.post("/v1/stages/talker/sleep", content=b'{"level": ', headers={"Content-Type": "application/json"})
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]["message"], answer.text


def test_a_request_over_the_frame_limit_is_413() -> None:
    config = make_config(stage_table("small", max_frame_bytes=64 << 10))
    with serving(config) as small:
        answer = small.client.post("/v1/stages/small/execute", json={"payload": {"blob": "x" * (100 << 10)}})
        assert answer.status_code == 413, answer.text
        assert "max_frame_bytes" in answer.json()["error"]["message"]
        fits = small.client.post("/v1/stages/small/execute", json={"payload": {"seed": 1, "batch": 1}})
        assert fits.status_code == 200, fits.text


# ------------------------------------------------------------------ browsers: Host, Origin, content type

SECURITY_HEADERS = {"x-content-type-options": "nosniff", "x-frame-options": "DENY"}


def _refused(answer: object, status: int, kind: str, words: str) -> None:
    assert answer.status_code == status, answer.text  # type: ignore[attr-defined]
    error = answer.json()["error"]  # type: ignore[attr-defined]
    assert error["type"] == kind and words in error["message"], error


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8000",
        "127.0.0.1.evil.example",
        "localhost.evil",
        "10.1.2.3:8000",
        "[2001:db8::1]:8000",
    ],
)
def test_a_foreign_host_is_refused(client: TestClient, host: str) -> None:
    for method, path in (("GET", "/v1/stages"), ("GET", "/"), ("POST", "/sleep?level=1"), ("GET", "/metrics")):
        _refused(client.request(method, path, headers={"Host": host}), 403, "ForeignHost", "allowed_hosts")


@pytest.mark.parametrize("host", ["127.0.0.1:8000", "localhost:8000", "LOCALHOST.", "[::1]:8000", "127.9.9.9"])
def test_loopback_hosts_are_served(client: TestClient, host: str) -> None:
    assert client.get("/metrics", headers={"Host": host}).status_code == 200


def test_configured_hosts_and_a_wildcard_bind() -> None:
    config = make_config(stage_table("talker"), allowed_hosts=["omni.internal"], host="0.0.0.0")
    with TestClient(create_app(None, config), base_url=BASE_URL) as c:
        assert c.get("/metrics", headers={"Host": "omni.internal:8000"}).status_code == 200
        assert c.get("/metrics", headers={"Host": "10.1.2.3:8000"}).status_code == 200  # an address is no rebinding
        _refused(c.get("/metrics", headers={"Host": "evil.example"}), 403, "ForeignHost", "--allowed-host")
    with TestClient(create_app(None, make_config(stage_table("talker"), allowed_hosts=["*"])), base_url=BASE_URL) as c:
        assert c.get("/metrics", headers={"Host": "anything.example"}).status_code == 200


@pytest.mark.parametrize(
    "origin",
    ["http://evil.example", "http://127.0.0.1:9999", "http://127.0.0.1", "null", "http://localhost:8000.evil.example"],
)
def test_a_foreign_origin_cannot_change_anything(client: TestClient, origin: str) -> None:
    for path in ("/sleep?level=1", "/v1/stages/talker/restart", "/v1/omni/sleep", "/wake_up"):
        _refused(client.post(path, headers={"Origin": origin}), 403, "CrossOriginRefused", "allowed_origins")
    assert client.get("/metrics", headers={"Origin": origin}).status_code == 200  # reading is the browser's to stop


def test_the_own_origin_and_configured_ones_pass() -> None:
    config = make_config(stage_table("talker"), allowed_origins=["http://dash.example:3000"])
    with TestClient(create_app(None, config), base_url=BASE_URL) as c:
        for origin in ("http://127.0.0.1:8000", "http://dash.example:3000"):
            # past the guard: the route runs (and has no engine here)
            assert c.post("/sleep?level=1", headers={"Origin": origin}).status_code == 503


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded",
        "application/xml",
    ],
)
def test_state_changing_routes_take_only_json(client: TestClient, content_type: str) -> None:
    for path in ("/sleep?level=1", "/v1/stages/talker/sleep", "/v1/stages/talker/restart"):
        answer = client.post(path, content=b'{"level": 2}', headers={"Content-Type": content_type})
        _refused(answer, 415, "UnsupportedMediaType", "application/json")
    bare = client.post("/v1/stages/talker/sleep", content=b'{"level": 2}', headers={"Content-Type": ""})
    _refused(bare, 415, "UnsupportedMediaType", "needs 'Content-Type: application/json'")


def test_bodyless_posts_stay_open_for_vllm_clients(client: TestClient) -> None:
    # POST /sleep?level=1 with no body and no Content-Type (vLLM's and SGLang's clients) passes
    # the guard (no engine here, so 503); a browser's no-cors POST would carry an Origin.
    assert client.post("/sleep?level=1").status_code == 503
    assert client.post("/v1/stages/talker/sleep", json={"level": 1}).status_code == 503


def test_every_answer_carries_the_security_headers(client: TestClient) -> None:
    answers = [
        client.get("/"),
        client.get("/metrics"),
        client.get("/nope"),
        client.post("/sleep?level=1"),
        client.get("/v1/stages", headers={"Host": "evil.example"}),
        client.get("/openapi.json"),
    ]
    for answer in answers:
        for name, value in SECURITY_HEADERS.items():
            assert answer.headers.get(name) == value, (answer.request.url, dict(answer.headers))
        assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
    page = client.get("/")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'sha256-" in csp and "unsafe" not in csp


def test_the_browser_settings_come_from_the_command_line() -> None:
    import argparse

    from omni_core.serve.cli import _tuple
    from omni_core.serve.cli_args import add_serve_arguments
    from omni_core.serve.server import with_overrides

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args(
        [
            "--allowed-host",
            "omni.internal",
            "--allowed-host",
            "10.0.0.5",
            "--allowed-origin",
            "http://dash.example:3000",
        ]
    )
    config = with_overrides(
        make_config(stage_table("talker")),
        allowed_hosts=_tuple(args.allowed_host),
        allowed_origins=_tuple(args.allowed_origin),
    )
    assert config.server.allowed_hosts == ("omni.internal", "10.0.0.5")
    assert config.server.allowed_origins == ("http://dash.example:3000",)
    with TestClient(create_app(None, config), base_url=BASE_URL) as c:
        assert c.get("/metrics", headers={"Host": "omni.internal"}).status_code == 200


def test_the_ranks_get_the_reload_path_that_was_checked(served: Served) -> None:
    import os
    import shutil
    import tempfile

    root = tempfile.mkdtemp(prefix="omni-")  # short: the rank's refusal quotes 80 characters of the path
    try:
        allowed = os.path.join(root, "ok")
        os.makedirs(os.path.join(allowed, "real"))
        os.symlink(os.path.join(allowed, "real"), os.path.join(allowed, "link"))
        served.settle()
        config = make_config(
            stage_table("talker", ranks=2, queue_limit=2), stage_table("decoder"), allowed_reload_sources=[allowed]
        )
        with serving(config, engine=served.engine) as s:
            assert s.client.post("/v1/stages/decoder/sleep", json={"level": 2}).status_code == 200
            assert s.client.post("/v1/stages/decoder/wake").status_code == 200  # NEEDS_RELOAD
            answer = s.client.post("/v1/stages/decoder/reload", json={"source": os.path.join(allowed, "link")})
            # The synthetic runner refuses any path (it takes "seed:N"), quoting what it was given:
            # the resolved path, so a link swapped after the check would not be followed.
            assert answer.status_code == 400, answer.text
            message = answer.json()["error"]["message"]
            assert os.path.join(allowed, "real") in message and "link" not in message, message
    finally:
        served.settle()
        shutil.rmtree(root)


def test_a_rank_reporting_made_up_tags_adds_no_series() -> None:
    from prometheus_client import generate_latest

    from omni_core.serve.metrics import ServeMetrics

    def snapshot(tags: int) -> dict:
        pool = {f"made-up-{i}": i for i in range(tags)} | {"weights": 7}
        rank = {
            "alive": True,
            "state": "ACTIVE" + "x" * 500,
            "pool_bytes": pool,
            "process_bytes": 1,
            "process_bytes_source": "s" * 5000,
        }
        return {
            "engine_up": True,
            "engine": {},
            "stages": {"talker": {"state": "RUNNING", "tags": ["weights", "kv_cache"], "ranks": {"0": rank}}},
        }

    def lines(tags: int) -> list[str]:
        text = generate_latest(ServeMetrics(lambda: snapshot(tags)).registry).decode()
        return [line for line in text.splitlines() if line and not line.startswith("#")]

    assert len(lines(1)) == len(lines(1000))
    pool = [line for line in lines(1000) if line.startswith("omni_core_pool_bytes")]
    assert sorted(pool) == [
        'omni_core_pool_bytes{rank="0",stage="talker",tag="other"} 499500.0',
        'omni_core_pool_bytes{rank="0",stage="talker",tag="weights"} 7.0',
    ]
    assert max(len(line) for line in lines(1)) < 300
