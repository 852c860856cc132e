"""The seam between the orchestrator and whatever runs its ranks.

The orchestrator sees a rank as a `RankHandle`: it was started, it has a secret that proves
its Hello, a descriptor the IO loop can poll that becomes readable when it ends (`sentinel`),
a way to stop it, and, for error messages, the node it runs on and why it ended. How the
rank was started — a child process here (`LocalLauncher`), a Ray actor on some node
(`omni_core.engine.ray_launcher.RayLauncher`) — stays behind `RankLauncher`. Nothing here
decides lifecycle; the stage core does.

Why a pollable descriptor for every launcher: the loop already waits on its ROUTER and a
wake-up pipe with one `zmq.Poller`; a rank's end must wake it the same way, without a
blocking call on the loop thread. Locally that is a pidfd; a launcher whose ranks end
elsewhere writes one byte to a pipe from whatever learns of the end (for Ray, the callback
of the ObjectRef of the rank's worker loop).
"""

from __future__ import annotations

from typing import Protocol

from omni_core.engine import ranks as local_ranks
from omni_core.engine.spec import StageSpec
from omni_core.fsm.stage_versions import StartWeights
from omni_core.transport import CurveKeys


class RankHandle(Protocol):
    rank: int
    epoch: int
    secret: bytes  # proves this rank's Hello (protocol.auth)
    pid: int | None  # None until known (a rank on another node reports it in its Hello)
    node: str  # where it runs, for error messages
    sentinel: int | None  # readable once it has ended; None: the loop polls is_alive()
    identity: bytes | None  # bound by a proven Hello
    expected_exit: bool  # the engine told it to go (Shutdown, restart)
    exit_handled: bool  # its end was seen once and acted on

    def is_alive(self) -> bool: ...

    def exit_cause(self) -> str: ...

    def join(self, timeout_s: float) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def close_sentinel(self) -> None: ...


class RankLauncher(Protocol):
    name: str
    # Ranks that may run on another host: the orchestrator binds tcp on `bind_host()` with
    # CURVE, whatever the address looks like.
    remote: bool

    def bind_host(self) -> str: ...

    def spawn(
        self,
        spec: StageSpec,
        *,
        epoch: int,
        address: str,
        trace_path: str | None,
        curve: CurveKeys | None,
        weights: StartWeights | None = None,
    ) -> list[RankHandle]: ...

    def reap(self, ranks: list[RankHandle]) -> None:
        """Stop the ranks (grace, then force) and release what was made for them."""

    def close(self) -> None:
        """Release what the launcher holds (placement groups, its connection)."""


class LocalLauncher:
    """Every rank a child process on this host (omni_core.engine.ranks)."""

    name = "local"
    remote = False

    def bind_host(self) -> str:
        return "127.0.0.1"

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
        return list(
            local_ranks.spawn_ranks(
                spec, epoch=epoch, address=address, trace_path=trace_path, curve=curve, weights=weights
            )
        )

    def reap(self, ranks: list[RankHandle]) -> None:
        local_ranks.reap(ranks)

    def close(self) -> None:
        pass
