"""Weight updates over HTTP (P-17): omni-core's `POST /v1/stages/{name}/update_weights`,
SGLang's `/update_weights_from_disk`, the version in `/v1/stages` and the metrics, the
error codes, and `omni-core update-weights`."""

from __future__ import annotations

import base64
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from omni_core.client import OmniClient, ServeError
from omni_core.engine.errors import RequestFailedError, WeightUpdateFailedError
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.serve.errors import to_http
from omni_core.serve.versions import MAX_LABELS_PER_STAGE, VersionLabels
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread, request_held_by_a_stopped_rank
from tests.serve.checkpoint_runner import write_checkpoint
from tests.serve.conftest import PROBE, SMALL_RUNNER, Served, make_config, metric_value, serving, stage_table, wait_for

ROUTE = "/v1/stages/solo/update_weights"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def weights_served(checkpoints: Path) -> Iterator[Served]:
    config = make_config(stage_table("solo"), allowed_reload_sources=[str(checkpoints)], default_stage="solo")
    with serving(config) as s:
        yield s


def _version(served: Served) -> int:
    return served.client.get("/v1/stages/solo").json()["weights_version"]


def _digest(served: Served) -> str:
    return served.engine.execute("solo", PROBE)["sha256"]


def _new_weights(seed: int) -> dict[str, torch.Tensor]:
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len("solo")))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen, dtype=dtype) * 0.05
        for name, (shape, dtype) in runner.weight_specs().items()
    }


def test_a_sender_source_as_json_updates_the_stage_and_the_version_shows(weights_served: Served) -> None:
    served = weights_served
    before, version = _digest(served), _version(served) + 1
    with WeightSender(bucket_bytes=1 << 20) as sender:
        source = msgspec.to_builtins(sender.share(_new_weights(version)))
        body = {"version": version, "source": source}
        answer = served.client.post(ROUTE, json=body, headers={"Idempotency-Key": f"upd-{version}"})
        assert answer.status_code == 200, answer.text
        report = answer.json()
        assert (report["command"], report["state"], report["weights_version"]) == ("UpdateWeights", "RUNNING", version)
        # A retry with the same key is answered from the cache: same task, no second update
        # (a second one at the same version would be refused as stale).
        again = served.client.post(ROUTE, json=body, headers={"Idempotency-Key": f"upd-{version}"})
        assert again.status_code == 200 and again.json()["task_id"] == report["task_id"], again.text
    assert _version(served) == version and _digest(served) != before
    assert served.client.get("/v1/stages").json()["stages"][0]["weights_version"] == version
    wait_for(
        lambda: metric_value(served.client.get("/metrics").text, "omni_core_weights_version", stage="solo") == version,
        what=f"omni_core_weights_version at {version}",
    )


def test_a_stale_version_is_409_naming_both_versions(weights_served: Served) -> None:
    served = weights_served
    current = _version(served)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        source = msgspec.to_builtins(sender.share(_new_weights(99)))
        if current == 0:  # bring the stage to version 1 so that 1 is stale
            assert served.client.post(ROUTE, json={"version": 1, "source": source}).status_code == 200
            current = 1
        before = _digest(served)
        answer = served.client.post(ROUTE, json={"version": current, "source": source})
    assert answer.status_code == 409, answer.text
    message = answer.json()["error"]["message"]
    assert f"weights version {current} is not above the stage's version {current}" in message, message
    assert _version(served) == current and _digest(served) == before


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"version": "2", "source": "x"}, "version"),  # nothing is converted
        ({"version": 0, "source": "x"}, "version"),
        ({"version": 1 << 64, "source": "x"}, "version"),
        ({"source": "x"}, "version"),
        ({"version": 5}, "source"),
        ({"version": 5, "source": {"type": "tape", "path": "x"}}, "source"),
        ({"version": 5, "source": {"type": "shm", "buckets": "x"}}, "source"),
        ({"version": 5, "source": {"type": "disk", "path": "x", "extra": 1}}, "source"),
        ({"version": 5, "source": {"type": "disk", "path": 7}}, "source"),
        ({"version": 5, "source": "x", "colour": "red"}, "colour"),
    ],
)
def test_a_malformed_body_is_422_naming_the_field(weights_served: Served, body: dict, field: str) -> None:
    answer = weights_served.client.post(ROUTE, json=body)
    assert answer.status_code == 422, answer.text
    error = answer.json()["error"]
    assert field in error["message"] and field in " ".join(error.get("fields") or []), error


