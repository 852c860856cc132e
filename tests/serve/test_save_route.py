"""SaveWeights over HTTP: `POST /v1/stages/{name}/save_weights` writes under the config's
allowed_reload_sources only (403 elsewhere, a symlink out of the root is followed no further
than the check), answers the stage's report, is 400 while the weights sleep (nothing
written), and a restart after it comes back at the saved version."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_core.client import OmniClient
from omni_core.weights_sender import WeightSender
from omni_core.workers.saved_weights import INDEX_FILE
from tests.engine.test_weight_updates import new_weights, reference
from tests.serve.conftest import PROBE, Served, make_config, serving, stage_table

ROUTE = "/v1/stages/solo/save_weights"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("saves")


@pytest.fixture(scope="module")
def save_served(root: Path) -> Iterator[Served]:
    config = make_config(stage_table("solo"), allowed_reload_sources=[str(root)], default_stage="solo")
    with serving(config) as s:
        yield s


def test_a_save_under_the_root_survives_a_restart(save_served: Served, root: Path) -> None:
    served = save_served
    with WeightSender(bucket_bytes=1 << 20) as sender:
        served.engine.update_weights("solo", sender.share(new_weights(reference(seed=4), 21)), version=6)
    served_digest = served.engine.execute("solo", PROBE)["sha256"]
    answer = served.client.post(ROUTE, json={"directory": str(root / "v6")})
    assert answer.status_code == 200, answer.text
    assert (answer.json()["command"], answer.json()["state"]) == ("SaveWeights", "RUNNING")
    assert (root / "v6" / INDEX_FILE).is_file()
    again = served.client.post(ROUTE, json={"directory": str(root / "v6")})
    assert again.status_code == 400 and "overwrite" in again.json()["error"]["message"], again.text
    restarted = served.client.post("/v1/stages/solo/restart")
    assert restarted.status_code == 200, restarted.text
    assert (restarted.json()["weights_version"], restarted.json()["weights_source"]) == (6, "disk")
    assert served.engine.execute("solo", PROBE)["sha256"] == served_digest


def test_a_directory_outside_the_root_is_403(save_served: Served, root: Path, tmp_path: Path) -> None:
    served = save_served
    outside = served.client.post(ROUTE, json={"directory": str(tmp_path / "w")})
    assert outside.status_code == 403 and "allowed_reload_sources" in outside.text, outside.text
    escape = root / "escape"
    escape.symlink_to(tmp_path)
    try:
        through = served.client.post(ROUTE, json={"directory": str(escape / "w")})
    finally:
        escape.unlink()
    assert through.status_code == 403, through.text
    dotted = served.client.post(ROUTE, json={"directory": f"{root}/../{tmp_path.name}/w"})
    assert dotted.status_code == 403, dotted.text
    assert os.listdir(tmp_path) == []


def test_a_save_while_asleep_is_400_and_writes_nothing(save_served: Served, root: Path) -> None:
    served = save_served
    served.engine.sleep("solo", level=1)
    try:
        answer = served.client.post(ROUTE, json={"directory": str(root / "asleep")})
    finally:
        served.engine.wake("solo")
    assert answer.status_code == 400, answer.text
    assert "cannot save weights in SLEEPING" in answer.json()["error"]["message"]
    assert not (root / "asleep").exists()


def test_the_body_is_strict(save_served: Served, root: Path) -> None:
    served = save_served
    for body in (
        {},
        {"directory": str(root / "x"), "overwrite": "yes"},
        {"directory": str(root / "x"), "max_file_bytes": 1},
    ):
        answer = served.client.post(ROUTE, json=body)
        assert answer.status_code == 422, (body, answer.text)
    assert not (root / "x").exists()


def test_client_and_cli_save_weights(save_served: Served, root: Path) -> None:
    served = save_served
    client = OmniClient(served.url)
    report = client.save_weights("solo", str(root / "by-client"))
    assert report["command"] == "SaveWeights" and (root / "by-client" / INDEX_FILE).is_file()
    cli = [sys.executable, "-m", "omni_core.cli", "save-weights", "solo", "--url", served.url]
    again = subprocess.run(
        [*cli, "--directory", str(root / "by-client")], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert again.returncode == 1 and "HTTP 400" in again.stderr and "overwrite" in again.stderr, again.stderr
    done = subprocess.run(
        [*cli, "--directory", str(root / "by-client"), "--overwrite"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0 and "SaveWeights -> RUNNING (OK)" in done.stdout, done.stdout + done.stderr
