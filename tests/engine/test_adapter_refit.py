"""Adapter-only refit (P-20) end to end on CPU, over the shm weight plane: real rank processes
of the synthetic runner, the adapter's tensors shared by `WeightSender` as a trainer shares
them. The tensors of a seeded adapter serve as that adapter does; a refit raises the adapter's
version, which every Result names, and serves the new tensors; a level-1 sleep keeps the refit
bit for bit; hostile or wrong tensors are refused by the weight planes' own checks, with the
adapter served on at its old version."""

from __future__ import annotations

import os

import msgspec
import pytest
import torch

from omni_core.engine import InvalidArgumentError
from omni_core.protocol import AddAdapter, ShmSource
from omni_core.runners.synthetic import SyntheticRunner
from omni_core.weight_buckets import SHM_DIR
from omni_core.weights_sender import WeightSender
from tests.engine.conftest import PROBE, SMALL_RUNNER
from tests.engine.test_adapters import MODULES, adapter_stage, add, data


def seeded_tensors(seed: int) -> dict[str, torch.Tensor]:
    """The tensors of synthetic adapter 'seed:<seed>' on MODULES, by PEFT's names."""
    runner = SyntheticRunner(torch.device("cpu"), **{k: v for k, v in SMALL_RUNNER.items() if k != "cpu_threads"})
    command = AddAdapter(
        task_id="t", epoch=0, name="x", adapter_id=1, source=f"seed:{seed}", rank=4, target_modules=MODULES
    )
    runner.add_adapter(command)
    named = {}
    for index, (a, b) in runner.adapters["x"].items():
        named[f"base_model.model.w{index}.lora_A.weight"] = a
        named[f"base_model.model.w{index}.lora_B.weight"] = b
    return named


@pytest.fixture()
def sender():
    sender = WeightSender()
    yield sender
    sender.close()


def test_a_refit_over_shm_serves_the_new_tensors_at_a_new_version(engine_factory, sender) -> None:
    engine = engine_factory(adapter_stage())
    add(engine, "seven", 7)
    add(engine, "eight", 8)
    seven, eight = data(engine, "seven"), data(engine, "eight")
    report = engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(7)))
    assert [(a.name, a.version, a.rank, a.target_modules) for a in report.adapters if a.name == "sql"] == [
        ("sql", 1, 4, MODULES)
    ]
    assert data(engine, "sql") == seven  # the tensors serve as the adapter they came from

    with pytest.raises(InvalidArgumentError, match="engine sent version 1 before: a refit needs a version above"):
        engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(8)), version=1)
    assert data(engine, "sql") == seven  # refused: nothing sent, nothing written
    engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(8)), version=2)
    refit = engine.execute("lora", PROBE, adapter="sql", with_version=True)
    assert refit.output["data"] == eight and (refit.adapter, refit.adapter_version) == ("sql", 2)

    engine.sleep("lora", level=1)
    engine.wake("lora")
    assert data(engine, "sql") == eight  # level 1 keeps the refit bit for bit


def test_wrong_or_hostile_tensors_are_refused_and_the_old_version_serves_on(engine_factory, sender, tmp_path) -> None:
    engine = engine_factory(adapter_stage())
    engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(7)))
    before = data(engine, "sql")
    named = seeded_tensors(8)
    bent = dict(named, **{"base_model.model.w0.lora_A.weight": torch.zeros(4, 64)})
    with pytest.raises(InvalidArgumentError, match=r"lora_A.weight' is float32 \[4, 64\], the model's is float32"):
        engine.add_adapter("lora", "sql", tensors=sender.share(bent), rank=4, target_modules=MODULES, version=2)
    half = {k: v for k, v in named.items() if ".w0." in k}
    with pytest.raises(InvalidArgumentError, match="2 of its 4 tensors are not sent"):
        engine.add_adapter("lora", "sql", tensors=sender.share(half), target_modules=MODULES, version=3)
    source = sender.share(named)
    (bucket,) = source.buckets
    outside = ShmSource(buckets=(msgspec.structs.replace(bucket, handle=str(tmp_path / "bucket")),))
    with pytest.raises(InvalidArgumentError, match="is not a file directly under /dev/shm"):
        engine.add_adapter("lora", "sql", tensors=outside, version=4)
    link = SHM_DIR / f"omni-test-link-{os.getpid()}"
    os.symlink(bucket.handle, link)  # a bucket named through a symlink: never followed
    try:
        linked = ShmSource(buckets=(msgspec.structs.replace(bucket, handle=str(link)),))
        with pytest.raises(InvalidArgumentError, match="is a symbolic link"):
            engine.add_adapter("lora", "sql", tensors=linked, version=5)
    finally:
        link.unlink()
    sender.close()  # the sender released its buckets: the files are gone
    with pytest.raises(InvalidArgumentError, match="cannot be opened"):
        engine.add_adapter("lora", "sql", tensors=source, version=6)
    assert engine.refit_floor("lora", "sql") == 6  # each refused refit burned its version
    with pytest.raises(InvalidArgumentError, match="engine sent version 6 before: a refit needs a version above"):
        engine.add_adapter("lora", "sql", tensors=sender.share(named), version=6)
    listed = engine.list_adapters("lora").adapters
    assert [(a.name, a.version, a.status) for a in listed] == [("sql", 1, "loaded")]
    assert data(engine, "sql") == before


