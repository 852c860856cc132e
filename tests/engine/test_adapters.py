"""LoRA adapters under sleep (P-20), end to end on CPU: real rank processes of the synthetic
runner, its adapters in their own `adapters` pool. Level 1 keeps them bit for bit, level 2
leaves them gone (named by ListAdapters, requests refused naming them until added again), an
update marks them stale, capacity and rank are refused naming the limit, LRU evicts the
unpinned, and bad sources are refused with nothing loaded and the stage serving."""

from __future__ import annotations

import asyncio

import pytest

from omni_core.engine import AsyncEngine, InvalidArgumentError, RequestFailedError
from omni_core.protocol import DiskSource
from tests.engine.conftest import PROBE, small_spec

TAGS = ("weights", "kv_cache", "adapters")
MODULES = ("w0", "w2")


def adapter_stage(name: str = "lora", **overrides):
    return small_spec(name, tags=TAGS, **overrides)


def add(engine, name: str, seed: int, stage: str = "lora", **kwargs):
    return engine.add_adapter(stage, name, f"seed:{seed}", rank=4, target_modules=MODULES, **kwargs)


def data(engine, adapter: str | None = None, stage: str = "lora") -> bytes:
    return engine.execute(stage, PROBE, adapter=adapter)["data"]


def test_level_one_keeps_the_adapter_bit_for_bit_and_level_two_discards_it(engine_factory) -> None:
    engine = engine_factory(adapter_stage())
    base = data(engine)
    report = add(engine, "sql", 7)
    assert (report.command, report.status, report.state) == ("AddAdapter", "OK", "RUNNING")
    assert [(a.name, a.status, a.version) for a in report.adapters] == [("sql", "loaded", 1)]
    assert report.ranks[0].pool_bytes_after["adapters"] > 0
    tuned = engine.execute("lora", PROBE, adapter="sql", with_version=True)
    assert tuned.output["data"] != base
    assert (tuned.adapter, tuned.adapter_version, tuned.weights_version) == ("sql", 1, 0)

    slept = engine.sleep("lora", level=1)
    assert slept.ranks[0].pool_bytes_after["adapters"] == 0  # offloaded with the weights
    engine.wake("lora")
    assert data(engine, "sql") == tuned.output["data"]
    assert data(engine) == base

    engine.sleep("lora", level=2)
    engine.wake("lora")
    engine.reload_weights("lora")
    listed = engine.list_adapters("lora")
    assert [(a.name, a.status) for a in listed.adapters] == [("sql", "gone")]
    with pytest.raises(RequestFailedError, match="adapter 'sql' was discarded by a level-2 sleep"):
        data(engine, "sql")
    assert data(engine) == base  # the stage serves on without it
    add(engine, "sql", 7)
    assert data(engine, "sql") == tuned.output["data"]


def test_an_update_marks_bound_adapters_stale_and_another_base_is_refused(engine_factory, tmp_path) -> None:
    engine = engine_factory(adapter_stage())
    add(engine, "sql", 7)
    with pytest.raises(InvalidArgumentError, match="made for base weights version 3, and this rank holds version 0"):
        add(engine, "chat", 8, base_version=3)
    assert [a.name for a in engine.list_adapters("lora").adapters] == ["sql"]  # nothing loaded
    engine.update_weights("lora", DiskSource(path="seed:5"), version=2)
    assert [(a.name, a.status) for a in engine.list_adapters("lora").adapters] == [("sql", "stale")]
    with pytest.raises(RequestFailedError, match="adapter 'sql' was made for base weights version 0"):
        data(engine, "sql")
    rebound = add(engine, "sql", 7, base_version=0, rebind=True)
    assert [(a.status, a.base_version) for a in rebound.adapters] == [("loaded", 2)]
    assert engine.execute("lora", PROBE, adapter="sql", with_version=True).weights_version == 2


def test_capacity_rank_and_pins_name_their_limit_and_lru_evicts(engine_factory) -> None:
    engine = engine_factory(adapter_stage(max_loras=2, max_lora_rank=8))
    with pytest.raises(InvalidArgumentError, match="rank 16, above this stage's max_lora_rank 8"):
        engine.add_adapter("lora", "big", "seed:1", rank=16, target_modules=MODULES)
    add(engine, "a", 1)
    add(engine, "b", 2)
    data(engine, "a")  # b is now the least recently used
    report = add(engine, "c", 3)
    assert report.ranks[0].adapters_evicted == ("b",)
    assert [a.name for a in report.adapters] == ["a", "c"]
    engine.pin_adapter("lora", "a")
    engine.pin_adapter("lora", "c")
    with pytest.raises(InvalidArgumentError, match="max_loras 2 adapters are loaded and all are pinned"):
        add(engine, "d", 4)
    assert engine.pin_adapter("lora", "c").status == "ALREADY"
    engine.pin_adapter("lora", "c", False)
    assert add(engine, "d", 4).ranks[0].adapters_evicted == ("c",)
    assert engine.remove_adapter("lora", "d").status == "OK"
    assert engine.remove_adapter("lora", "d").status == "ALREADY"
    assert add(engine, "a", 1, pinned=True).status == "ALREADY"


def test_bad_sources_are_refused_naming_what_and_nothing_is_loaded(engine_factory) -> None:
    engine = engine_factory(adapter_stage())
    base = data(engine)
    with pytest.raises(InvalidArgumentError, match=r"targets modules \['q_proj'\] this model lacks"):
        engine.add_adapter("lora", "x", "seed:1", rank=4, target_modules=("q_proj",))
    with pytest.raises(InvalidArgumentError, match="reloads from 'seed:<int>'"):
        engine.add_adapter("lora", "x", "/no/such/dir", rank=4, target_modules=MODULES)
    with pytest.raises(
        InvalidArgumentError, match=r"cannot read its rank and target modules from adapter_config\.json"
    ):
        engine.add_adapter("lora", "x", "/no/such/dir")
    assert engine.list_adapters("lora").adapters == ()
    assert engine.status()["lora"]["state"] == "RUNNING"
    assert data(engine) == base
    with pytest.raises(RequestFailedError, match="adapter 'x' is not loaded on this rank"):
        data(engine, "x")


def test_adapters_outside_running_are_refused_naming_the_state(engine_factory) -> None:
    engine = engine_factory(adapter_stage(ranks=2))
    add(engine, "sql", 7)
    engine.sleep("lora")
    with pytest.raises(InvalidArgumentError, match="cannot add an adapter in SLEEPING"):
        add(engine, "chat", 8)
    listed = engine.list_adapters("lora")  # legal asleep: level 1 keeps it
    assert sorted(listed.ranks) == [0, 1]
    assert all([a.status for a in r.adapters] == ["loaded"] for r in listed.ranks.values())


def test_the_async_engine_mirrors_them() -> None:
    async def main() -> tuple[str, ...]:
        async with AsyncEngine([adapter_stage("alora")]) as engine:
            await engine.add_adapter("alora", "sql", "seed:7", rank=4, target_modules=MODULES)
            await engine.pin_adapter("alora", "sql")
            result = await engine.execute("alora", PROBE, adapter="sql", with_version=True)
            listed = await engine.list_adapters("alora")
            removed = await engine.remove_adapter("alora", "sql")
            return (result.adapter, str(listed.adapters[0].pinned), removed.status)

    assert asyncio.run(main()) == ("sql", "True", "OK")
