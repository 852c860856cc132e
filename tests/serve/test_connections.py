"""Slowloris: connections that never finish their request are closed, and a full server makes
room for a real caller instead of starving it."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest

from omni_core.serve.connections import RateLimitFilter, connection_limit
from tests.serve.conftest import API_KEY, Served, make_config, metric_value, serving, stage_table

CLOSE_WAIT_S = 60.0  # far above the deadlines here: it only turns a socket never closed into a failure


pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


@contextlib.contextmanager
def keyed_server(served: Served, **server: object) -> Iterator[Served]:
    config = make_config(stage_table("talker", ranks=2, queue_limit=2), stage_table("decoder"), **server)
    with serving(config, api_key=API_KEY, engine=served.engine) as keyed:
        yield keyed


def _open(url: str, first_bytes: bytes) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    if first_bytes:
        sock.sendall(first_bytes)
    return sock


def _closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes the socket (True) or CLOSE_WAIT_S passes (False)."""
    sock.settimeout(CLOSE_WAIT_S)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    finally:
        sock.close()


def test_half_open_connections_are_closed_and_callers_still_served(served: Served) -> None:
    with keyed_server(served, read_timeout_s=1.0) as keyed:
        partial = [_open(keyed.url, b"GET /v1/sta") for _ in range(40)]  # part of a request line
        headers = [_open(keyed.url, b"GET /v1/stages HTTP/1.1\r\nHost: 127.0.0.1\r\n") for _ in range(10)]
        silent = [_open(keyed.url, b"") for _ in range(10)]  # connected, nothing sent
        half_body = (
            b"POST /v1/stages/talker/sleep HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
            b'\r\nContent-Length: 100\r\n\r\n{"lev'
        )
        body = [_open(keyed.url, half_body) for _ in range(5)]
        answer = keyed.client.get("/v1/stages")  # meanwhile, an authenticated call is served
        assert answer.status_code == 200, answer.text
        still_open = [s for s in partial + headers + silent + body if not _closed_by_server(s)]
        assert still_open == []
        metrics = keyed.client.get("/metrics").text
        assert metric_value(metrics, "omni_core_http_connections_closed_total", reason="read_timeout") == 65
        assert keyed.stage("talker")["state"] == "RUNNING"  # the half-sent sleep never ran


def test_a_full_server_evicts_the_longest_waiting_connection(served: Served) -> None:
    with keyed_server(served, read_timeout_s=600.0, max_connections=8, max_connections_per_client=8) as keyed:
        slow = [_open(keyed.url, b"GET /v1/sta") for _ in range(8)]
        # The client's connection is the ninth: the oldest half-open one makes room for it.
        answer = keyed.client.get("/v1/stages")
        assert answer.status_code == 200, answer.text
        assert _closed_by_server(slow[0])
        metrics = keyed.client.get("/metrics").text
        assert metric_value(metrics, "omni_core_http_connections_closed_total", reason="limit_evicted") >= 1
        for sock in slow[1:]:
            sock.close()


def test_the_connection_limit_stays_below_the_descriptor_limit() -> None:
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    automatic = connection_limit(0, ranks=4)
    assert automatic >= 16 and (soft == resource.RLIM_INFINITY or automatic < soft)
    assert connection_limit(10**9, ranks=4) == automatic  # clamped, with a warning
    assert connection_limit(8, ranks=4) == 8


def test_a_flood_of_one_message_is_logged_once_per_interval() -> None:
    now = [0.0]
    limiter = RateLimitFilter(interval_s=10.0, clock=lambda: now[0])

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("uvicorn.error", logging.WARNING, __file__, 1, msg, None, None)

    passed = [limiter.filter(record("Invalid HTTP request received.")) for _ in range(10_000)]
    assert passed.count(True) == 1
    assert limiter.filter(record("another cause"))  # each cause has its own allowance
    now[0] = 11.0
    later = record("Invalid HTTP request received.")
    assert limiter.filter(later) and "9999 more like this" in later.msg


@pytest.mark.parametrize("value", [0, -1, 3601])
def test_read_timeout_must_be_sane(value: float) -> None:
    from omni_core.config import ServerConfig
    from omni_core.engine.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="read_timeout_s"):
        ServerConfig(read_timeout_s=value)


IDLE_FLOOD = 64
HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


def _idle_keep_alive(url: str, source: str = "127.0.0.1") -> socket.socket:
    """A connection of a caller without the key: one public request answered, then held open
    (keep-alive) with nothing more sent."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), source_address=(source, 0))
    sock.sendall(HEALTH)
    sock.settimeout(CLOSE_WAIT_S)
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(4096)
        assert chunk, f"the server closed a kept-alive connection early: {answer!r}"
        answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
    return sock


def test_idle_keep_alive_connections_without_the_key_cannot_lock_the_operator_out(served: Served) -> None:
    with keyed_server(served, max_connections=IDLE_FLOOD, max_connections_per_client=IDLE_FLOOD) as keyed:
        idle = [_idle_keep_alive(keyed.url) for _ in range(IDLE_FLOOD)]
        try:
            # Every slot is held by an idle connection; the operator's call still gets one.
            answer = keyed.client.get("/v1/stages")
            assert answer.status_code == 200, answer.text
            assert _closed_by_server(idle[0])  # the oldest idle one made room
            metrics = keyed.client.get("/metrics").text
            evicted = metric_value(metrics, "omni_core_http_connections_closed_total", reason="limit_evicted")
            assert evicted >= 1
        finally:
            for sock in idle:
                sock.close()


def test_one_client_at_its_cap_replaces_its_own_connections_not_the_operators(served: Served) -> None:
    with keyed_server(served, max_connections=16, max_connections_per_client=4) as keyed:
        assert keyed.client.get("/v1/stages").status_code == 200  # the operator's kept-alive connection
        # Another peer (a second loopback address) opens twice its cap of idle connections.
        flood = [_idle_keep_alive(keyed.url, source="127.0.0.2") for _ in range(8)]
        try:
            assert all(_closed_by_server(sock) for sock in flood[:4])  # its own oldest made room
            metrics = keyed.client.get("/metrics").text  # on the operator's connection, still open
            assert metric_value(metrics, "omni_core_http_connections_closed_total", reason="client_evicted") == 4
            assert metric_value(metrics, "omni_core_http_connections_closed_total", reason="limit_evicted") == 0
        finally:
            for sock in flood[4:]:
                sock.close()