def test_a_disk_source_is_checked_then_refused_by_the_ranks_without_effect(
    weights_served: Served, checkpoints: Path
) -> None:
    served = weights_served
    before, version = _digest(served), _version(served)
    outside = served.client.post(ROUTE, json={"version": version + 1, "source": "/etc"})
    assert outside.status_code == 403 and "allowed_reload_sources" in outside.text, outside.text
    missing = str(checkpoints / "missing")
    for source in (missing, {"type": "disk", "path": missing}):
        answer = served.client.post(ROUTE, json={"version": version + 1, "source": source})
        assert answer.status_code == 400, answer.text
        assert "every rank refused the update, nothing was written" in answer.json()["error"]["message"]
    assert _version(served) == version and _digest(served) == before
    assert served.client.get("/v1/stages/solo").json()["state"] == "RUNNING"


def test_an_shm_symlink_does_not_get_round_allowed_reload_sources(weights_served: Served, tmp_path: Path) -> None:
    """Issue 35 item 2 over HTTP: a disk path outside allowed_reload_sources is 403, so the
    attacker names a /dev/shm symlink to it as an shm bucket instead. The ranks refuse the
    symlink (400, every rank refused, nothing written): the version and outputs stay."""
    served = weights_served
    before, version = _digest(served), _version(served)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        source = msgspec.to_builtins(sender.share(_new_weights(version + 3)))
        outside = tmp_path / "checkpoint-outside-the-roots.bin"
        outside.write_bytes(Path(source["buckets"][0]["handle"]).read_bytes())  # valid weights, elsewhere
        link = Path(f"/dev/shm/omni-attack-{os.getpid()}-http")
        link.symlink_to(outside)
        try:
            source["buckets"][0]["handle"] = str(link)
            answer = served.client.post(ROUTE, json={"version": version + 1, "source": source})
        finally:
            link.unlink()
    assert answer.status_code == 400, answer.text
    assert "is a symbolic link" in answer.json()["error"]["message"], answer.text
    assert _version(served) == version and _digest(served) == before
    assert served.client.get("/v1/stages/solo").json()["state"] == "RUNNING"


def test_a_pickled_ipc_handle_is_422_saying_what_to_send(weights_served: Served) -> None:
    """A client of the old wire posts an ipc bucket with `handle`, a base64 pickle: 422, and
    the message names the typed `ipc` description that replaces it."""
    served = weights_served
    bucket = {
        "handle": base64.b64encode(pickle.dumps(("anything",))).decode(),
        "nbytes": 4,
        "sender_pid": os.getpid(),
        "tensors": [{"name": "w0", "dtype": "uint8", "shape": [4]}],
    }
    answer = served.client.post(ROUTE, json={"version": 99, "source": {"type": "ipc", "buckets": [bucket]}})
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert "send `ipc`" in message and "CudaIpcHandle" in message, message