def test_a_refit_by_broadcast_reaches_every_rank_of_the_weight_group(engine_factory) -> None:
    import threading

    from tests.engine.test_weight_updates import free_port

    engine = engine_factory(adapter_stage(ranks=2))
    add(engine, "eight", 8)
    eight = data(engine, "eight")
    add(engine, "sql", 7)
    port, sender = free_port(), WeightSender()
    try:
        joined = threading.Thread(target=sender.init_group, args=("127.0.0.1", port, 3), kwargs={"timeout_s": 60})
        joined.start()
        engine.init_weight_group("lora", address="127.0.0.1", port=port, world_size=3, group_timeout_s=20)
        joined.join(60)
        named = seeded_tensors(8)
        thread = sender.broadcast_in_thread(named)
        report = engine.add_adapter("lora", "sql", tensors=sender.collective_source(named), version=2)
        thread.join(60)
        assert not thread.errors  # type: ignore[attr-defined]
    finally:
        sender.close()
    assert all(
        [(a.name, a.version) for a in r.adapters if a.name == "sql"] == [("sql", 2)] for r in report.ranks.values()
    )
    refit = engine.execute("lora", PROBE, adapter="sql", with_version=True)
    assert refit.output["data"] == eight and refit.adapter_version == 2


def test_requests_around_a_refit_run_on_one_adapter_version_each(engine_factory, sender) -> None:
    """The rank frozen (SIGSTOP) with a request on it, the refit sent, another request sent: when
    it runs on, every result names the adapter version that computed it, and its output is
    that version's: no request straddles the refit, whichever order the rank takes them in."""
    import signal

    from tests.engine.conftest import in_thread, rank_pid, resume, wait_for

    engine = engine_factory(adapter_stage())
    add(engine, "seven", 7)
    add(engine, "eight", 8)
    by_version = {1: data(engine, "seven"), 2: data(engine, "eight")}
    engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(7)))
    source = sender.share(seeded_tensors(8))
    pid = rank_pid(engine, "lora", 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        before = engine.submit("lora", PROBE, adapter="sql", timeout_s=60.0, with_version=True)
        wait_for(lambda: engine.status()["lora"]["in_flight"] == 1, what="the request in flight")
        refit = in_thread(lambda: engine.add_adapter("lora", "sql", tensors=source, version=2, timeout_s=60.0))
        after = engine.submit("lora", PROBE, adapter="sql", timeout_s=60.0, with_version=True)
    finally:
        resume(pid)
    assert [a.version for a in refit.result(60).adapters if a.name == "sql"] == [2]
    for result in (before.result(60), after.result(60)):
        assert result.output["data"] == by_version[result.adapter_version]
    assert before.result(60).adapter_version == 1  # it was on the rank before the refit
    assert engine.execute("lora", PROBE, adapter="sql", with_version=True).adapter_version == 2


def test_a_refit_one_rank_refuses_is_served_on_no_rank_until_added_on_every_rank(engine_factory, sender) -> None:
    """All or none across the ranks of a stage (real processes): rank 1 refuses the refit to
    version 2 while rank 0 writes it. The refit's error says the adapter is split; each request
    naming it is then refused by the stage before any rank runs it, naming the ranks and their
    versions, while the base weights serve on; a refit every rank takes serves again."""
    from omni_core.engine import RequestRejectedError
    from tests.engine.split_runner import REFUSED_ON_RANK_1

    engine = engine_factory(adapter_stage(ranks=2, runner="tests.engine.split_runner:SplitRunner"))
    add(engine, "eight", 8)
    eight = data(engine, "eight")
    base = data(engine)
    engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(7)))
    with pytest.raises(InvalidArgumentError, match="refuses requests naming adapter 'sql' until an AddAdapter"):
        engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(8)), source=REFUSED_ON_RANK_1, version=2)
    versions = {
        rank: [a.version for a in r.adapters if a.name == "sql"]
        for rank, r in engine.list_adapters("lora").ranks.items()
    }
    assert versions == {0: [2], 1: [1]}  # the ranks disagree: the stage must serve neither
    with pytest.raises(RequestRejectedError, match=r"taken by ranks 0 \(version 2\) and refused by ranks \[1\]"):
        data(engine, "sql")
    assert data(engine) == base
    engine.add_adapter("lora", "sql", tensors=sender.share(seeded_tensors(8)), version=3)
    refit = engine.execute("lora", PROBE, adapter="sql", with_version=True)
    assert refit.output["data"] == eight and refit.adapter_version == 3
