"""A weight group's rendezvous, from the caller's side: the ranks connect only where the
operator allows, and a trainer that never answers is a refused command, not a failed stage.

The destinations here are loopback addresses other than 127.0.0.1 (Linux routes 127.0.0.0/8
to this host), so an allow list of 127.0.0.1 alone stands for one that excludes a host."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.rendezvous import RendezvousPolicy
from omni_core.serve.auth import ServeRefusedError, check_bind
from omni_core.serve.server import serve
from tests.engine.conftest import PROBE, small_spec
from tests.serve.conftest import API_KEY, make_config, serving, stage_table

JOIN_CALL_S = 6.0  # the call's deadline: the join may take half of it


def _listener(host: str) -> socket.socket:
    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(16)
    sock.setblocking(False)
    return sock


def _connections(listener: socket.socket) -> int:
    """How many connections reached the listener (each accepted and closed at once)."""
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1


def test_a_rendezvous_to_a_host_not_allowed_is_refused_before_any_connection(engine_factory) -> None:
    engine = engine_factory(small_spec("r", ranks=2), allowed_weight_group_hosts=("127.0.0.1",))
    listener = _listener("127.0.0.2")
    try:
        port = listener.getsockname()[1]
        with pytest.raises(InvalidArgumentError, match=r"127\.0\.0\.2 is not in allowed_weight_group_hosts"):
            engine.init_weight_group("r", address="127.0.0.2", port=port, world_size=3, timeout_s=JOIN_CALL_S)
        # The refusal came before anything was sent: the stage ran no weight-group task.
        status = engine.status()["r"]
        assert status["state"] == "RUNNING" and status["weights_version"] == 0
        assert engine.execute("r", PROBE) is not None
        assert _connections(listener) == 0
    finally:
        listener.close()


def test_the_default_allows_loopback_only(engine_factory) -> None:
    engine = engine_factory(small_spec("r"))
    for host in ("169.254.169.254", "10.0.0.1", "8.8.8.8"):
        with pytest.raises(InvalidArgumentError, match=f"{host} is not in allowed_weight_group_hosts"):
            engine.init_weight_group("r", address=host, port=80, world_size=2, timeout_s=JOIN_CALL_S)
    assert engine.rendezvous.beyond_loopback() == []


def test_a_trainer_that_never_answers_is_refused_at_the_deadline_and_the_stage_stays(engine_factory) -> None:
    engine = engine_factory(small_spec("r", ranks=2))
    before = engine.execute("r", PROBE)
    listener = _listener("127.0.0.1")  # accepts (the kernel's backlog) and never answers
    try:
        started = time.monotonic()
        with pytest.raises(InvalidArgumentError, match=r"rendezvous .* did not complete") as refused:
            engine.init_weight_group(
                "r", address="127.0.0.1", port=listener.getsockname()[1], world_size=3, timeout_s=JOIN_CALL_S
            )
        took_s = time.monotonic() - started
        assert "stays RUNNING" in str(refused.value)
        assert took_s < JOIN_CALL_S, f"the refusal took {took_s:.1f} s, past the call's deadline"
        assert _connections(listener) >= 1  # the ranks did try the allowed host
    finally:
        listener.close()
    status = engine.status()["r"]
    assert status["state"] == "RUNNING" and status["weights_version"] == 0
    assert engine.execute("r", PROBE) == before  # same weights, serving on
    print(f"never-answering trainer: refused after {took_s:.2f} s of a {JOIN_CALL_S} s deadline")


def test_a_server_without_a_key_refuses_an_allow_list_beyond_loopback(capsys) -> None:
    with pytest.raises(ServeRefusedError, match="allowed_weight_group_hosts reaches beyond this host"):
        check_bind("127.0.0.1", None, ["10.0.0.0/8"])
    check_bind("127.0.0.1", "k" * 32, ["10.0.0.0/8"])  # with a key: the weight routes need it
    check_bind("127.0.0.1", None, [])
    config = make_config(stage_table("talker"), port=0)
    wide = type(config)(config.stages, config.server, {"allowed_weight_group_hosts": ("10.0.0.0/8",)}, config.path)
    assert serve(wide, environ={}) == 2  # refused before any rank starts
    with pytest.raises(InvalidArgumentError, match="not an address, a CIDR block"):
        RendezvousPolicy(["bad host!"])


def test_the_weight_group_routes_need_the_key_and_refuse_a_host_not_allowed() -> None:
    body = {"master_address": "169.254.169.254", "master_port": 80, "rank_offset": 1, "world_size": 2}
    with serving(make_config(stage_table("talker")), api_key=API_KEY) as served:
        for route, sent in (
            ("/init_weights_update_group", dict(body, backend="gloo")),
            ("/init_weight_transfer_engine", {"init_info": body}),
        ):
            bare = httpx.post(served.url + route, json=sent)
            assert bare.status_code == 401, bare.text
            answer = served.client.post(route, json=sent)
            assert answer.status_code == 400, answer.text
            assert "169.254.169.254 is not in allowed_weight_group_hosts" in answer.text
        assert served.stage("talker")["state"] == "RUNNING"
