"""SGLang's `POST /update_weights_from_ipc` (`omni_core/serve/ipc_routes.py`): the buckets
`WeightSender` shares, sent as `source`, are the stage's next version under SGLang's label;
checkpoint-engine's pickled ZMQ handles and every malformed description are refused before a
rank opens anything, the version unchanged. On a GPU, a real CUDA IPC round trip."""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import torch

from omni_core.protocol import CudaIpcHandle, IpcBucket, IpcSource, TensorSpec
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weight_buckets import dtype_name
from omni_core.weights_sender import WeightSender
from tests.serve.conftest import PROBE, SMALL_RUNNER, Served, make_config, serving, stage_table

ROUTE = "/update_weights_from_ipc"


@pytest.fixture(scope="module")
def ipc_served() -> Iterator[Served]:
    with serving(make_config(stage_table("solo"), default_stage="solo")) as s:
        yield s


def _weights(seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len("solo")))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: (torch.randn(shape, generator=gen, dtype=dtype) * 0.05).to(device)
        for name, (shape, dtype) in runner.weight_specs().items()
    }


def _held(served: Served, name: str = "solo") -> tuple[int, str]:
    return served.engine.status()[name]["weights_version"], served.engine.execute(name, PROBE)["sha256"]


def _typed_ipc_source() -> dict[str, Any]:
    """A well-formed typed CUDA IPC description (version 2 handle of a cudaMalloc block) of
    this process holding every weight of the stage's model, as msgspec.to_builtins writes it:
    what a GPU trainer's WeightSender sends."""
    specs, offset = [], 0
    for name, tensor in _weights(0).items():
        specs.append(
            TensorSpec(name=name, dtype=dtype_name(tensor.dtype), shape=tuple(tensor.shape), offset_bytes=offset)
        )
        offset += tensor.numel() * tensor.element_size()
    ipc = CudaIpcHandle(
        device=0,
        handle=bytes([2, ord("c")]) + bytes(range(64)),
        storage_offset=0,
        storage_size=offset,
        offset=0,
        size=offset,
        ref_counter_handle=f"/torch_{os.getpid()}_1234_0".encode(),
        ref_counter_offset=0,
    )
    bucket = IpcBucket(nbytes=offset, sender_pid=os.getpid(), tensors=tuple(specs), ipc=ipc)
    return msgspec.to_builtins(IpcSource(buckets=(bucket,)))


def test_shared_buckets_sent_to_update_weights_from_ipc_are_the_next_version_under_the_label(
    ipc_served: Served,
) -> None:
    served = ipc_served
    version, before = _held(served)
    weights = _weights(11)
    with WeightSender(bucket_bytes=1 << 20) as sender:
        source = msgspec.to_builtins(sender.share(weights))
        answer = served.client.post(ROUTE, json={"source": source, "weight_version": "ckpt-engine-1"})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["success"] is True and body["weight_version"] == "ckpt-engine-1", body
        assert body["stages"]["solo"]["weights_version"] == version + 1
        after = _held(served)
        assert after[0] == version + 1 and after[1] != before
        label = served.client.get("/get_weight_version").json()
        assert (label["weight_version"], label["weights_version"]) == ("ckpt-engine-1", version + 1)
        # The same weights by omni-core's own route give the same outputs: the route carried them whole.
        served.engine.update_weights("solo", sender.share(_weights(12)), version=version + 2)
        assert _held(served)[1] != after[1]
        plain = served.client.post(
            "/v1/stages/solo/update_weights",
            json={"version": version + 3, "source": msgspec.to_builtins(sender.share(weights))},
        )
        assert plain.status_code == 200, plain.text
    assert _held(served) == (version + 3, after[1])


def _pickled_bucket() -> dict[str, Any]:
    return {
        "handle": base64.b64encode(pickle.dumps(("anything",))).decode(),
        "nbytes": 4,
        "sender_pid": os.getpid(),
        "tensors": [{"name": "w0", "dtype": "uint8", "shape": [4]}],
    }


