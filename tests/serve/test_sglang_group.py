"""SGLang's weight group, wire-compatible both ways (`omni_core/weight_group.py`): a trainer
that creates the group with SGLang's `init_custom_process_group` (as slime, OpenRLHF, AReaL
and SGLang's tests do) joins omni-core's ranks through `POST /init_weights_update_group` and
its broadcasts are the update; and `WeightSender` joins a rank made the way SGLang's server
makes its own. The trainer's steps are `tests/serve/sglang_trainer.py`, recorded from SGLang's
source, using no omni-core code."""

from __future__ import annotations

import inspect
import socket
import threading
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import msgspec
import pytest
import torch

from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weight_group import WeightGroup, backend_device
from omni_core.weights_sender import WeightSender
from tests.serve.conftest import PROBE, SMALL_RUNNER, Served, make_config, serving, stage_table
from tests.serve.sglang_trainer import broadcast_all, init_custom_process_group, receive_all

JOIN_S = 60.0


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Served]:
    config = make_config(stage_table("pair", ranks=2), default_stage="pair")
    with serving(config) as s:
        yield s


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _weights(seed: int) -> dict[str, torch.Tensor]:
    runner = SyntheticRunner(torch.device("cpu"), **dict(SMALL_RUNNER, seed=len("pair")))
    gen = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=gen, dtype=dtype) for name, (shape, dtype) in runner.weight_specs().items()
    }


def _in_thread(call: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = call()
        except BaseException as exc:  # reported by the test after join
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_sglangs_own_trainer_joins_the_ranks_and_its_broadcast_is_the_update(two_ranks: Served) -> None:
    served, port, group_name = two_ranks, _port(), f"sglang-{uuid.uuid4().hex[:8]}"
    # SGLang's trainer: group rank 0 of 1 + 2 ranks, the stage's ranks at rank_offset 1 and 2.
    joined, trainer = _in_thread(
        lambda: init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=3, rank=0, group_name=group_name
        )
    )
    answer = served.client.post(
        "/init_weights_update_group",
        json={
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 3,
            "group_name": group_name,
            "backend": "gloo",
        },
    )
    joined.join(JOIN_S)
    assert answer.status_code == 200 and answer.json()["success"] is True, answer.text
    assert "error" not in trainer, trainer
    weights = _weights(7)
    names = list(weights)
    body = {
        "names": names,
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
        "shapes": [list(t.shape) for t in weights.values()],
        "group_name": group_name,
        "weight_version": "sglang-step-1",
    }
    sent, result = _in_thread(lambda: broadcast_all(trainer["value"], weights))
    answer = served.client.post("/update_weights_from_distributed", json=body)
    sent.join(JOIN_S)
    assert answer.status_code == 200 and answer.json()["weight_version"] == "sglang-step-1", answer.text
    assert "error" not in result, result
    broadcast_digest = served.engine.execute("pair", PROBE)["sha256"]
    # The same weights through shared memory give the same outputs: the broadcast carried them
    # whole, to both ranks, in SGLang's order.
    with WeightSender() as sender:
        served.engine.update_weights(
            "pair", sender.share(_weights(8)), version=served.engine.status()["pair"]["weights_version"] + 1
        )
        assert served.engine.execute("pair", PROBE)["sha256"] != broadcast_digest
        source = sender.share(weights)
        served.engine.update_weights("pair", source, version=served.engine.status()["pair"]["weights_version"] + 1)
    assert served.engine.execute("pair", PROBE)["sha256"] == broadcast_digest
    assert (
        served.client.get("/get_weight_version").json()["weights_version"]
        == served.engine.status()["pair"]["weights_version"]
    )
    assert msgspec.to_builtins(source)  # a source the engine took, as JSON too


def test_weight_sender_joins_a_rank_made_as_sglangs_server_makes_its() -> None:
    port, group_name = _port(), f"sender-{uuid.uuid4().hex[:8]}"
    weights = {"w0": torch.arange(12, dtype=torch.float32).view(3, 4), "w1": torch.ones(5, dtype=torch.bfloat16)}
    specs = {name: (list(t.shape), t.dtype) for name, t in weights.items()}

    def server_rank() -> dict[str, torch.Tensor]:
        group = init_custom_process_group(
            backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=1, group_name=group_name
        )
        return receive_all(group, specs)

    server, received = _in_thread(server_rank)
    with WeightSender() as sender:
        sender.init_group("127.0.0.1", port, 2, group=group_name, timeout_s=JOIN_S)
        sender.broadcast(weights)
        server.join(JOIN_S)
    assert "error" not in received, received
    for name, tensor in weights.items():
        assert torch.equal(received["value"][name], tensor), name


class RecordingStore:
    """A store that lists every key its users touch (a torch `Store` subclass over a HashStore)."""

    def __new__(cls) -> Any:
        import torch.distributed as dist

        class Recording(dist.Store):
            def __init__(self) -> None:
                super().__init__()
                self.inner, self.keys = dist.HashStore(), []

            def set(self, key: str, value: Any) -> None:
                self.keys.append(("set", key))
                self.inner.set(key, value)

            def get(self, key: str) -> Any:
                self.keys.append(("get", key))
                return self.inner.get(key)

            def add(self, key: str, amount: int) -> int:
                self.keys.append(("add", key))
                return int(self.inner.add(key, amount))

            def wait(self, keys: list[str], *timeout: Any) -> None:
                self.keys.append(("wait", tuple(keys)))
                self.inner.wait(keys, *timeout)

            def check(self, keys: list[str]) -> bool:
                return bool(self.inner.check(keys))

            def set_timeout(self, timeout: Any) -> None:
                pass

        return Recording()


def test_the_group_touches_the_keys_torchs_helper_touches_for_sglang() -> None:
    """The keys a gloo group's backend uses, made here and by SGLang's steps (torch's helper
    under `PrefixStore(group_name)`), are the same, one by one; removing a prefix, or building a
    backend per device of gloo's map, changes them."""
    import torch.distributed.distributed_c10d as c10d

    name = f"layout-{uuid.uuid4().hex[:8]}"
    theirs, ours = RecordingStore(), RecordingStore()
    options = (
        "backend_options"
        if "backend_options" in inspect.signature(c10d._new_process_group_helper).parameters
        else "pg_options"
    )
    c10d._new_process_group_helper(
        1,
        0,
        [],
        c10d.Backend("gloo"),
        c10d.PrefixStore(name, theirs),
        group_name=name,
        timeout=timedelta(seconds=JOIN_S),
        **{options: None},
    )
    WeightGroup(ours, name, 0, 1, "gloo", JOIN_S)
    assert ours.keys == theirs.keys and ours.keys, (ours.keys, theirs.keys)
    assert all(
        key.startswith(f"{name}/{name}//cpu/")
        for _, *keys in ours.keys
        for key in (keys[0] if isinstance(keys[0], tuple) else keys)
    )
    assert (backend_device("gloo"), backend_device("nccl")) == ("cpu", "cuda")
