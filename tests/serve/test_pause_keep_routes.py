"""vLLM's /pause?mode=keep over HTTP: a request frozen mid-generation, the weights updated
through the route, /resume; the execute route's answer names the version spans."""

from __future__ import annotations

from pathlib import Path

import msgspec
import torch

from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import LONG_TIMEOUT_S, in_thread
from tests.serve.conftest import SMALL_RUNNER, make_config, serving, stage_table, wait_for

RUNNER = "tests.engine.token_runner:TokenRunner"


def test_keep_over_http_freezes_a_request_and_its_answer_names_the_spans(tmp_path: Path) -> None:
    table = stage_table("k", runner=RUNNER, max_in_flight=4, batch_max_requests=4)
    with serving(make_config(table, default_stage="k")) as served:
        payload = {
            "first": 3,
            "max_tokens": 12,
            "gate_at": 5,
            "gate": str(tmp_path / "gate"),
            "reached": str(tmp_path / "reached"),
        }
        answer = in_thread(lambda: served.client.post("/v1/stages/k/execute", json={"payload": payload}))
        wait_for(lambda: (tmp_path / "reached").exists(), what="the request at its gate")
        paused = served.client.post("/pause", params={"mode": "keep"})
        assert paused.status_code == 200 and paused.json()["status"] == "paused", paused.text
        runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len("k")))
        gen = torch.Generator().manual_seed(5)
        weights = {n: torch.randn(shape, generator=gen, dtype=dt) for n, (shape, dt) in runner.weight_specs().items()}
        (tmp_path / "gate").touch()
        with WeightSender(bucket_bytes=1 << 20) as sender:
            body = {"version": 1, "source": msgspec.to_builtins(sender.share(weights))}
            updated = served.client.post("/v1/stages/k/update_weights", json=body)
        assert updated.status_code == 200, updated.text
        assert not answer.done()
        assert served.client.post("/resume").status_code == 200
        ran = answer.result(timeout=LONG_TIMEOUT_S).json()
        assert ran["weights_version"] == 1 and len(ran["output"]["tokens"]) == 12
        assert ran["version_spans"] == [
            {"weights_version": 0, "start_token": 0},
            {"weights_version": 1, "start_token": 5},
        ]
