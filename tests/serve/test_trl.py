"""TRL's clients against omni-core serve.

TRL 1.x's own `VLLMClient` (`trl/generation/vllm_client.py`, TRL 1.16.0) runs here when `trl`
is importable: install it beside the product without its dependencies (`pip download trl
--no-deps`, unzip into a directory on PYTHONPATH; torch stays as it is). Its constructor refuses
to run without vLLM installed, which this CPU machine has not (vLLM pins another torch), though
none of the calls tested sends anything of vLLM's: the test marks vLLM available to the client
module. Its weight broadcast (`init_communicator`, `update_named_param`) needs CUDA and vLLM's
NCCL engine and is not run.

TRL before 1.0 (`trl/extras/vllm_client.py` at huggingface/trl@3f05cc913b3c3715f5d6fc7ef8ccfdef34934de4)
is tested by its calls as recorded from that source: the paths with their trailing slash, the
bodies as it builds them."""

from __future__ import annotations

import pytest

from tests.serve.conftest import Served

pytestmark = pytest.mark.usefixtures("settled")  # every stage RUNNING at each test's start


def test_trls_own_vllm_client_constructs_resets_and_brackets_an_update(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    client_module = pytest.importorskip(
        "trl.generation.vllm_client", reason="trl is not importable (pip download trl --no-deps, on PYTHONPATH)"
    )
    monkeypatch.setattr(client_module, "is_vllm_available", lambda *a, **k: True)
    client = client_module.VLLMClient(base_url=served.url, connection_timeout=10)  # GET /health, GET /v1/models
    assert client.model == "synthetic"
    assert client.get_world_size() == 2  # the talker's two ranks join a weight group
    client.reset_prefix_cache()  # raises unless 200
    with client.weight_update():  # POST /start_weight_update {}, ..., POST /finish_weight_update {}
        assert served.stage("talker")["state"] == "PAUSED"  # no request runs between its updates
    assert served.stage("talker")["state"] == "RUNNING"
    assert served.client.get("/weight_info").json()["weight_version"] == "0"  # no update ran: the same version


def test_trl_pre_1_0_client_calls_as_recorded_from_its_source(served: Served) -> None:
    # VLLMClient.check_server: GET {base_url}/health/ until 200
    assert served.client.get("/health/").status_code == 200
    # init_communicator: GET /get_world_size/, then POST /init_communicator/
    world = served.client.get("/get_world_size/")
    assert world.status_code == 200 and world.json() == {"world_size": 2}, world.text
    init = served.client.post("/init_communicator/", json={"host": "0.0.0.0", "port": 51216, "world_size": 3})
    assert init.status_code == 400 and "StatelessProcessGroup with itself as the last rank" in init.text, init.text
    assert "/init_weight_transfer_engine" in init.json()["error"]["message"]
    # update_named_param: POST /update_named_param/ {"name", "dtype", "shape"}, then a PyNccl broadcast
    update = served.client.post("/update_named_param/", json={"name": "w0", "dtype": "torch.float32", "shape": [8, 8]})
    assert update.status_code == 400 and update.json()["error"]["type"] == "NotServed", update.text
    # reset_prefix_cache: POST /reset_prefix_cache/, no body
    reset = served.client.post("/reset_prefix_cache/")
    assert reset.status_code == 200 and reset.json()["stages"]["talker"]["command"] == "ResetPrefixCache", reset.text
    # generate: POST /generate/ with vLLM's sampling fields
    body = {"prompts": ["hi"], "n": 2, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0}
    body.update(top_k=-1, min_p=0.0, max_tokens=16, guided_decoding_regex=None)
    generate = served.client.post("/generate/", json=body)
    assert generate.status_code == 400 and "POST /v1/stages/{name}/execute" in generate.text, generate.text
    # close_communicator: POST /close_communicator/ (registered at exit after an init)
    assert served.client.post("/close_communicator/").status_code == 400
    # the slashed twins keep the guards of the routes they twin
    foreign = served.client.post("/reset_prefix_cache/", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403, foreign.text
