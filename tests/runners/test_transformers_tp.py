"""The transformers runner tensor-parallel: one tiny Qwen2 sharded over a stage of two ranks
(gloo on CPU, the portable backend), end to end through an Engine.

What makes it tensor parallel and not two replicas: each rank holds about half the weights
and half the KV cache, and the tokens equal one unsharded process's. Then the lifecycle: L1,
L2 + reload (each rank cutting its own shard from the checkpoint), a weight update from
another checkpoint and back.
"""

from __future__ import annotations

import pytest
import torch

from omni_core import Engine, StageSpec
from omni_core.runners.transformers_runner import TransformersRunner

from .conftest import CPU, Pools

LLM_ARGS = {"max_seq_len": 64, "max_batch": 2, "cpu_threads": 1}
GREEDY = {"prompt_ids": [5, 6, 7, 8, 9], "max_new_tokens": 12, "stop_at_eos": False}
SAMPLED = {**GREEDY, "sampling": {"temperature": 1.0, "seed": 3}}


@pytest.fixture(scope="module")
def engine(checkpoints):
    spec = StageSpec(
        "tp",
        runner="transformers",
        ranks=2,
        backend="portable",
        admission="reject",
        runner_args={"model": str(checkpoints["qwen2"]), **LLM_ARGS},
        deadline_s=60.0,
        start_deadline_s=240.0,
        request_timeout_s=60.0,
    )
    engine = Engine([spec])
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def unsharded(checkpoints) -> dict[str, Pools]:
    """The same checkpoints in one process: what the sharded stage must compute."""
    return {
        name: Pools(TransformersRunner(CPU, model=str(checkpoints[name]), **LLM_ARGS))
        for name in ("qwen2", "qwen2-seed1")
    }


def expected(unsharded: dict[str, Pools], name: str, payload: dict) -> list[int]:
    return unsharded[name].runner.execute(payload)["token_ids"]


def test_each_rank_holds_a_shard_and_the_tokens_equal_one_process(engine, unsharded):
    assert engine.execute("tp", GREEDY)["token_ids"] == expected(unsharded, "qwen2", GREEDY)
    assert engine.execute("tp", SAMPLED)["token_ids"] == expected(unsharded, "qwen2", SAMPLED)
    whole = {
        tag: sum(t.untyped_storage().nbytes() for t in unsharded["qwen2"].runner.tensors(tag))
        for tag in ("weights", "kv_cache")
    }
    report = engine.sleep("tp", level=1)
    engine.wake("tp")
    assert len(report.ranks) == 2
    for rank in report.ranks.values():
        # Norms and rotary frequencies are replicated, everything else is split in two.
        assert 0.45 < rank.pool_bytes_before["weights"] / whole["weights"] < 0.6
        # K and V hold half the heads; the cache's few bytes of bookkeeping per layer are whole.
        assert abs(2 * rank.pool_bytes_before["kv_cache"] - whole["kv_cache"]) < 0.01 * whole["kv_cache"]


def test_sleep_levels_and_reloads_keep_the_tokens(engine, unsharded, checkpoints):
    tokens = engine.execute("tp", SAMPLED)["token_ids"]
    report = engine.sleep("tp", level=1)
    assert report.state == "SLEEPING" and all(
        r.pool_bytes_after == {"weights": 0, "kv_cache": 0} for r in report.ranks.values()
    )
    assert engine.wake("tp").state == "RUNNING"
    assert engine.execute("tp", SAMPLED)["token_ids"] == tokens
    for source, name in ((None, "qwen2"), (str(checkpoints["qwen2-seed1"]), "qwen2-seed1"), (None, "qwen2")):
        engine.sleep("tp", level=2)
        assert engine.wake("tp").state == "NEEDS_RELOAD"
        assert engine.reload_weights("tp", source=source).state == "RUNNING"
        assert engine.execute("tp", SAMPLED)["token_ids"] == expected(unsharded, name, SAMPLED)
    assert expected(unsharded, "qwen2-seed1", SAMPLED) != tokens  # the update above changed something


def test_a_trainers_update_reaches_each_rank_as_its_shard(engine, unsharded, checkpoints):
    """P-17 on a tensor-parallel stage: the full tensors of a state_dict over shm; each rank
    keeps its shard; the tokens equal one process loaded with those weights, also after a
    sleep and wake (the wake brings back the update, not the load)."""
    from safetensors.torch import load_file

    from omni_core.weights_sender import WeightSender

    with WeightSender() as sender:
        trained = load_file(checkpoints["qwen2-seed1"] / "model.safetensors")
        version = engine.status()["tp"]["weights_version"] + 1
        report = engine.update_weights("tp", sender.share(trained), version=version)
        assert report.weights_version == version and {r.weights_version for r in report.ranks.values()} == {version}
        assert engine.execute("tp", SAMPLED)["token_ids"] == expected(unsharded, "qwen2-seed1", SAMPLED)
        engine.sleep("tp", level=1)
        engine.wake("tp")
        assert engine.execute("tp", SAMPLED)["token_ids"] == expected(unsharded, "qwen2-seed1", SAMPLED)
        back = load_file(checkpoints["qwen2"] / "model.safetensors")
        engine.update_weights("tp", sender.share(back), version=version + 1)
        assert engine.execute("tp", GREEDY)["token_ids"] == expected(unsharded, "qwen2", GREEDY)


def test_heads_that_do_not_divide_are_refused_before_loading(checkpoints, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(
        ValueError,
        match=r"a stage of 3 ranks shards the model's attention heads: 4 query and 2 "
        r"key/value heads must both be divisible by 3",
    ):
        TransformersRunner(CPU, model=str(checkpoints["qwen2"]), **LLM_ARGS)


def test_a_sharding_a_reload_could_not_cut_is_refused_at_load(tmp_path):
    """Shard(dim) and Replicate are what `rank_shard` reproduces; anything else (here a Partial
    sum) is refused when the model loads, naming the tensor, not half-way through a reload."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from omni_core.runners.weights import check_placements, rank_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Module()
        model.a = torch.nn.Parameter(DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)]))
        model.b = torch.nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Replicate()]))
        check_placements(model)  # both reloadable
        assert torch.equal(rank_shard(model.a, torch.arange(8.0).reshape(4, 2)), torch.arange(8.0).reshape(4, 2))
        model.c = torch.nn.Parameter(DTensor.from_local(torch.ones(2), mesh, [Partial()]))
        refused = r"placed 'c' as P(artial)?\(sum\); this runner reloads Shard and Replicate"
        with pytest.raises(ValueError, match=refused):
            check_placements(model)
        with pytest.raises(RuntimeError, match=r"placed as P(artial)?\(sum\): only Shard and Replicate"):
            rank_shard(model.c, torch.ones(2))
    finally:
        dist.destroy_process_group()
