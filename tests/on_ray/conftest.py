"""A local multi-node Ray cluster for the Ray launcher's tests, started once per module.

`ray.cluster_utils.Cluster` runs several raylets on this machine, each a Ray node of its own
(its own node id, resources, worker processes and object store): a rank placed on `node_a`
runs under that raylet, and removing the node kills its raylet and every actor on it, as a
host going away does. Each node gets a small object store and few CPUs (the CI machine has
2 cores and 24 GiB); the head has no CPUs, so no rank lands there by accident. Health
checks are tightened so a removed node is declared dead in seconds, not Ray's default 30 s.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

try:
    import ray
    from ray.cluster_utils import Cluster
except ModuleNotFoundError:  # the test modules skip, naming the extra
    ray = Cluster = None
RAY_MISSING = "Ray is not installed: pip install 'omni-core[ray]' (scripts/test.sh does)"

OBJECT_STORE_BYTES = 80 << 20
NODE_CPUS = 4  # logical: what Ray may hand out, not cores


@dataclass
class LocalCluster:
    cluster: Any
    nodes: dict[str, Any]  # name -> the node's handle (node_id, remove)

    def node_id(self, name: str) -> str:
        return self.nodes[name].node_id

    def add(self, name: str, **resources: float) -> Any:
        node = self.cluster.add_node(
            num_cpus=NODE_CPUS, resources={name: 10, **resources}, object_store_memory=OBJECT_STORE_BYTES
        )
        self.cluster.wait_for_nodes()
        self.nodes[name] = node
        return node

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[LocalCluster]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
            "_system_config": {
                "health_check_period_ms": 500,
                "health_check_failure_threshold": 4,
                "health_check_initial_delay_ms": 0,
            },
        },
    )
    local = LocalCluster(cluster, {})
    try:
        for name in ("node_a", "node_b"):
            local.add(name)
        ray.init(address=cluster.address, log_to_driver=False)
        yield local
    finally:
        ray.shutdown()
        cluster.shutdown()


def live_rank_actors() -> list[dict]:
    """omni-core rank actors the GCS does not count dead (read from the GCS itself: the state
    API would need the dashboard, which these nodes do not run)."""
    from ray._private import state

    return [
        a
        for a in state.actors().values()
        if a.get("ActorClassName", "").endswith("RankActor") and a.get("State") != "DEAD"
    ]
