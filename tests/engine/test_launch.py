"""The launcher seam and Ray placement, checked without Ray (these run in every job): what
a spec or a config file may say about placement, what a remote launcher forces on the
transport, and what a user without the `ray` extra is told."""

from __future__ import annotations

import sys

import pytest

from omni_core.config import ConfigError, parse_config
from omni_core.engine import InvalidArgumentError, LocalLauncher, RayPlacement, StageSpec
from omni_core.engine.api import make_launcher
from omni_core.engine.calls import ShutdownCall
from omni_core.engine.orchestrator import Orchestrator


def test_without_ray_the_ray_launcher_says_which_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` meets on a machine without it
    with pytest.raises(InvalidArgumentError, match=r"omni-core\[ray\]"):
        make_launcher("ray")
    assert isinstance(make_launcher(None), LocalLauncher) and isinstance(make_launcher("local"), LocalLauncher)
    with pytest.raises(InvalidArgumentError, match="'local' or 'ray'"):
        make_launcher("slurm")


@pytest.mark.parametrize(
    ("placement", "complaint"),
    [
        ({"num_gpus": -1}, "field 'num_gpus': expected a number >= 0.0, got -1"),
        ({"num_cpus": 0}, "must ask for something"),
        ({"strategy": "CLOSE"}, "field 'strategy': must be one of"),
        ({"resources": {"node_a": 0}}, r"field 'resources\[...\]': expected a number > 0.0"),
        ({"bundle_indices": (0, 1)}, "placement group of yours"),
        ({"placement_group_name": "pg", "bundle_indices": (0,)}, "one index >= 0 per rank"),
        ({"placement_group_name": "pg", "placement_group": object()}, "not both"),
    ],
)
def test_placement_mistakes_are_refused_when_the_spec_is_built(placement, complaint):
    with pytest.raises(InvalidArgumentError, match=complaint):
        StageSpec("s", ranks=2, placement=RayPlacement(**placement))


def test_fractional_gpus_and_a_users_bundles_are_accepted():
    spec = StageSpec(
        "s", ranks=2, placement=RayPlacement(num_gpus=0.5, placement_group_name="pg", bundle_indices=[3, 3])
    )
    assert spec.placement is not None and spec.placement.bundle_indices == (3, 3)


def test_a_config_file_places_stages_on_ray():
    config = parse_config(
        {
            "engine": {"launcher": "ray", "ray_address": "auto"},
            "stages": [
                {
                    "name": "llm",
                    "ranks": 2,
                    "placement": {
                        "num_gpus": 0.5,
                        "strategy": "STRICT_PACK",
                        "resources": {"node_a": 1},
                        "runtime_env": {"env_vars": {"HF_HOME": "/models"}},
                    },
                }
            ],
        }
    )
    placement = config.stages[0].placement
    assert config.engine == {"launcher": "ray", "ray_address": "auto"}
    assert placement == RayPlacement(
        num_gpus=0.5, strategy="STRICT_PACK", resources={"node_a": 1}, runtime_env={"env_vars": {"HF_HOME": "/models"}}
    )
    with pytest.raises(ConfigError, match=r"stage 'llm' \(stages\[0\]\): field 'placement.num_gpu': unknown field"):
        parse_config({"stages": [{"name": "llm", "placement": {"num_gpu": 1}}]})
    with pytest.raises(ConfigError, match="bundle_indices"):
        parse_config({"stages": [{"name": "llm", "placement": {"bundle_indices": [0]}}]})


class _Elsewhere(LocalLauncher):
    """A launcher that says its ranks live on other hosts (only the orchestrator's checks run:
    each test below is refused before anything is spawned)."""

    name = "elsewhere"
    remote = True


@pytest.mark.parametrize("kwargs", [{"transport": "ipc"}, {"curve": False}])
def test_a_remote_launcher_needs_tcp_with_curve(kwargs):
    with pytest.raises(InvalidArgumentError, match="transport must be 'tcp' and curve not False"):
        Orchestrator([StageSpec("s")], launcher=_Elsewhere(), **kwargs)


def test_a_remote_launcher_gets_curve_even_on_a_loopback_address():
    orch = Orchestrator([StageSpec("s")], launcher=_Elsewhere())  # bind_host(): 127.0.0.1
    try:
        assert orch.address.startswith("tcp://127.0.0.1:") and orch._curve is not None
    finally:
        orch.submit(None, ShutdownCall(1.0)).result(10)
        orch.join(10)


def test_local_rank_counts_the_devices_a_rank_sees() -> None:
    # vLLM's external_launcher and transformers open cuda:LOCAL_RANK: a rank given a GPU of
    # its own sees it as cuda:0, and rank 1 opening cuda:1 there would fail.
    from omni_core.engine.ranks import local_rank, torchrun_env

    own = StageSpec("s", ranks=2, devices=("0", "1"))
    shared = StageSpec("s", ranks=2)
    both = StageSpec("s", ranks=2, devices=("0,1", "0,1"))
    assert [local_rank(own, r) for r in (0, 1)] == [0, 0]
    assert [local_rank(shared, r) for r in (0, 1)] == [0, 1]
    assert [local_rank(both, r) for r in (0, 1)] == [0, 1]
    assert torchrun_env(1, 2, local_rank=0, master_addr="10.0.0.1", master_port=29500) == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
