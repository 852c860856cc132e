"""Link plans: which host links a Sleep's or Wake's copies may use (P-18). Pure: no IO.

The engine knows every lifecycle command in flight on its node, so it can lend a command the
host links of GPUs that are idle: each rank of the command gets its own link plus the links
of peer GPUs it reaches peer to peer (its Hello's `relay_peers`), over which its fast backend
relays copies through staging buffers on the peer (`workers/backends/lanes.py`). Rules:

- a GPU's link is lent to one command's rank at a time;
- a GPU whose own stage has a lifecycle command in flight is not lent (its link is busy
  with that stage's own copies), nor is a GPU of the commanding stage itself;
- only ranks that declared Capability.MULTI_PATH get a plan; with no peer free, the plan is
  empty: the own link alone, which every worker does.

GPUs are named by their CUDA_VISIBLE_DEVICES entry (an index or a UUID), the only name the
engine and every rank agree on; a plan names the peer by the rank's own device index.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from omni_core.protocol import MAX_LINKS, LinkShare

OWN_SHARE = 1.0
PEER_SHARE = 1.0  # equal shares: 1:1 was within 2 % of the best split measured on 2 x H200


@dataclass(frozen=True)
class RankView:
    """What one rank sees: `visible[i]` is the GPU it calls cuda:i, `own` its device index,
    `relay_peers` the indices it reported reachable peer to peer."""

    visible: tuple[str, ...]
    own: int
    relay_peers: tuple[int, ...] = ()

    @property
    def own_gpu(self) -> str:
        return self.visible[self.own]


def rank_view(
    devices_entry: str | None, engine_visible: str | None, device: str, relay_peers: Iterable[int] = ()
) -> RankView:
    """A rank's view from its stage spec: `devices_entry` (its CUDA_VISIBLE_DEVICES, when the
    spec places it), else the engine's own CUDA_VISIBLE_DEVICES, else every GPU by index."""
    entries = devices_entry if devices_entry is not None else engine_visible
    peers = tuple(relay_peers)
    own = int(device.partition(":")[2] or 0)
    if entries is None:
        visible = tuple(str(i) for i in range(max((own, *peers), default=own) + 1))
    else:
        visible = tuple(e.strip() for e in entries.split(",") if e.strip())
    return RankView(visible, own, tuple(p for p in peers if p < len(visible) and p != own))


def share_bytes(total_bytes: int, shares: Sequence[float]) -> tuple[int, ...]:
    """What each link of a plan carries of `total_bytes`, by its share (relative, P-18): the
    shares' split rounded down, the rest on the first link (the own one), so the links'
    bytes sum to `total_bytes`. The engine traces it (LinkPlanned) and the trace check
    (omni_core/formal/trace_links.py) recomputes it."""
    if not shares:
        return ()
    whole = sum(shares)
    split = [int(total_bytes * share / whole) for share in shares]
    split[0] += total_bytes - sum(split)
    return tuple(split)


@dataclass(frozen=True)
class LinkPlan:
    """Each rank's links (ranks without a plan are absent) and the GPUs lent to it."""

    links: Mapping[int, tuple[LinkShare, ...]]
    lent_gpus: frozenset[str]


def plan_links(ranks: Mapping[int, RankView], busy_gpus: Iterable[str]) -> LinkPlan:
    """Lend each rank (in rank order) every free GPU it can relay through. `busy_gpus`: GPUs
    already lent to a command in flight, and the GPUs of every stage with a lifecycle command
    in flight; the commanding stage's own GPUs are added here."""
    taken = set(busy_gpus) | {view.own_gpu for view in ranks.values()}
    links: dict[int, tuple[LinkShare, ...]] = {}
    for rank in sorted(ranks):
        view = ranks[rank]
        peers: list[LinkShare] = []
        for index in view.relay_peers:
            gpu = view.visible[index]
            if gpu not in taken and len(peers) < MAX_LINKS - 1:
                taken.add(gpu)
                peers.append(LinkShare(index, PEER_SHARE))
        if peers:
            links[rank] = (LinkShare(None, OWN_SHARE), *peers)
    lent = frozenset(
        view.visible[s.peer]
        for rank, plan in links.items()
        for view in (ranks[rank],)
        for s in plan
        if s.peer is not None
    )
    return LinkPlan(links, lent)


class LinkLedger:
    """The node's lent links: which GPU is lent to which (stage, task), each task's plan
    (made once, so a resent command carries the same plan), released when the task ends."""

    def __init__(self) -> None:
        self.lent: dict[str, tuple[str, str]] = {}  # GPU -> (stage, task_id)
        self._plans: dict[tuple[str, str], LinkPlan] = {}

    def planned(self, stage: str, task_id: str) -> LinkPlan | None:
        """The task's plan if it was made already (a resent command, another rank's send)."""
        return self._plans.get((stage, task_id))

    def plan(self, stage: str, task_id: str, ranks: Mapping[int, RankView], busy_gpus: Iterable[str]) -> LinkPlan:
        key = (stage, task_id)
        if key not in self._plans:
            plan = plan_links(ranks, set(busy_gpus) | set(self.lent))
            self._plans[key] = plan
            self.lent.update(dict.fromkeys(plan.lent_gpus, key))
        return self._plans[key]

    def release(self, stage: str, task_id: str | None = None) -> None:
        """The task ended (or, with no task, every task of the stage: a restart, a failure)."""
        for key in [k for k in self._plans if k[0] == stage and task_id in (None, k[1])]:
            del self._plans[key]
        self.lent = {gpu: key for gpu, key in self.lent.items() if not (key[0] == stage and task_id in (None, key[1]))}
