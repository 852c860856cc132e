"""POST /v1/swap, OmniClient.swap and `omni-core swap` (P-16) on two stages sharing one
simulated device: the happy path with its idempotent retry and metrics, a third process that
holds the device (503 naming it, both stages' states in the body), and bad arguments (4xx
naming the field)."""

from __future__ import annotations

import contextlib
import io
import json
import os
from collections.abc import Iterator

import pytest

from omni_core.cli import main
from omni_core.client import OmniClient, ServeError
from omni_core.workers.simulated_device import SimulatedDevice
from tests.serve.conftest import PROBE, MiB, Served, make_config, metric_value, serving, stage_table

# Each stage holds under 3 MiB resident (2 MiB weights, 256 KiB KV, buffers): the device fits
# one and a half, so only a swap (not two running stages) moves it from one to the other.
CAPACITY_BYTES = 9 * MiB // 2
INTRUDER = "trainer"  # the third process's stage name in its file


@pytest.fixture(scope="module")
def device(tmp_path_factory) -> SimulatedDevice:
    return SimulatedDevice(str(tmp_path_factory.mktemp("gpu0")), CAPACITY_BYTES)


@pytest.fixture(scope="module")
def swapping(device: SimulatedDevice) -> Iterator[Served]:
    table = {"directory": device.directory, "capacity_bytes": device.capacity_bytes}
    config = make_config(stage_table("talker", simulated_device=table), stage_table("decoder", simulated_device=table))
    with serving(config) as served:
        yield served


@pytest.fixture
def talker_in(swapping: Served, device: SimulatedDevice) -> Served:
    """talker RUNNING, decoder SLEEPING, nobody else on the device."""
    device.remove(INTRUDER, 0, os.getpid())
    engine = swapping.engine
    if engine.status()["decoder"]["state"] == "RUNNING":
        engine.sleep("decoder")
    swapping.settle("talker")
    return swapping


def _cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_swap_route_moves_the_device_and_a_retry_is_answered_from_the_record(
    talker_in: Served, device: SimulatedDevice
) -> None:
    http = talker_in.client
    headers = {"Idempotency-Key": "swap-http-1"}
    body = {"out": "talker", "in": "decoder", "memory_wait_s": 5.0}
    first = http.post("/v1/swap", json=body, headers=headers)
    assert first.status_code == 200, first.text
    answer = first.json()
    assert (answer["outgoing"]["state"], answer["incoming"]["state"]) == ("SLEEPING", "RUNNING")
    assert (answer["outgoing"]["task_id"], answer["incoming"]["task_id"]) == (
        f"{answer['task_id']}/out",
        f"{answer['task_id']}/in",
    )
    outgoing, incoming = answer["outgoing"]["ranks"]["0"], answer["incoming"]["ranks"]["0"]
    assert outgoing["freed_bytes"] > 0 == outgoing["restored_bytes"]
    assert incoming["restored_bytes"] > 0 == incoming["freed_bytes"]
    assert device.used_bytes() <= CAPACITY_BYTES
    again = http.post("/v1/swap", json=body, headers=headers)
    assert again.status_code == 200 and again.json() == answer and again.headers["Idempotent-Replayed"] == "true"
    assert talker_in.stage("decoder")["state"] == "RUNNING"
    decoder_output = talker_in.engine.execute("decoder", PROBE)
    metrics = http.get("/metrics").text
    assert (
        metric_value(
            metrics, "omni_core_swap_duration_seconds_count", out_stage="talker", in_stage="decoder", outcome="ok"
        )
        == 1
    )  # the replay ran nothing
    events = http.get("/v1/status").json()["events"]
    assert {(e["stage"], e["command"], e.get("swap")) for e in events[-2:]} == {
        ("talker", "sleep", answer["task_id"]),
        ("decoder", "wake", answer["task_id"]),
    }
    # And back, through the client and the CLI.
    back = OmniClient(talker_in.url).swap("decoder", "talker", idempotency_key="swap-http-2")
    assert (back["outgoing"]["state"], back["incoming"]["state"]) == ("SLEEPING", "RUNNING")
    code, out, err = _cli("swap", "talker", "decoder", "--url", talker_in.url)
    assert code == 0, err
    assert talker_in.engine.execute("decoder", PROBE) == decoder_output  # restored bit-exact, twice over
    lines = out.splitlines()
    assert lines[0].startswith("talker: Sleep -> SLEEPING in ") and lines[1].startswith("decoder: Wake -> RUNNING in ")
    assert lines[2].startswith("swap ") and "both halves done" in lines[2]


