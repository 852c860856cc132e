"""Ranks as Ray actors: one actor per rank, on whichever node Ray places it.

The actor runs the same worker loop as a local rank (`omni_core.workers.process.run_worker`)
in its own process and connects back to the orchestrator over tcp with CURVE; the protocol
and the stage core do not know the difference. Ray places, starts and kills the actors; it
carries no omni-core traffic besides what starts a rank (its config, its Hello secret and
the engine's CURVE client keys, as arguments of one actor call: see docs/ray.md for who can
see them).

How the loop learns that a rank ended: the worker loop is one actor call, `run`; the
`concurrent.futures.Future` of its ObjectRef completes when the loop returns (Shutdown) or
when Ray declares the actor dead (killed, crashed, its node gone). A done-callback, which
Ray runs on its own IO thread, writes one byte into a pipe whose read end is the rank's
`sentinel`: the orchestrator polls it beside its socket, as it polls a pidfd locally, and
never blocks on Ray. A thread per rank calling `ray.wait` would do the same at the cost of
a thread each; polling `ray.wait(timeout=0)` from the loop would put Ray calls on the loop.
A rank that hangs is not Ray's to notice: the stage's deadlines fail it, as locally.

Needs the `ray` extra (`pip install 'omni-core[ray]'`); nothing imports this module unless
a Ray launcher is asked for.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.launch import RankHandle
from omni_core.engine.ranks import free_tcp_port, torchrun_env, worker_config
from omni_core.engine.spec import RayPlacement, StageSpec
from omni_core.fsm.stage_versions import StartWeights
from omni_core.protocol.auth import RANK_SECRET_ENV, new_rank_secret
from omni_core.transport import CurveKeys
from omni_core.workers.config import WorkerConfig

log = logging.getLogger("omni_core.engine.ray")

TERMINATE_GRACE_S = 3.0
MAX_CAUSE_CHARS = 400  # Ray's death messages run to many lines; the reason is the last
RAY_MISSING = (
    "the Ray launcher needs Ray on this machine and on every node: "
    "pip install 'omni-core[ray]' (it pins the tested version)"
)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise InvalidArgumentError(RAY_MISSING) from None
    return ray


class RankActor:
    """The actor body (made a Ray actor class by `RayLauncher`). Sequential: `info` is asked
    first and answers before `run` takes the actor's one thread."""

    def info(self) -> dict[str, Any]:
        import ray

        # Ray leaves this one unannotated: named here with the type it returns, so that the
        # call is typed whether or not Ray is installed where mypy runs.
        node_ip_address: Callable[[], str] = ray.util.get_node_ip_address
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": node_ip_address(),
        }

    def run(self, config_json: bytes, secret_hex: str, env: dict[str, str]) -> int:
        """The worker loop until Shutdown; its exit code. The secrets (and the torchrun-style
        variables of the stage's process group) go into this process's environment, the
        secrets only for `run_worker` to take them out again at once."""
        from omni_core.workers.process import run_worker

        config = msgspec.json.decode(config_json, type=WorkerConfig)
        os.environ[RANK_SECRET_ENV] = secret_hex
        os.environ.update(env)
        try:
            return run_worker(config)
        except SystemExit as exc:  # Ray would take a SystemExit for the actor's own exit
            return exc.code if isinstance(exc.code, int) else 1


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    line = lines[-1] if lines else text
    return line if len(line) <= MAX_CAUSE_CHARS else line[: MAX_CAUSE_CHARS - 3] + "..."


