"""How ranks start and end on this host: one fresh interpreter per rank.

`python -m omni_core.workers` never re-imports the caller's __main__, so a plain script can
start an Engine. Each process gets its rank secret (and CURVE keys, when the transport
leaves the host) through its environment only, and a pollable descriptor that becomes
readable when it exits (pidfd), so the orchestrator learns of a death from the OS, not only
from a silent socket. Nothing here decides lifecycle: it starts, watches and stops processes.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec

from omni_core.engine.spec import StageSpec
from omni_core.fsm.stage_versions import StartWeights
from omni_core.protocol.auth import RANK_SECRET_ENV, new_rank_secret
from omni_core.transport import CurveKeys
from omni_core.workers.config import WorkerConfig

if TYPE_CHECKING:  # launch imports this module
    from omni_core.engine.launch import RankHandle

TERMINATE_GRACE_S = 3.0


class RankProcess:
    def __init__(self, config: WorkerConfig, env: dict[str, str]) -> None:
        self.rank = config.rank
        self.epoch = config.epoch
        # Proves this process's Hello (protocol.auth); handed over in the environment only.
        self.secret = new_rank_secret()
        env = dict(env, **{RANK_SECRET_ENV: self.secret.hex()})
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "omni_core.workers", "--config", msgspec.json.encode(config).decode()],
            env=env,
            stdin=subprocess.DEVNULL,
        )
        self.pid: int | None = self.popen.pid  # RankHandle.pid: the orchestrator adopts the Hello's
        self.sentinel = os.pidfd_open(self.popen.pid) if hasattr(os, "pidfd_open") else None
        self.node = f"{socket.gethostname()} (local)"  # where it runs, for error messages
        self.identity: bytes | None = None  # bound by a proven Hello
        self.expected_exit = False  # we told it to go (Shutdown, restart)
        self.exit_handled = False  # its end was seen once (sentinel or poll) and acted on

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def exit_cause(self) -> str:
        """Why it ended, for RankExited and the errors built from it."""
        return f"pid {self.pid} exited with code {self.exitcode}"

    def join(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(max(0.0, timeout_s))

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def close_sentinel(self) -> None:
        if self.sentinel is not None:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
            self.sentinel = None


def worker_config(
    spec: StageSpec,
    *,
    rank: int,
    epoch: int,
    address: str,
    trace_path: str | None,
    curve: CurveKeys | None,
    parent_pid: int | None = None,
    exit_with_parent: bool = True,
    weights: StartWeights | None = None,
) -> WorkerConfig:
    """What one rank of `spec` is started with, for every launcher. Only the launcher knows
    `parent_pid` and `exit_with_parent`: the process the rank must not outlive, or that it
    should outlive its parent. `weights`: what a restart's rank starts from (the stage core's
    `start_weights`; None: its checkpoint at version 0)."""
    start = weights or StartWeights()
    return WorkerConfig(
        address=address,
        rank=rank,
        epoch=epoch,
        stage=spec.name,
        runner=spec.runner,
        runner_args=dict(spec.runner_args),
        backend=spec.backend,
        device=spec.device,
        tags=spec.tags,
        max_loras=spec.max_loras,
        max_lora_rank=spec.max_lora_rank,
        gpu_memory_fraction=spec.gpu_memory_fraction,
        verify_clean_sleep=spec.verify_clean_sleep,
        simulated_device=spec.simulated_device,
        max_frame_bytes=spec.max_frame_bytes,
        batch_max_requests=spec.batch_max_requests,
        profile_dir=spec.profile_dir,
        profile_max_s=spec.profile_max_s,
        curve_server_key=curve.server_public.decode() if curve else None,
        trace_path=trace_path,
        parent_pid=parent_pid,
        exit_with_parent=exit_with_parent,
        start_source=start.source,
        start_version=start.version,
        start_needs_reload=start.needs_reload,
    )


def spawn_ranks(
    spec: StageSpec,
    *,
    epoch: int,
    address: str,
    trace_path: str | None,
    curve: CurveKeys | None,
    weights: StartWeights | None = None,
) -> list[RankProcess]:
    """Start every rank of a stage under `epoch`; they connect to `address` and say Hello."""
    master_port = free_tcp_port()  # for runners that form a torch.distributed group
    procs = []
    for rank in range(spec.ranks):
        config = worker_config(
            spec,
            rank=rank,
            epoch=epoch,
            address=address,
            trace_path=trace_path,
            curve=curve,
            parent_pid=os.getpid(),
            weights=weights,
        )
        # torchrun-style variables for runners that form a process group, and the rank's GPU.
        env = dict(
            os.environ,
            **torchrun_env(
                rank, spec.ranks, local_rank=local_rank(spec, rank), master_addr="127.0.0.1", master_port=master_port
            ),
        )
        if spec.devices:
            env["CUDA_VISIBLE_DEVICES"] = spec.devices[rank]
        if curve is not None:
            env.update(curve.client_env())
        procs.append(RankProcess(config, env))
    return procs


def local_rank(spec: StageSpec, rank: int) -> int:
    """LOCAL_RANK of a local rank: programs open `cuda:LOCAL_RANK` (vLLM's external_launcher,
    transformers), which counts the devices this process sees. A rank given one device of its
    own (`devices`) sees it as device 0; without `devices` every rank sees them all."""
    if spec.devices and "," not in spec.devices[rank]:
        return 0
    return rank


def torchrun_env(rank: int, world: int, *, local_rank: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables torchrun sets, from which a rank's runner forms the stage's process group."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


def reap(procs: Sequence[RankHandle]) -> None:
    """Stop the processes: SIGTERM, a grace period, then SIGKILL."""
    for proc in procs:
        proc.expected_exit = True
        if proc.is_alive():
            proc.terminate()
    deadline_at = time.monotonic() + TERMINATE_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline_at - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(TERMINATE_GRACE_S)


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]  # an AF_INET address: (host, port)
        return port