def test_sglang_update_from_disk_keeps_its_shape_and_refuses_what_it_cannot_honour(
    weights_served: Served, checkpoints: Path
) -> None:
    served = weights_served
    version, path = _version(served), str(checkpoints / "missing")
    refused = served.client.post(
        "/update_weights_from_disk", json={"model_path": path, "weight_version": str(version + 1)}
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["success"] is False and "refused the update" in refused.json()["message"]
    # SGLang's labels are opaque and optional: none of these is refused before the ranks are asked.
    for label in (str(version), "v2", None):
        asked = served.client.post("/update_weights_from_disk", json={"model_path": path, "weight_version": label})
        assert asked.status_code == 400 and "refused the update" in asked.json()["message"], asked.text
    for body, field in (
        ({"model_path": path, "weight_version": 2}, "weight_version"),
        ({"model_path": path, "weight_version": "9", "load_format": "gguf"}, "load_format"),
        ({"model_path": path, "weight_version": "9", "token_step": 1}, "token_step"),
    ):
        answer = served.client.post("/update_weights_from_disk", json=body)
        assert answer.status_code in (400, 422) and field in answer.text, (body, answer.text)
    assert _version(served) == version


def test_a_failed_update_says_needs_reload_at_the_old_version() -> None:
    error = to_http(
        WeightUpdateFailedError(
            "solo",
            "stage 'solo': every rank failed the update to weights version 4 "
            "(rank 0: sender gone); the stage is NEEDS_RELOAD at version 3: "
            "update again or reload",
            3,
            {0: "sender gone"},
        )
    )
    assert error.status == 503
    body = error.body["error"]
    assert (body["stage"], body["state"], body["weights_version"], body["failures"]) == (
        "solo",
        "NEEDS_RELOAD",
        3,
        {"0": "sender gone"},
    )
    assert "update again or reload" in body["message"]


def test_client_and_cli_update_weights(weights_served: Served, checkpoints: Path) -> None:
    served = weights_served
    client = OmniClient(served.url)
    version = _version(served)
    before = client.execute("solo", PROBE, with_version=True)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        source = msgspec.to_builtins(sender.share(_new_weights(version + 7)))
        report = client.update_weights("solo", source, version=version + 1, idempotency_key=f"cli-{version}")
    assert report["weights_version"] == version + 1 == _version(served)
    # Each answer names the weights that produced it: the HTTP execute answer, the client.
    after = client.execute("solo", PROBE, with_version=True)
    assert (before["weights_version"], after["weights_version"]) == (version, version + 1)
    assert after["output"] == client.execute("solo", PROBE) != before["output"]
    with pytest.raises(ServeError) as info:
        client.update_weights("solo", str(checkpoints / "missing"), version=version + 2)
    assert info.value.status == 400
    cli = [sys.executable, "-m", "omni_core.cli", "update-weights", "solo", "--url", served.url]
    done = subprocess.run(
        [*cli, "--version", str(version + 2), "--source", str(checkpoints / "missing")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 1 and "HTTP 400 InvalidArgumentError" in done.stderr, done.stderr
    stale = subprocess.run(
        [*cli, "--version", str(version + 1), "--source", str(checkpoints), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert stale.returncode == 1 and f"is not above the stage's version {version + 1}" in stale.stderr, stale.stderr
    assert _version(served) == version + 1


def _lists(weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    source = WeightSender.collective_source(weights)
    return (
        [t.name for t in source.tensors],
        [t.dtype for t in source.tensors],
        [list(t.shape) for t in source.tensors],
    )


def test_sglang_and_vllm_broadcast_routes_update_over_a_gloo_group(weights_served: Served) -> None:
    served = weights_served
    version = _version(served)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender = WeightSender()
    # SGLang's default group_name, which the ranks join under and the rendezvous keys carry.
    joined = threading.Thread(
        target=sender.init_group, args=("127.0.0.1", port, 2), kwargs={"timeout_s": 60, "group": "weight_update_group"}
    )
    joined.start()
    answer = served.client.post(
        "/init_weights_update_group",
        json={"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo"},
    )
    joined.join(60)
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    try:
        v1 = _new_weights(41)
        names, dtypes, shapes = _lists(v1)
        thread = sender.broadcast_in_thread(v1)
        answer = served.client.post(
            "/update_weights_from_distributed",
            json={"names": names, "dtypes": dtypes, "shapes": shapes, "weight_version": str(version + 1)},
        )
        thread.join(60)
        assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
        assert _version(served) == version + 1
        after_sglang = _digest(served)
        # vLLM's bracket as its weight-sync clients send it: start, the update (no version: the
        # next one), finish with a label. No request runs inside it: the start paused the stage.
        started = served.client.post("/start_weight_update", json={"is_checkpoint_format": True})
        assert started.status_code == 200 and started.json()["message"] == "Weight update started", started.text
        assert served.client.get("/v1/stages/solo").json()["state"] == "PAUSED"
        v2 = _new_weights(42)
        thread = sender.broadcast_in_thread(v2)
        info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "packed": False}
        info.update(packed_buffer_size_bytes=1 << 30, packed_num_buffers=2)  # vLLM's defaults, sent as they are
        answer = served.client.post("/update_weights", json={"update_info": info})
        thread.join(60)
        assert answer.status_code == 200 and answer.json()["message"] == "Weights updated", answer.text
        assert answer.json()["weights_version"] == {"solo": version + 2} == {"solo": _version(served)}
        again = served.client.post("/start_weight_update")
        assert again.status_code == 409 and "already open" in again.text, again.text
        finished = served.client.post("/finish_weight_update", json={"weight_version": "rc-2"})
        assert finished.status_code == 200 and finished.json()["weight_version"] == "rc-2", finished.text
        assert served.client.get("/weight_info").json()["weight_version"] == "rc-2"
        assert served.client.get("/v1/stages/solo").json()["state"] == "RUNNING" and _digest(served) != after_sglang
        closed = served.client.post("/finish_weight_update")
        assert closed.status_code == 409 and "no weight update is open" in closed.text, closed.text
    finally:
        sender.close()


@pytest.mark.parametrize(
    ("route", "body", "code", "field"),
    [
        (
            "/update_weights",
            {"update_info": {"names": ["w0"], "dtype_names": [], "shapes": [[1]]}, "version": 9},
            422,
            "update_info.dtype_names",
        ),
        (
            "/update_weights",
            {"update_info": {"names": ["w0"], "dtype_names": ["float32"], "shapes": [[1]]}, "version": "9"},
            422,
            "version",
        ),
        (
            "/update_weights",
            {
                "update_info": {
                    "names": ["w0"],
                    "dtype_names": ["float32"],
                    "shapes": [[1]],
                    "packed": True,
                    "packed_buffer_size_bytes": 1 << 30,
                    "packed_num_buffers": 2,
                },
            },
            400,
            "do not unpack vLLM's packed buffers",
        ),
        ("/start_weight_update", {"is_checkpoint_format": False}, 400, "is_checkpoint_format false is not served"),
        (
            "/update_weights",
            {"update_info": {"names": ["w0"], "dtype_names": ["float33"], "shapes": [[1]]}, "version": 9},
            422,
            "update_info.dtype_names",
        ),
        (
            "/update_weights",
            {
                "update_info": {"names": ["w0"], "dtype_names": ["float32"], "shapes": [[1]], "packed": True},
                "version": 9,
            },
            400,
            "packed",
        ),
        (
            "/update_weights",
            {
                "update_info": {
                    "names": ["w0"],
                    "dtype_names": ["float32"],
                    "shapes": [[1]],
                    "ipc_handles_pickled": "gASV",
                },
                "version": 9,
            },
            422,
            "ipc_handles_pickled",
        ),
        ("/init_weight_transfer_engine", {"init_info": {}}, 422, "master_address"),
        (
            "/init_weight_transfer_engine",  # TRL 1.x's VLLMClient.init_communicator, with vLLM >= 0.28
            {"init_info": {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "packed": True}},
            400,
            "init_info.packed true is not served",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "backend": "mpi"},
            400,
            "backend",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["w0"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 9},
            422,
            "weight_version",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["w0", "w0"], "dtypes": ["float32"] * 2, "shapes": [[1]] * 2, "weight_version": "9"},
            422,
            "names",
        ),
    ],
)
def test_broadcast_routes_refuse_what_they_cannot_carry(
    weights_served: Served, route: str, body: dict, code: int, field: str
) -> None:
    version = _version(weights_served)
    answer = weights_served.client.post(route, json=body)
    assert answer.status_code == code and field in answer.text, answer.text
    assert _version(weights_served) == version


def test_sglang_update_from_tensor_is_not_served_saying_what_to_use(weights_served: Served) -> None:
    answer = weights_served.client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": ["gASV"], "load_format": None, "flush_cache": True},
    )
    assert answer.status_code == 501, answer.text
    message = answer.json()["error"]["message"]
    assert "pickle" in message and "/v1/stages/{name}/update_weights" in message


# ------------------------------------------------------------------ labels, aborts, reloads in RUNNING


@pytest.fixture(scope="module")
def ckpt_served(checkpoints: Path) -> Iterator[Served]:
    """A stage whose runner reloads from checkpoint directories (CheckpointRunner), so that
    updates from disk are honoured by its ranks."""
    table = stage_table("ckpt", runner="tests.serve.checkpoint_runner:CheckpointRunner")
    config = make_config(table, allowed_reload_sources=[str(checkpoints)], default_stage="ckpt")
    with serving(config) as s:
        yield s


def _ckpt(served: Served) -> dict:
    return served.client.get("/v1/stages/ckpt").json()


def test_sglang_version_labels_are_opaque_and_reported_back(ckpt_served: Served, checkpoints: Path) -> None:
    served = ckpt_served
    held = _ckpt(served)["weights_version"]
    step = write_checkpoint(checkpoints, "step-a", 101)
    answer = served.client.post("/update_weights_from_disk", json={"model_path": str(step), "weight_version": "rl-7"})
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    assert answer.json()["weight_version"] == "rl-7" and "weight version updated to rl-7" in answer.json()["message"]
    assert _ckpt(served)["weights_version"] == held + 1  # an opaque label: the next integer version
    for route in ("/get_weight_version", "/weight_info"):
        assert served.client.get(route).json()["weight_version"] == "rl-7"
    assert served.client.get("/get_model_info").json()["weight_version"] == "rl-7"
    # absent: the next version, its integer its label; a decimal above the stage's: that integer
    answer = served.client.post("/update_weights_from_disk", json={"model_path": str(step)})
    assert answer.status_code == 200 and _ckpt(served)["weights_version"] == held + 2, answer.text
    assert served.client.get("/get_weight_version").json()["weight_version"] == str(held + 2)
    answer = served.client.post("/update_weights_from_disk", json={"model_path": str(step), "weight_version": "900"})
    assert answer.status_code == 200 and _ckpt(served)["weights_version"] == 900, answer.text
    # A new label for the weights held; the weights and the integer unchanged.
    relabel = served.client.post("/update_weight_version", json={"new_version": "rl-7b", "abort_all_requests": True})
    assert relabel.status_code == 200 and relabel.json()["new_version"] == "rl-7b", relabel.text
    assert served.client.get("/weight_info").json() == {
        "weight_version": "rl-7b",
        "weights_version": 900,
        "stages": {"ckpt": "rl-7b"},
    }


@pytest.mark.parametrize(
    ("route", "body", "field"),
    [
        ("/update_weights_from_disk", {"weight_version": "x" * 257}, "weight_version"),
        ("/update_weights_from_disk", {"weight_version": "a\nb"}, "weight_version"),
        ("/update_weight_version", {"new_version": ""}, "new_version"),
        ("/update_weight_version", {"new_version": "y" * 300}, "new_version"),
        ("/finish_weight_update", {"weight_version": "z" * 257}, "weight_version"),
    ],
)
def test_labels_are_bounded(ckpt_served: Served, checkpoints: Path, route: str, body: dict, field: str) -> None:
    before = _ckpt(ckpt_served)["weights_version"]
    if route == "/update_weights_from_disk":
        body = dict(body, model_path=str(write_checkpoint(checkpoints, "step-b", 5)))
    answer = ckpt_served.client.post(route, json=body)
    assert answer.status_code == 422 and answer.json()["error"]["fields"] == [field], answer.text
    assert "must be 1 to 256 printable characters" in answer.text
    assert _ckpt(ckpt_served)["weights_version"] == before


def test_labels_kept_are_bounded_per_stage() -> None:
    labels = VersionLabels(["s"])
    for version in range(1, MAX_LABELS_PER_STAGE + 11):
        labels.set("s", version, f"step-{version}")
    assert labels.label("s", 1) == "1" and labels.label("s", 10) == "10"  # the oldest fell back to their integers
    assert labels.label("s", MAX_LABELS_PER_STAGE + 10) == f"step-{MAX_LABELS_PER_STAGE + 10}"
    assert len(labels._labels["s"]) == MAX_LABELS_PER_STAGE


def test_sglang_abort_all_requests_answers_the_request_in_flight_then_updates(
    ckpt_served: Served, checkpoints: Path
) -> None:
    served = ckpt_served
    held = _ckpt(served)["weights_version"]
    step = write_checkpoint(checkpoints, "step-c", 303)
    with request_held_by_a_stopped_rank(served.engine, "ckpt", rank=0) as running:
        body = {"model_path": str(step), "weight_version": "aborted-update", "abort_all_requests": True}
        updating = in_thread(lambda: served.client.post("/update_weights_from_disk", json=body))
        wait_for(running.done, what="the abort to answer the request in flight")
        with pytest.raises(RequestFailedError, match="aborted"):
            running.result()
    answer = updating.result(timeout=LONG_TIMEOUT_S)
    assert answer.status_code == 200 and answer.json()["stages"]["ckpt"]["state"] == "RUNNING", answer.text
    assert _ckpt(served)["weights_version"] == held + 1 and _ckpt(served)["state"] == "RUNNING"
    assert served.client.get("/get_weight_version").json()["weight_version"] == "aborted-update"


def test_collective_rpc_reload_on_a_running_stage_is_a_versioned_update(ckpt_served: Served, checkpoints: Path) -> None:
    served = ckpt_served
    held, before = _ckpt(served)["weights_version"], served.engine.execute("ckpt", PROBE)
    step = write_checkpoint(checkpoints, "step-d", 404)
    body = {"method": "reload_weights", "kwargs": {"source": str(step)}}
    answer = served.client.post("/collective_rpc", json=body)
    assert answer.status_code == 200, answer.text
    (report,) = answer.json()["results"]
    assert (report["command"], report["state"], report["weights_version"]) == ("UpdateWeights", "RUNNING", held + 1)
    after = served.engine.execute("ckpt", PROBE, with_version=True)
    assert after.output != before and after.weights_version == held + 1
    served.engine.pause("ckpt")
    try:
        again = served.client.post("/collective_rpc", json=body)
        assert again.status_code == 200 and again.json()["results"][0]["state"] == "PAUSED", again.text
        assert _ckpt(served)["weights_version"] == held + 2
    finally:
        served.engine.resume("ckpt")
    assert served.engine.execute("ckpt", PROBE) == after.output  # the same checkpoint: the same weights


def test_sglang_flush_cache_false_is_a_400_saying_why_where_a_cache_is_keyed_by_prompt(checkpoints: Path) -> None:
    runner_args = dict(SMALL_RUNNER, seed=len("solo"), prefix_cache_entries=8)
    config = make_config(
        stage_table("solo", runner_args=runner_args), allowed_reload_sources=[str(checkpoints)], default_stage="solo"
    )
    names, dtypes, shapes = _lists(_new_weights(1))
    bodies = {
        "/update_weights_from_disk": {"model_path": str(checkpoints / "next")},
        "/update_weights_from_distributed": {"names": names, "dtypes": dtypes, "shapes": shapes},
    }
    with serving(config) as served:
        for route, body in bodies.items():
            answer = served.client.post(route, json={**body, "weight_version": "1", "flush_cache": False})
            assert answer.status_code == 400, answer.text
            assert "flush_cache false keeps only caches keyed by weights version" in answer.text, answer.text
            assert "['prefix_states'] are keyed by prompt alone" in answer.text, answer.text
        assert _version(served) == 0