class RayRank:
    """One rank's actor, seen by the orchestrator as a `RankHandle`."""

    def __init__(self, ray: Any, actor: Any, config: WorkerConfig, env: dict[str, str], where: str) -> None:
        self._ray = ray
        self.actor = actor
        self.rank = config.rank
        self.epoch = config.epoch
        self.secret = new_rank_secret()  # fresh per rank and epoch, as locally
        self.pid: int | None = None  # reported by the actor (`info`), or adopted from its proven Hello
        self.node_id: str | None = None
        self.node = f"not placed yet ({where})"
        self.identity: bytes | None = None
        self.expected_exit = False
        self.exit_handled = False
        self._lock = threading.Lock()  # the callback's write against close_sentinel's close
        self.sentinel: int | None
        self.sentinel, self._sentinel_w = os.pipe()
        os.set_blocking(self._sentinel_w, False)
        info = actor.info.remote()
        info.future().add_done_callback(self._on_info)
        self._run = actor.run.remote(msgspec.json.encode(config), self.secret.hex(), env)
        self._done = self._run.future()
        self._done.add_done_callback(self._on_end)

    def _on_info(self, future: concurrent.futures.Future[dict[str, Any]]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # the actor died first; the run's future says why
        info = future.result()
        self.pid, self.node_id = info["pid"], info["node_id"]
        self.node = f"{info['node_id'][:12]} ({info['node_ip']})"

    def _on_end(self, _future: concurrent.futures.Future[int]) -> None:
        with self._lock:  # runs on Ray's thread: never write to a descriptor already closed
            if self.sentinel is not None:
                with contextlib.suppress(OSError):
                    os.write(self._sentinel_w, b"x")

    def is_alive(self) -> bool:
        return not self._done.done()

    def exit_cause(self) -> str:
        if not self._done.done():
            return f"actor of rank {self.rank} on node {self.node} is still running"
        if self._done.cancelled():
            return f"actor of rank {self.rank} on node {self.node}: its worker loop was cancelled"
        error = self._done.exception()
        if error is None:
            return f"worker loop of rank {self.rank} on node {self.node} returned exit code {self._done.result()}"
        return f"actor of rank {self.rank} (pid {self.pid}) on node {self.node} died: {_last_line(str(error))}"

    def join(self, timeout_s: float) -> None:
        concurrent.futures.wait([self._done], timeout=max(0.0, timeout_s))

    def terminate(self) -> None:
        # The graceful end is the protocol's Shutdown; an actor has no SIGTERM of its own.
        self.kill()

    def kill(self) -> None:
        with contextlib.suppress(Exception):  # already dead, or Ray already gone
            self._ray.kill(self.actor, no_restart=True)

    def close_sentinel(self) -> None:
        with self._lock:
            for fd in (self.sentinel, self._sentinel_w):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self.sentinel = None


class RayLauncher:
    """Ranks as actors on a Ray cluster. `address`: "auto" (the cluster this machine belongs
    to), "ray://..." is not supported (the engine must run on a cluster node, where Ray's
    node IP is one the ranks can reach), or a GCS address "host:port". An existing
    connection (ray.init already called) is used as it is and left open."""

    name = "ray"
    remote = True

    def __init__(
        self,
        address: str | None = "auto",
        *,
        namespace: str | None = None,
        runtime_env: dict[str, Any] | None = None,
        grace_s: float = TERMINATE_GRACE_S,
    ) -> None:
        ray = import_ray()
        if isinstance(address, str) and address.startswith("ray://"):
            raise InvalidArgumentError(
                f"address {address!r}: Ray Client cannot host the engine (its ranks "
                "must reach the orchestrator); run the engine on a cluster node with "
                "address='auto' or the GCS address host:port"
            )
        self._ray = ray
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            # Ray's token authentication, when the cluster has it, is read by ray.init from
            # RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH as for any driver; nothing here bypasses it.
            ray.init(address=address, namespace=namespace, runtime_env=runtime_env, log_to_driver=True)
        self.grace_s = grace_s
        self._actor_class = ray.remote(max_restarts=0, max_task_retries=0)(RankActor)
        self._groups: dict[int, Any] = {}  # id(rank) -> the placement group made for its stage

    def bind_host(self) -> str:
        address: str = self._ray.util.get_node_ip_address()  # Ray is imported untyped
        return address

    def spawn(
        self,
        spec: StageSpec,
        *,
        epoch: int,
        address: str,
        trace_path: str | None,
        curve: CurveKeys | None,
        weights: StartWeights | None = None,
    ) -> list[RankHandle]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if curve is None:
            raise InvalidArgumentError("ranks on a Ray cluster talk to the engine over CURVE; curve=False is refused")
        placement = spec.placement or RayPlacement()
        bundle = {"CPU": placement.num_cpus, "GPU": placement.num_gpus, **placement.resources}
        bundle = {k: v for k, v in bundle.items() if v}
        group, owned = self._group_for(spec, placement, bundle)
        # The stage's process group (tensor-parallel runners) meets at a port of the engine's
        # node: torch's store is served by rank 0, so rank 0 must be placed on this node (a
        # single-node placement group, as STRICT_PACK, guarantees it).
        master_addr, master_port = self.bind_host(), free_tcp_port()
        ranks: list[RankHandle] = []
        for rank in range(spec.ranks):
            index = placement.bundle_indices[rank] if placement.bundle_indices else rank
            # Its parent is a raylet; Ray ends the actor when this driver goes.
            config = worker_config(
                spec,
                rank=rank,
                epoch=epoch,
                address=address,
                trace_path=trace_path,
                curve=curve,
                exit_with_parent=False,
                weights=weights,
            )
            options: dict[str, Any] = {
                "num_cpus": placement.num_cpus,
                "num_gpus": placement.num_gpus,
                "resources": dict(placement.resources) or None,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index),
                "name": None,
                "lifetime": None,  # owned by this driver: it dies with it
            }
            if placement.runtime_env is not None:
                options["runtime_env"] = dict(placement.runtime_env)
            actor = self._actor_class.options(**options).remote()
            where = f"stage {spec.name!r} bundle {index} of placement group {group.id.hex()[:12]}"
            # Ray sets each actor's CUDA_VISIBLE_DEVICES to its own GPUs: its first is cuda:0.
            env = {
                **curve.client_env(),
                **torchrun_env(
                    rank,
                    spec.ranks,
                    master_addr=master_addr,
                    master_port=master_port,
                    local_rank=0 if placement.num_gpus else rank,
                ),
            }
            handle = RayRank(self._ray, actor, config, env, where)
            if owned:
                self._groups[id(handle)] = group
            ranks.append(handle)
        return ranks

    def _group_for(self, spec: StageSpec, placement: RayPlacement, bundle: dict[str, float]) -> tuple[Any, bool]:
        """The user's placement group, or a new one for this stage (created without waiting:
        the actors start when it is ready, and the stage's start deadline bounds that)."""
        from ray.util import get_placement_group, placement_group

        if placement.placement_group is not None:
            return placement.placement_group, False
        if placement.placement_group_name is not None:
            try:
                return get_placement_group(placement.placement_group_name), False
            except ValueError:
                raise InvalidArgumentError(
                    f"stage {spec.name!r}: no placement group named "
                    f"{placement.placement_group_name!r} in this Ray namespace; create it "
                    "first (ray.util.placement_group(..., name=...))"
                ) from None
        return placement_group([dict(bundle) for _ in range(spec.ranks)], strategy=placement.strategy), True

    def reap(self, ranks: list[Any]) -> None:
        """Kill every actor (one whose loop returned after Shutdown is still an idle actor
        process; the orchestrator waits for loops told to stop before it reaps), wait a grace
        for Ray to confirm each death, and remove the stage's own placement group."""
        groups = {}
        for rank in ranks:
            rank.expected_exit = True
            rank.kill()
            group = self._groups.pop(id(rank), None)
            if group is not None:
                groups[group.id] = group
        concurrent.futures.wait([r._done for r in ranks], timeout=self.grace_s)
        for group in groups.values():
            with contextlib.suppress(Exception):  # already removed (its node gone)
                self._ray.util.remove_placement_group(group)

    def close(self) -> None:
        for group in {g.id: g for g in self._groups.values()}.values():
            with contextlib.suppress(Exception):
                self._ray.util.remove_placement_group(group)
        self._groups.clear()
        if self._owns_connection:
            self._ray.shutdown()