@pytest.mark.parametrize(
    ("body", "code", "needle"),
    [
        ({"zmq_handles": {"GPU-0123": "ipc:///tmp/ckpt-engine-0.sock"}}, 400, "zmq_handles"),
        ({"source": {"type": "shm", "buckets": []}, "torch_empty_cache": True}, 400, "torch_empty_cache true"),
        ({}, 422, "source is required"),
        ({"source": {"type": "disk", "path": "/etc"}}, 403, "allowed_reload_sources"),
        (
            {"source": {"type": "collective", "tensors": [{"name": "w0", "dtype": "uint8", "shape": [4]}]}},
            422,
            "'ipc' or 'shm'",
        ),
        ({"source": {"type": "ipc", "buckets": [_pickled_bucket()]}}, 422, "CudaIpcHandle"),
        ({"source": "/some/checkpoint"}, 422, "source"),
        ({"source": {"type": "ipc", "buckets": []}, "weight_version": ""}, 422, "weight_version"),
        ({"source": {"type": "ipc", "buckets": []}, "load_format": "auto"}, 422, "load_format"),
    ],
)
def test_update_weights_from_ipc_refuses_what_it_cannot_take_and_nothing_changes(
    ipc_served: Served, body: dict[str, Any], code: int, needle: str
) -> None:
    served = ipc_served
    held = _held(served)
    answer = served.client.post(ROUTE, json=body)
    assert answer.status_code == code and needle in answer.text, answer.text
    assert _held(served) == held


def test_a_storage_past_its_bound_is_refused_on_decode(ipc_served: Served) -> None:
    source = _typed_ipc_source()
    source["buckets"][0]["ipc"]["storage_size"] = 2**45  # 32 TiB: refused before any rank sees it
    held = _held(ipc_served)
    answer = ipc_served.client.post(ROUTE, json={"source": source})
    assert answer.status_code == 422 and "storage_size" in answer.text, answer.text
    assert _held(ipc_served) == held


def test_a_typed_cuda_ipc_source_on_a_cpu_stage_is_refused_by_the_ranks_saying_what_to_send(
    ipc_served: Served,
) -> None:
    held = _held(ipc_served)
    answer = ipc_served.client.post(ROUTE, json={"source": _typed_ipc_source(), "weight_version": "never"})
    assert answer.status_code == 400 and answer.json()["success"] is False, answer.text
    assert "share host buckets (shm)" in answer.json()["message"], answer.text
    assert _held(ipc_served) == held
    assert ipc_served.client.get("/get_weight_version").json()["weight_version"] != "never"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_ipc_update_through_update_weights_from_ipc() -> None:
    """A GPU stage takes the typed CUDA IPC buckets this process shares on cuda:0, and its
    outputs equal those of the same weights sent through host shared memory.

        python3 -m pytest -q -m gpu tests/serve/test_ipc_route.py
    """
    config = make_config(stage_table("solo", device="cuda:0", backend="auto"), default_stage="solo")
    weights = _weights(21, "cuda:0")
    with serving(config) as served, WeightSender(bucket_bytes=1 << 20) as sender:
        version, before = _held(served)
        source = msgspec.to_builtins(sender.share(weights))
        assert source["type"] == "ipc", source["type"]
        answer = served.client.post(ROUTE, json={"source": source, "weight_version": "gpu-1"})
        assert answer.status_code == 200 and answer.json()["weight_version"] == "gpu-1", answer.text
        through_ipc = _held(served)
        assert through_ipc[0] == version + 1 and through_ipc[1] != before
        with WeightSender(bucket_bytes=1 << 20) as host:
            served.engine.update_weights("solo", host.share(_weights(22)), version=version + 2)
            served.engine.update_weights(
                "solo", host.share({n: t.cpu() for n, t in weights.items()}), version=version + 3
            )
        assert _held(served)[1] == through_ipc[1]
