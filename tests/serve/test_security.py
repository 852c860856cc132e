"""Security by default: keys never on argv, loopback unless keyed, every control route
authenticated when a key is set, bounded bodies, no caller-named paths unless allowed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omni_core.config import ServerConfig
from omni_core.serve import create_app, serve_in_thread
from omni_core.serve.auth import KeyCheck, ServeRefusedError, check_bind, is_loopback, load_api_key
from tests.serve.conftest import API_KEY, Served, make_config, serving, stage_table

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = {"/health", "/metrics", "/openapi.json"}


# ------------------------------------------------------------------ without an engine


def test_key_check_is_exact() -> None:
    check = KeyCheck(API_KEY)
    assert check.accepts(f"Bearer {API_KEY}") and check.accepts(f"bearer {API_KEY}")
    for wrong in (None, "", API_KEY, f"Bearer {API_KEY}x", f"Bearer {API_KEY[:-1]}", f"Token {API_KEY}", "Bearer "):
        assert not check.accepts(wrong), wrong
    assert KeyCheck(None).accepts(None)  # no key configured: loopback-only server, open


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("myhost", False),
    ],
)
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_non_loopback_bind_needs_a_key() -> None:
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", API_KEY)
    with pytest.raises(ServeRefusedError, match=re.escape("refusing to listen on '0.0.0.0' without an API key")):
        check_bind("0.0.0.0", None)


def test_keys_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    assert load_api_key(ServerConfig(api_key_file=str(key_file)), {}) == API_KEY
    assert load_api_key(ServerConfig(), {"OMNI_CORE_API_KEY": API_KEY}) == API_KEY
    assert load_api_key(ServerConfig(api_key_env="MY_KEY"), {"MY_KEY": API_KEY}) == API_KEY
    assert load_api_key(ServerConfig(), {}) is None
    with pytest.raises(ServeRefusedError, match="has 5 characters; use at least 16"):
        load_api_key(ServerConfig(), {"OMNI_CORE_API_KEY": "short"})
    with pytest.raises(ServeRefusedError, match="cannot read api_key_file"):
        load_api_key(ServerConfig(api_key_file=str(tmp_path / "absent")), {})


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "omni_core.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120, env=env
    )


def test_cli_refuses_a_public_bind_without_a_key_before_starting_anything() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMNI_CORE_API_KEY"}
    done = _cli("serve", "--config", "examples/two_stages.toml", "--host", "0.0.0.0", env=env)
    assert done.returncode == 2
    assert "refusing to listen on '0.0.0.0' without an API key" in done.stderr
    assert "starting" not in done.stderr  # refused before any rank process was spawned


def test_cli_takes_no_key_on_the_command_line() -> None:
    done = _cli("serve", "--config", "examples/two_stages.toml", "--api-key", API_KEY)
    assert done.returncode == 2 and "unrecognized arguments: --api-key" in done.stderr


# ------------------------------------------------------------------ on a real engine


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    allowed = tmp_path_factory.mktemp("checkpoints")
    config = make_config(stage_table("solo"), allowed_reload_sources=[str(allowed)], max_body_bytes=4096)
    with serving(config, api_key=API_KEY) as served:
        served.allowed_dir = allowed  # type: ignore[attr-defined]
        yield served


def _routes(app: object) -> list[tuple[str, str]]:
    schema = app.openapi()  # type: ignore[attr-defined]
    return sorted(
        (method.upper(), path.replace("{name}", "solo"))
        for path, ops in schema["paths"].items()
        for method in ops
        if path not in PUBLIC
    )


def test_every_control_route_needs_the_key(keyed: Served) -> None:
    routes = _routes(keyed.app)
    assert len(routes) >= 16
    with httpx.Client(base_url=keyed.url, timeout=30) as anonymous:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": API_KEY}):
                answer = anonymous.request(method, path, headers=headers, json={})
                assert answer.status_code == 401, (method, path, headers, answer.text)
                assert answer.headers["WWW-Authenticate"] == "Bearer"
                assert answer.json()["error"]["type"] == "Unauthorized"
        assert anonymous.get("/health").status_code == 200  # public by default, like SGLang's
        assert anonymous.get("/metrics").status_code == 200
        assert "omni-core" in anonymous.get("/").text  # the page holds no data; its data needs the key
    assert keyed.stage("solo")["state"] == "RUNNING"  # nothing above reached the engine
    assert keyed.client.get("/v1/stages").status_code == 200  # the key itself works


def test_health_and_metrics_can_require_the_key(keyed: Served) -> None:
    config = make_config(stage_table("solo"), public_health=False, public_metrics=False)
    app = create_app(keyed.engine, config, api_key=API_KEY)
    with serve_in_thread(app) as running, httpx.Client(base_url=running.url, timeout=30) as client:
        assert client.get("/health").status_code == 401 and client.get("/metrics").status_code == 401
        auth = {"Authorization": f"Bearer {API_KEY}"}
        assert client.get("/health", headers=auth).status_code == 200
        assert client.get("/metrics", headers=auth).status_code == 200


def test_oversized_bodies_are_413(keyed: Served) -> None:
    big = {"payload": {"pad": "x" * 8192}}
    declared = keyed.client.post("/v1/stages/solo/execute", json=big)
    assert declared.status_code == 413, declared.text
    assert "exceeds max_body_bytes (4096)" in declared.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit must hold while reading
        yield b'{"payload": {"pad": "'
        for _ in range(16):
            yield b"x" * 1024
        yield b'"}}'

    chunked = keyed.client.post(
        "/v1/stages/solo/execute", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert chunked.status_code == 413, chunked.text
    assert keyed.client.post("/v1/stages/solo/execute", json={"payload": {"seed": 1}}).status_code == 200


def test_reload_sources_only_from_the_config(keyed: Served) -> None:
    for source in ("/etc", "/tmp/../etc/passwd", str(keyed.allowed_dir) + "/../elsewhere"):  # type: ignore[attr-defined]
        answer = keyed.client.post("/v1/stages/solo/reload", json={"source": source})
        assert answer.status_code == 403, (source, answer.text)
        assert "allowed_reload_sources" in answer.json()["error"]["message"]
        rpc = keyed.client.post("/collective_rpc", json={"method": "reload_weights", "kwargs": {"source": source}})
        assert rpc.status_code == 403
    inside = keyed.client.post("/v1/stages/solo/reload", json={"source": str(keyed.allowed_dir) + "/ckpt"})  # type: ignore[attr-defined]
    assert inside.status_code == 409 and "cannot reload weights in RUNNING" in inside.text  # past the gate


def test_collective_rpc_runs_no_other_method(keyed: Served) -> None:
    for body in (
        {"method": "execute_model"},
        {"method": "__init__"},
        {"method": "reload_weights", "args": ["x"]},
        {"method": "reload_weights", "kwargs": {"load_format": "dummy"}},
    ):
        answer = keyed.client.post("/collective_rpc", json=body)
        assert answer.status_code == 400, (body, answer.text)
