"""The worker core's adapter rules (P-20), sans-IO: what AddAdapter, RemoveAdapter, PinAdapter
and ListAdapters do and refuse, what a sleep, an update and a reload do to the adapters, and
what an adapter-bound Execute is answered. Each test fails when its rule's handling goes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from lifecycle_helpers import fresh, reach_worker, wire

from omni_core.fsm.effects import AdapterEffect, ExecuteEffect
from omni_core.fsm.worker import EffectCompleted, EffectDeclined, EffectRaised
from omni_core.protocol import (
    AckStatus,
    AddAdapter,
    DiskSource,
    Execute,
    ListAdapters,
    NackReason,
    PinAdapter,
    ReloadWeights,
    RemoveAdapter,
    Result,
    Sleep,
    UpdateWeights,
    Wake,
    WorkerState,
)
from omni_core.protocol import WorkerState as W

TAGS = ("weights", "kv_cache", "adapters")


def _add(name: str = "sql", adapter_id: int = 1, **fields) -> AddAdapter:
    args = {"source": "/adapters/sql", "rank": 8, "target_modules": ("q_proj", "v_proj")} | fields
    return AddAdapter(task_id=fresh("add"), epoch=0, name=name, adapter_id=adapter_id, **args)


def _list(d) -> dict[str, str]:
    ack = d.run(ListAdapters(task_id=fresh("list"), epoch=0))
    return {a.name: a.status for a in ack.adapters}


def _worker(state: WorkerState = W.ACTIVE, **kwargs):
    return reach_worker(state, tags=TAGS, **kwargs)


def _loaded(*names: str, **kwargs):
    d = _worker(**kwargs)
    for i, name in enumerate(names, start=1):
        assert d.run(_add(name, i)).status is AckStatus.OK
    return d


def test_an_add_goes_to_the_shell_whole_and_commits_only_when_done() -> None:
    d = _worker()
    command = _add()
    step = d.send(command)
    assert step.replies == () and step.effect == AdapterEffect(command.task_id, command, ())
    assert _list_now(d) == {}  # nothing committed while the shell loads
    (ack,) = d.w.step(EffectCompleted(command.task_id)).replies
    ack = wire(ack)
    assert (ack.command, ack.status, ack.state) == ("AddAdapter", AckStatus.OK, W.ACTIVE)
    assert [(a.name, a.adapter_id, a.base_version, a.status) for a in ack.adapters] == [("sql", 1, 0, "loaded")]
    assert d.run(command) == ack  # a copy: the cached reply, no second load (P-2)
    again = d.run(_add())
    assert again.status is AckStatus.ALREADY


def _list_now(d) -> dict[str, str]:
    return {a.name: a.status for a in d.w.adapters.infos()}


def test_a_request_names_its_adapter_and_its_result_carries_it() -> None:
    d = _loaded("sql")
    step = d.send(Execute(task_id="q", epoch=0, payload=1, adapter="sql"))
    assert step.effect == ExecuteEffect("q", 1, "sql")
    (result,) = d.w.step(EffectCompleted("q", output=2)).replies
    assert isinstance(result, Result) and (result.adapter, result.adapter_version, result.weights_version) == (
        "sql",
        1,
        0,
    )
    (nack,) = d.send(Execute(task_id="q2", epoch=0, adapter="chat")).replies
    assert nack.reason is NackReason.ADAPTER_UNAVAILABLE and "adapter 'chat' is not loaded" in nack.detail


def test_level_one_keeps_the_adapters_and_level_two_leaves_them_gone() -> None:
    d = _loaded("sql")
    d.run(Sleep(task_id="s1", epoch=0, level=1))
    assert d.w.adapters.infos()[0].status == "loaded"
    d.run(Wake(task_id="w1", epoch=0))
    assert _list(d) == {"sql": "loaded"}
    d.run(Sleep(task_id="s2", epoch=0, level=2))
    assert _list(d) == {"sql": "gone"}  # the stage learns it while asleep too
    d.run(Wake(task_id="w2", epoch=0))
    d.run(ReloadWeights(task_id="r", epoch=0))
    (nack,) = d.send(Execute(task_id="q", epoch=0, adapter="sql")).replies
    assert nack.reason is NackReason.ADAPTER_UNAVAILABLE and "discarded by a level-2 sleep" in nack.detail
    assert d.run(_add()).status is AckStatus.OK  # added again: served
    assert _list(d) == {"sql": "loaded"}


def test_adapters_in_the_weights_pool_follow_the_weights() -> None:
    d = reach_worker(W.ACTIVE)  # no 'adapters' tag: they live with the weights
    d.run(_add())
    d.run(Sleep(task_id="s", epoch=0, level=2, tags=("kv_cache",)))
    assert d.w.adapters.infos()[0].status == "loaded"  # scratch went, the weights stayed
    d.run(Wake(task_id="w", epoch=0))
    d.run(Sleep(task_id="s2", epoch=0, level=2, tags=("weights",)))
    assert d.w.adapters.infos()[0].status == "gone"


def test_a_base_update_leaves_bound_adapters_stale_and_another_base_is_refused() -> None:
    d = _loaded("sql")
    (nack,) = d.send(_add("chat", 2, base_version=4)).replies
    assert nack.reason is NackReason.INVALID_ARGUMENT
    assert "made for base weights version 4, and this rank holds version 0" in nack.detail
    d.run(UpdateWeights(task_id="u", epoch=0, version=3, source=DiskSource(path="/ckpt")))
    assert _list(d) == {"sql": "stale"}
    (refused,) = d.send(Execute(task_id="q", epoch=0, adapter="sql")).replies
    assert "made for base weights version 0, and this rank holds version 3" in refused.detail
    rebound = d.run(_add(base_version=0, rebind=True))
    assert [(a.base_version, a.status) for a in rebound.adapters] == [(3, "loaded")]
    d.run(ReloadWeights(task_id="r", epoch=0))  # back to version 0: stale again
    assert _list(d) == {"sql": "stale"}


def test_capacity_evicts_the_least_recently_used_and_never_a_pinned_one() -> None:
    d = _loaded("a", "b", max_loras=2)
    d.run(Execute(task_id="use-a", epoch=0, adapter="a"))
    command = _add("c", 3)
    step = d.send(command)
    assert step.effect.evict == ("b",)
    (ack,) = d.w.step(EffectCompleted(command.task_id)).replies
    assert ack.adapters_evicted == ("b",) and [a.name for a in ack.adapters] == ["a", "c"]
    d.run(PinAdapter(task_id="p1", epoch=0, name="a"))
    d.run(PinAdapter(task_id="p2", epoch=0, name="c"))
    (full,) = d.send(_add("d", 4)).replies
    assert full.reason is NackReason.INVALID_ARGUMENT and "max_loras 2 adapters are loaded and all are pinned" in (
        full.detail
    )
    assert d.run(PinAdapter(task_id="p3", epoch=0, name="a")).status is AckStatus.ALREADY


def test_rank_ids_and_pins_are_refused_naming_what() -> None:
    d = _loaded("a", max_lora_rank=8)
    (rank,) = d.send(_add("big", 9, rank=16)).replies
    assert "rank 16, above this stage's max_lora_rank 8" in rank.detail
    (taken,) = d.send(_add("b", 1)).replies
    assert "adapter id 1 is taken by adapter 'a'" in taken.detail
    (unknown,) = d.send(PinAdapter(task_id="p", epoch=0, name="zz")).replies
    assert unknown.reason is NackReason.INVALID_ARGUMENT and "adapter 'zz' is not loaded" in unknown.detail
    assert d.run(RemoveAdapter(task_id="rm", epoch=0, name="zz")).status is AckStatus.ALREADY


def test_a_source_the_runner_refuses_loads_nothing_and_the_rank_serves_on() -> None:
    d = _loaded("a", max_loras=1)
    command = _add("b", 2)
    d.send(command)
    (nack,) = d.w.step(EffectDeclined(command.task_id, "no adapter_config.json in /adapters/sql")).replies
    assert (nack.reason, nack.state) == (NackReason.INVALID_ARGUMENT, W.ACTIVE)
    assert "nothing was loaded" in nack.detail
    assert _list(d) == {"a": "loaded"}  # the eviction it planned never ran
    again = _add("b", 2)
    d.send(again)
    (failed,) = d.w.step(EffectRaised(again.task_id, "OSError: disk gone")).replies
    assert "evicted before the load failed: ['a']" in failed.detail and not d.w.failure
    assert _list(d) == {}


@pytest.mark.parametrize("state", (W.SLEEPING, W.NEEDS_RELOAD, W.PARTIAL))
def test_adapters_move_only_with_valid_weights_awake_and_list_everywhere(state: WorkerState) -> None:
    d = _worker(state)  # PARTIAL here: the weights and adapters asleep, the scratch awake
    (nack,) = d.send(_add()).replies
    assert nack.reason is NackReason.INVALID_STATE and "ACTIVE, or PARTIAL with 'weights' awake" in nack.detail
    assert _list(d) == {}


def test_an_add_waits_for_the_adapters_pool_to_be_awake() -> None:
    d = _worker()
    d.run(Sleep(task_id="s", epoch=0, level=1))
    d.run(Wake(task_id="w", epoch=0, tags=("weights",)))
    (nack,) = d.send(_add()).replies
    assert nack.reason is NackReason.INVALID_STATE and "'adapters', the pool they live in" in nack.detail


def test_a_worker_without_the_capability_refuses_them() -> None:
    d = reach_worker(W.ACTIVE, capabilities=())
    (nack,) = d.send(_add()).replies
    assert nack.reason is NackReason.UNSUPPORTED and "capability 'adapters' not declared" in nack.detail


def _partial_scenario() -> None:
    d = _worker()
    d.run(_add("a", 9))
    d.run(RemoveAdapter(task_id=fresh("rm"), epoch=0, name="a"))
    d.run(Sleep(task_id=fresh("s"), epoch=0, level=1))
    d.run(Wake(task_id=fresh("w"), epoch=0, tags=("weights", "adapters")))
    assert d.w.state is W.PARTIAL
    d.run(_add())
    d.run(PinAdapter(task_id=fresh("pin"), epoch=0, name="sql"))
    d.run(RemoveAdapter(task_id=fresh("rm"), epoch=0, name="sql"))
    assert d.run(RemoveAdapter(task_id=fresh("rm"), epoch=0, name="sql")).status is AckStatus.ALREADY
    assert _list(d) == {}


def _already_asleep_scenario() -> None:
    for state in (W.SLEEPING, W.NEEDS_RELOAD):
        d = _worker(state)
        nack = d.run(RemoveAdapter(task_id=fresh("rm"), epoch=0, name="x"))
        assert nack.reason is NackReason.INVALID_STATE  # as the stage's row: adapters move awake only
        assert _list(d) == {}


ADAPTER_SCENARIOS: list[Callable[[], None]] = [
    test_an_add_goes_to_the_shell_whole_and_commits_only_when_done,
    test_capacity_evicts_the_least_recently_used_and_never_a_pinned_one,
    test_level_one_keeps_the_adapters_and_level_two_leaves_them_gone,
    _partial_scenario,
    _already_asleep_scenario,
]


SHM = {
    "type": "shm",
    "buckets": [
        {
            "handle": "/dev/shm/omni-weights-1-a",
            "nbytes": 64,
            "sender_pid": 1,
            "tensors": [{"name": "base_model.model.q_proj.lora_A.weight", "dtype": "float32", "shape": [4, 4]}],
        }
    ],
}


def _refit(version: int, name: str = "sql") -> AddAdapter:
    import msgspec

    from omni_core.protocol import ShmSource

    return _add(name, version=version, source="tensors:shm", tensors=msgspec.convert(SHM, ShmSource))


def test_a_refit_from_tensors_raises_the_version_and_is_never_already() -> None:
    d = _loaded("sql")
    nack = d.run(_refit(1))
    assert (nack.reason, nack.state) == (NackReason.INVALID_ARGUMENT, W.ACTIVE)
    assert "loaded at version 1; a refit from tensors must raise it, and this one says 1" in nack.detail
    ack = d.run(_refit(2))
    assert ack.status is AckStatus.OK and [(a.name, a.version) for a in ack.adapters] == [("sql", 2)]
    assert d.run(_refit(3)).status is AckStatus.OK  # the same buckets, a new version: no ALREADY
    d.run(Sleep(task_id=fresh("sleep"), epoch=0, level=2))
    d.run(Wake(task_id=fresh("wake"), epoch=0))
    d.run(ReloadWeights(task_id=fresh("reload"), epoch=0))
    assert d.run(_refit(3)).status is AckStatus.OK  # gone: pushed again at its version, served


def test_an_add_that_raised_once_writing_began_unloads_the_adapter_of_its_name() -> None:
    d = _loaded("sql")
    command = _refit(2)
    d.send(command)
    (failed,) = d.w.step(EffectRaised(command.task_id, "RuntimeError: copy failed")).replies
    assert "adapter 'sql' was unloaded (add it again)" in failed.detail and not d.w.failure
    assert "nothing was loaded" not in failed.detail
    assert _list(d) == {}
    result = d.run(Execute(task_id=fresh("q"), epoch=0, adapter="sql"))
    assert result.reason is NackReason.ADAPTER_UNAVAILABLE


def test_another_source_under_a_loaded_version_is_refused_and_a_new_version_replaces_it() -> None:
    d = _loaded("sql")
    refused = d.run(_add(source="/adapters/other"))  # version 1 again, other content
    assert refused.reason is NackReason.INVALID_ARGUMENT
    assert "'/adapters/sql'" in refused.detail and "send version 2" in refused.detail
    assert _list_now(d) == {"sql": "loaded"} and d.w.adapters.get("sql").version == 1
    replaced = d.run(_add(source="/adapters/other", version=2))
    assert replaced.status is AckStatus.OK and d.w.adapters.get("sql").version == 2
