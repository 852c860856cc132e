"""The engine's link plans on fake topologies: no P2P, busy peers, a tensor-parallel stage,
two commands wanting one peer, the cap on links, and the views built from a stage's spec."""

from __future__ import annotations

from omni_core.engine.link_plan import LinkLedger, LinkPlan, RankView, plan_links, rank_view
from omni_core.protocol import MAX_LINKS, LinkShare

OWN = LinkShare(None, 1.0)


def four_gpus(own: int, peers=(0, 1, 2, 3)) -> RankView:
    return RankView(("0", "1", "2", "3"), own, tuple(p for p in peers if p != own))


def test_a_rank_with_idle_p2p_peers_gets_its_own_link_and_each_peer():
    plan = plan_links({0: four_gpus(0)}, busy_gpus=())
    assert plan.links == {0: (OWN, LinkShare(1, 1.0), LinkShare(2, 1.0), LinkShare(3, 1.0))}
    assert plan.lent_gpus == {"1", "2", "3"}


def test_without_p2p_the_plan_is_empty_the_own_link_alone():
    assert plan_links({0: RankView(("0", "1"), 0, ())}, busy_gpus=()) == LinkPlan({}, frozenset())


def test_a_busy_or_lent_gpu_is_not_lent():
    plan = plan_links({0: four_gpus(0)}, busy_gpus={"2", "3"})  # a waking stage on 2, a copy lent 3
    assert plan.links == {0: (OWN, LinkShare(1, 1.0))} and plan.lent_gpus == {"1"}
    assert plan_links({0: four_gpus(0)}, busy_gpus={"1", "2", "3"}).links == {}


def test_a_tensor_parallel_stage_lends_nothing_to_itself_and_splits_the_idle_gpus():
    plan = plan_links({0: four_gpus(0), 1: four_gpus(1)}, busy_gpus=())
    assert plan.links == {0: (OWN, LinkShare(2, 1.0), LinkShare(3, 1.0))}  # rank 1 finds none left
    plan = plan_links({0: four_gpus(0, peers=(2,)), 1: four_gpus(1, peers=(3,))}, busy_gpus=())
    assert plan.links == {0: (OWN, LinkShare(2, 1.0)), 1: (OWN, LinkShare(3, 1.0))}


def test_a_gpu_is_lent_to_one_command_at_a_time():
    first = plan_links({0: four_gpus(0)}, busy_gpus=())
    second = plan_links({0: four_gpus(1)}, busy_gpus=first.lent_gpus | {"0"})  # stage on 0 copying
    assert second.links == {}
    assert not (first.lent_gpus & second.lent_gpus)


def test_peers_are_named_by_the_ranks_own_index_whatever_the_physical_order():
    view = RankView(("GPU-b", "GPU-a"), 0, (1,))  # CUDA_VISIBLE_DEVICES=GPU-b,GPU-a
    plan = plan_links({0: view}, busy_gpus={"GPU-c"})
    assert plan.links == {0: (OWN, LinkShare(1, 1.0))} and plan.lent_gpus == {"GPU-a"}


def test_a_plan_holds_at_most_max_links_paths():
    gpus = tuple(str(i) for i in range(12))
    plan = plan_links({0: RankView(gpus, 0, tuple(range(1, 12)))}, busy_gpus=())
    assert len(plan.links[0]) == MAX_LINKS


def test_views_from_the_spec_the_engine_environment_or_indices():
    assert rank_view("3,1", None, "cuda", (1,)) == RankView(("3", "1"), 0, (1,))
    assert rank_view(None, "GPU-x,GPU-y", "cuda:1", (0,)) == RankView(("GPU-x", "GPU-y"), 1, (0,))
    assert rank_view(None, None, "cuda", (1, 2)) == RankView(("0", "1", "2"), 0, (1, 2))
    assert rank_view("0", None, "cuda", (1, 0)).relay_peers == ()  # a peer it cannot see, and itself


def test_the_ledger_plans_a_task_once_lends_each_gpu_once_and_releases_at_the_end():
    ledger = LinkLedger()
    assert ledger.planned("a", "t1") is None
    first = ledger.plan("a", "t1", {0: four_gpus(0)}, busy_gpus={"0"})
    assert ledger.planned("a", "t1") is first
    assert ledger.plan("a", "t1", {0: four_gpus(0)}, busy_gpus={"0", "1", "2"}) is first  # a resend
    assert ledger.plan("b", "t2", {0: four_gpus(1)}, busy_gpus={"0"}).links == {}  # all lent to a's task
    ledger.release("a", "t1")
    assert ledger.lent == {} and ledger.plan("b", "t3", {0: four_gpus(1)}, busy_gpus={"0"}).links
    ledger.release("b")
    assert ledger.lent == {} and ledger.plan("b", "t3", {0: four_gpus(1)}, busy_gpus=()).lent_gpus == {"0", "2", "3"}