def test_a_third_process_holding_the_device_fails_the_swap_naming_it(
    talker_in: Served, device: SimulatedDevice
) -> None:
    device.write(INTRUDER, 0, os.getpid(), CAPACITY_BYTES)  # the whole device: the talker leaving frees nothing
    try:
        answer = talker_in.client.post("/v1/swap", json={"out": "talker", "in": "decoder", "memory_wait_s": 0.2})
        assert answer.status_code == 503, answer.text
        error = answer.json()["error"]
        assert error["type"] == "SwapFailedError" and "stage" not in error
        message = error["message"]
        assert "outgoing stage 'talker': SLEEPING" in message and "incoming stage 'decoder'" in message
        assert error["outgoing"]["stage"] == "talker" and error["outgoing"]["report"]["state"] == "SLEEPING"
        incoming = error["incoming"]
        assert incoming["stage"] == "decoder" and incoming["error"]["type"] == "NoMemoryError"
        refusal = incoming["error"]["refusals"]["0"]
        assert f"stage {INTRUDER} rank 0, pid {os.getpid()}" in refusal, refusal
        assert talker_in.stage("decoder")["state"] == "SLEEPING"  # exactly where it was
        metrics = talker_in.client.get("/metrics").text
        assert (
            metric_value(
                metrics,
                "omni_core_swap_duration_seconds_count",
                out_stage="talker",
                in_stage="decoder",
                outcome="failed",
            )
            == 1
        )
    finally:
        device.remove(INTRUDER, 0, os.getpid())
    talker_in.engine.wake("talker")
    code, _, err = _cli("swap", "talker", "decoder", "--url", talker_in.url)  # with the device free it goes
    assert code == 0, err


def test_the_readme_curl_swap_and_its_cli_twin_are_one_request(talker_in: Served) -> None:
    """The README's pair under one key: the CLI's retry is a replay, not a 409 (it used to add
    nulls and 10.0), and the same key with another body is a 409 naming the field."""
    curl_body = b'{"out": "talker", "in": "decoder", "level": 1, "memory_wait_s": 10}'
    key = {"Idempotency-Key": "readme-swap-7", "Content-Type": "application/json"}
    first = talker_in.client.post("/v1/swap", content=curl_body, headers=key)
    assert first.status_code == 200, first.text
    code, out, err = _cli(
        "swap",
        "talker",
        "decoder",
        "--memory-wait-s",
        "10",
        "--idempotency-key",
        "readme-swap-7",
        "--url",
        talker_in.url,
        "--json",
    )
    assert code == 0, err
    assert json.loads(out) == first.json()
    assert "replayed: this is the answer to the first request with Idempotency-Key 'readme-swap-7'" in err
    assert talker_in.stage("decoder")["state"] == "RUNNING"  # nothing ran twice: no swap back
    code, _, err = _cli(
        "swap",
        "talker",
        "decoder",
        "--memory-wait-s",
        "5",
        "--idempotency-key",
        "readme-swap-7",
        "--url",
        talker_in.url,
    )
    assert code == 1
    assert "HTTP 409 IdempotencyKeyReused" in err and "with another body: field(s) ['memory_wait_s'] differ" in err
    other = talker_in.client.post("/v1/swap", content=curl_body.replace(b"10", b"5"), headers=key)
    assert other.status_code == 409 and other.json()["error"]["fields"] == ["body.memory_wait_s"]


def test_cli_names_who_holds_the_device(talker_in: Served, device: SimulatedDevice) -> None:
    device.write(INTRUDER, 0, os.getpid(), CAPACITY_BYTES)
    try:
        code, _, err = _cli("swap", "talker", "decoder", "--url", talker_in.url, "--memory-wait-s", "0.2")
    finally:
        device.remove(INTRUDER, 0, os.getpid())
    assert code == 1, err
    assert "HTTP 503 SwapFailedError: swap " in err
    assert "outgoing talker: Sleep -> SLEEPING (OK)" in err
    assert "incoming decoder: NoMemoryError: stage 'decoder'" in err
    assert "  rank 0: " in err and f"pid {os.getpid()}" in err


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"out": "talker"}, 422, "in: Field required"),
        ({"out": "talker", "in": "decoder", "bogus": 1}, 422, "bogus: Extra inputs are not permitted"),
        ({"out": "talker", "in": "talker"}, 400, "a swap needs two stages"),
        ({"out": "nope", "in": "decoder"}, 404, "unknown stage 'nope'"),
        ({"out": "talker", "in": "decoder", "level": 3}, 400, "sleep level must be 1 or 2"),
        ({"out": "talker", "in": "decoder", "memory_wait_s": -1}, 400, "memory_wait_s must be >= 0"),
        ({"out": "talker", "in": "decoder", "timeout_s": 0}, 400, "timeout_s must be a positive number"),
        ({"out": "talker", "in": "decoder", "tags": ["nope"]}, 400, "unknown tag"),
    ],
)
def test_bad_arguments_are_refused_naming_the_field(talker_in: Served, body, status, words) -> None:
    answer = talker_in.client.post("/v1/swap", json=body)
    assert answer.status_code == status and words in answer.json()["error"]["message"], answer.text
    assert talker_in.stage("talker")["state"] == "RUNNING" and talker_in.stage("decoder")["state"] == "SLEEPING"


def test_client_error_carries_both_halves(talker_in: Served, device: SimulatedDevice) -> None:
    device.write(INTRUDER, 0, os.getpid(), CAPACITY_BYTES)
    try:
        with pytest.raises(ServeError) as info:
            OmniClient(talker_in.url).swap("talker", "decoder", memory_wait_s=0.2)
    finally:
        device.remove(INTRUDER, 0, os.getpid())
    assert (info.value.status, info.value.type) == (503, "SwapFailedError")
    assert info.value.body["error"]["incoming"]["error"]["type"] == "NoMemoryError"
