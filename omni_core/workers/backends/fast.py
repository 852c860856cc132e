"""The fast backend: omni-core's memory backend on `FastPath` (fast_path.py), vLLM's
CuMemAllocator pools moved at the speed of the host link, or of several (lanes.py).

Under `auto` it is built with a host-memory check (host_room.py): the arena is registered
only when the host can hold it, and the backend runs as `cumem` otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from omni_core.fsm.tags import WEIGHTS_TAG
from omni_core.protocol import LinkShare
from omni_core.workers.backends.base import MemoryBackend
from omni_core.workers.backends.copy_plan import nbytes_of
from omni_core.workers.backends.cumem import CumemBackend, handle_of
from omni_core.workers.backends.fast_path import FastPath
from omni_core.workers.backends.host_room import ArenaChoice, HostMemorySource, choose_arena, host_arena_lock
from omni_core.workers.backends.runs import SpanMapper
from omni_core.workers.memory_gate import MemoryGate

log = logging.getLogger("omni_core.backends.fast")

# When the arena is laid out and registered: at load (the default: never inside a sleep), on
# a thread after load (the next sleep waits for it), or at the first sleep.
PREPARE_MODES = ("load", "background", "sleep")
# Runs (runs.py) unless told otherwise: 16 GiB in 512 allocations sleeps clean in 10-14 ms
# instead of 28-43 and wakes 4-6x fewer maps (benchmarks/results/clean_sleep_gpu.md).
DEFAULT_RUN_BYTES = 512 << 20


class FastBackend(CumemBackend):
    """omni-core's memory backend on `FastPath` (see the module docstring).

    With `host_memory` given (the `auto` choice), the arena is registered only when the host
    can hold it (`host_room`); when it cannot, this backend runs as `cumem` on the same
    allocations, and `name` and `choice_reason` say so.

    `run_bytes`: None (the default) makes runs of DEFAULT_RUN_BYTES where they can be made
    safely (the driver's mapping, vLLM's frees guarded) and none elsewhere; 0: none; a
    size: runs of that size, refused where they cannot be made."""

    name = "fast"
    # Asleep at level 1, each allocation's `cpu_backup_tensor` is its slot in the arena (or,
    # run as cumem, its own backup): the cumem backend's lookup finds the host copy either
    # way. A refit written there is what the wake copies back, and the slot stays the clean
    # copy after it (the wake marks what it restored clean).
    supports_host_refit = True

    def adopt(self, tag: str) -> None:
        # The fast path's sleeps and wakes walk the allocator's own tags: a pool vLLM names
        # otherwise (its CUDA graphs') would stay resident, so it is refused here.
        MemoryBackend.adopt(self, tag)

    def __init__(
        self,
        device: torch.device,
        *,
        module: Any = None,
        ops: Any = None,
        arena_tags: tuple[str, ...] = (WEIGHTS_TAG,),
        prepare: str = "load",
        chunk_bytes: int | None = None,
        map_with: str = "driver",
        host_memory: HostMemorySource | None = None,
        run_bytes: int | None = None,
        spans: SpanMapper | None = None,
    ) -> None:
        super().__init__(device, module=module)
        if prepare not in PREPARE_MODES:
            raise ValueError(f"prepare={prepare!r}: use one of {PREPARE_MODES}")
        if host_memory is not None and prepare != "load":
            raise ValueError(
                f"prepare={prepare!r} with a host-memory check: the check holds the host's "
                "arena lock through registration, so use prepare='load'"
            )
        self.arena_tags = arena_tags
        self.prepare_mode = prepare
        self.path = FastPath(
            self.allocator,
            self._mod,
            self.device,
            ops=ops,
            chunk_bytes=chunk_bytes,
            map_with=map_with,
            run_bytes=DEFAULT_RUN_BYTES if run_bytes is None else run_bytes,
            spans=spans,
            runs_optional=run_bytes is None,
        )
        if self.path.runs is None and run_bytes is None:
            log.info("fast backend: no runs (%s)", self.path.runs_off_reason)
        self._host_memory = host_memory
        self.arena_choice: ArenaChoice | None = None

    @property
    def _fast(self) -> bool:
        return self.arena_choice is None or self.arena_choice.fits

    def track(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        # Called once a tag's tensors are allocated (and after a reload): the weights are
        # final, so their arena can be laid out and registered now, before any sleep.
        if tag not in self.arena_tags or self.prepare_mode == "sleep":
            return
        if self._host_memory is not None and self.arena_choice is None:
            self._choose()
            return
        if self._fast:
            with self._on_device():
                self.path.prepare(self.arena_tags, background=self.prepare_mode == "background")
                self._warm_relays()

    def _warm_relays(self) -> None:
        if self.prepare_mode == "load" and self.supports_links:
            self.path.warm_relays(self.relay_peers())

    def _choose(self) -> None:
        assert self._host_memory is not None
        with host_arena_lock():
            arena_bytes = sum(nbytes_of(d) for _, d in self.path.allocations(self.arena_tags))
            self.arena_choice = choose_arena(arena_bytes, self._host_memory())
            self.choice_reason = self.arena_choice.reason
            if self.arena_choice.fits:
                with self._on_device():
                    self.path.prepare(self.arena_tags)
                    self._warm_relays()
        if not self.arena_choice.fits:
            self.name = "cumem"
        log.info("%s", self.choice_reason)

    @property
    def supports_links(self) -> bool:  # type: ignore[override]
        return self._fast

    def relay_peers(self) -> tuple[int, ...]:
        """The other GPUs this process sees that its device reaches peer to peer
        (CUDA_VISIBLE_DEVICES decides what it sees)."""
        own = self.device.index
        if self.device.type != "cuda" or own is None:
            return ()
        peers = range(torch.cuda.device_count())
        return tuple(p for p in peers if p != own and torch.cuda.can_device_access_peer(own, p))

    @property
    def supports_late_release(self) -> bool:  # type: ignore[override]
        """Late release only with runs: releasing 512 separate allocations after the last copy
        made a 16 GiB swap slower than releasing each as its copy lands (H100: 1.24 x against
        1.36 x faster than sequential); with runs, a few unmaps, it made it faster (1.50 x)."""
        return self.path.runs is not None

    def _sleep(
        self,
        offload: frozenset[str],
        discard: frozenset[str],
        links: Sequence[LinkShare] = (),
        release_late: bool = False,
    ) -> None:
        if not self._fast:
            super()._sleep(offload, discard)
            return
        self.sleep_paths.append("fast" if not links else f"fast over {len(links)} links")
        with self._on_device():
            self.path.sleep(offload, discard, links, release_late=release_late)

    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None, links: Sequence[LinkShare] = ()) -> None:
        if not self._fast:
            super()._wake(tags, gate)
            return
        with self._on_device():
            self.path.wake(tags, gate, links)

    def declare_read_only(self, tags: Iterable[str], *, verify: bool = False) -> None:
        self.path.clean_tags = frozenset(tags)
        self.path.verify_clean = verify

    def invalidate(self, tags: Iterable[str]) -> None:
        self.path.invalidate(tags)

    def _is_asleep(self, data: Any) -> bool:
        if not self._fast:
            return super()._is_asleep(data)
        return self.path.is_asleep(handle_of(data).d_mem, data)

    def _host_bytes(self) -> int:
        return self.path.backed_bytes() if self._fast else super()._host_bytes()

    def stats(self) -> dict[str, Any]:
        s = self.path.stats
        return {
            "arena_bytes": self.path.arena_bytes(),
            "arena_prepare_s": s.arena_prepare_s,
            "arena_touch_s": s.arena_touch_s,
            "arena_register_s": s.arena_register_s,
            "late_arena_bytes": s.late_arena_bytes,
            "late_arena_s": s.late_arena_s,
            "snapshot_bytes": s.snapshot_bytes,
            "snapshot_s": s.snapshot_s,
            "last": dict(s.last),
            "mapped_runs": self.path.runs.mapped_runs if self.path.runs is not None else 0,
            "runs": f"of {self.path.runs.max_bytes} bytes" if self.path.runs is not None else self.path.runs_off_reason,
            "choice_reason": self.choice_reason,
        }

    def release(self) -> None:
        super().release()
        self.path.release()
