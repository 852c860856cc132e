"""The engine's record of each Sleep's and Wake's link plan (LinkPlanned), from a stage's
slot with the Hellos its ranks sent: what the plan was made from, each link's bytes, and
the rule that a GPU of the commanding stage is never lent, planned rank or not."""

from __future__ import annotations

from omni_core.engine.link_plan import LinkLedger, share_bytes
from omni_core.engine.spec import StageSpec
from omni_core.engine.stage_slot import StageSlot
from omni_core.fsm.trace_records import PlannedLink
from omni_core.protocol import Capability, Hello, LinkShare, Sleep, Status, Wake

POOLS = {"weights": 3000, "kv_cache": 1001}


def hello(rank: int, *capabilities: Capability, relay_peers: tuple[int, ...] = (1,)) -> Hello:
    return Hello(
        task_id="hello",
        epoch=0,
        rank=rank,
        pid=100 + rank,
        device="cuda:0",
        backend="portable",
        relay_peers=relay_peers,
        tags=("weights", "kv_cache"),
        capabilities=capabilities,
        pool_bytes=POOLS,
    )


def slot(devices: tuple[str, ...], *hellos: Hello, multi_path: bool = True) -> StageSlot:
    stage = StageSlot.of(StageSpec("a", ranks=len(devices), devices=devices, device="cuda:0", multi_path=multi_path))
    stage.hellos = {h.rank: h for h in hellos}
    return stage


def sleep(**fields) -> Sleep:
    return Sleep(task_id="s1", epoch=0, **fields)


def test_a_planned_sleep_is_recorded_with_its_view_capabilities_and_bytes_per_link():
    stage = slot(("0,2",), hello(0, Capability.MULTI_PATH, Capability.SWAP))
    command = stage.with_links(LinkLedger(), [stage], 0, sleep(), None)
    assert command.links == (LinkShare(None, 1.0), LinkShare(1, 1.0))
    record = stage.link_record(0, command, None)
    assert record is not None and record.task_id == "s1" and record.command == "Sleep"
    assert (record.visible, record.own, record.relay_peers) == (("0", "2"), 0, (1,))
    assert record.multi_path and record.swap and record.pool_bytes == 4001
    assert record.links == (PlannedLink(None, 1.0, 2001), PlannedLink(1, 1.0, 2000))


def test_a_wake_of_some_tags_counts_only_their_pool_bytes_and_other_commands_get_no_record():
    stage = slot(("0,2",), hello(0))
    record = stage.link_record(0, Wake(task_id="w1", epoch=0, tags=("kv_cache",)), None)
    assert record is not None and record.pool_bytes == 1001 and record.links == ()
    assert not record.multi_path and not record.swap  # declared neither
    assert stage.link_record(0, Sleep(task_id="s", epoch=0, incoming_bytes=7), None).incoming_bytes == 7
    assert stage.link_record(0, Status(task_id="st", epoch=0), None) is None


def test_a_stage_that_turned_multi_path_off_is_recorded_as_not_to_be_sent_links():
    stage = slot(("0,2",), hello(0, Capability.MULTI_PATH), multi_path=False)
    command = stage.with_links(LinkLedger(), [stage], 0, sleep(), None)
    record = stage.link_record(0, command, None)
    assert command.links == () and record is not None and not record.multi_path


def test_a_gpu_of_the_commanding_stage_is_not_lent_even_to_its_rank_without_multi_path():
    # Rank 0 (GPU 0) reaches GPU 1, where the stage's rank 1 runs without MULTI_PATH: rank 1
    # copies over that link itself, so it is not lent.
    stage = slot(("0,1", "1,0"), hello(0, Capability.MULTI_PATH), hello(1))
    assert stage.with_links(LinkLedger(), [stage], 0, sleep(), None).links == ()


def test_bytes_are_split_by_shares_the_rest_on_the_own_link():
    assert share_bytes(10, [1.0, 1.0, 1.0]) == (4, 3, 3)
    assert share_bytes(9, [2.0, 1.0]) == (6, 3)
    assert share_bytes(5, []) == ()
    assert sum(share_bytes(2**40 + 3, [1.0, 0.5, 0.25])) == 2**40 + 3
