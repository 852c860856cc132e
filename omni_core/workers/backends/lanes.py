"""Lanes: the paths a sleep's or a wake's bytes take between the host and the rank's GPU.

One PCIe x16 link carries about 55 GB/s each way, and the `fast` path already runs at
97-99 % of it. On a machine whose GPUs are joined by NVLink every GPU has a host link of its
own, idle while another GPU's stage wakes. A `RelayLane` moves bytes through such a peer:
host -> peer over the peer's own link, then peer -> this GPU over NVLink (a wake), or the
other way round (a sleep), through a few staging buffers on the peer, double-buffered so
that both hops run at once.

Architecture (why a relay inside the rank's process): the rank opens a CUDA context on the
peer and allocates the staging buffers there itself. The alternatives were a mover process
per node (every byte's owner would have to export its allocations to it: handles to
authenticate and bound, a second process to fail) and the peer stage's rank lending its
link (two ranks of two stages in one copy, each able to fail the other's command). A
context costs the peer about 0.5 GiB once and the staging buffers `slots x slot_bytes`
during the command; both are counted in the lender's budget by the engine's link plan.

`DirectLane` is one stream on the rank's own device: what the fast path always used. A
`LanePicker` hands each copy to the lane with the least work per unit of its share, so the
bytes split as the plan's shares say. Everything here goes through an `ops` object (the CUDA
runtime on a GPU, a scheduler that runs streams in random order in the CPU tests).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

log = logging.getLogger("omni_core.backends.fast")

MiB = 1 << 20
DEFAULT_SLOT_BYTES = 64 * MiB
DEFAULT_SLOTS = 2


class RelayFailed(RuntimeError):
    """A relay through a peer GPU failed (its staging, a copy or an event): the command
    finishes on the own link; nothing half-copied is kept."""

    def __init__(self, peer: int | None, cause: BaseException) -> None:
        super().__init__(f"the relay through cuda:{peer} failed ({type(cause).__name__}: {cause})")
        self.peer = peer


class Lane(Protocol):
    """A path for copies; copies on one lane complete in the order they were issued."""

    name: str

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool) -> None:
        """Queue a copy between host address `src`/`dst` and the rank's device."""

    def record(self) -> Any:
        """An event that completes once every copy queued so far on this lane has landed."""


class DirectLane:
    """One stream on the rank's own device, over its own host link."""

    def __init__(self, ops: Any, stream: Any, index: int = 0) -> None:
        self.ops, self.stream, self.name = ops, stream, f"direct/{index}"

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool) -> None:
        self.ops.copy(dst, src, nbytes, to_device, self.stream)

    def record(self) -> Any:
        return self.ops.record(self.stream)


class RelayLane:
    """Bytes through a peer GPU's host link and NVLink, staged in `slots` buffers on the peer.

    A wake's piece goes host -> staging on the peer's stream, then staging -> device on the
    hop stream (on the rank's device) once it has landed; the staging slot is written again
    only after its hop has read it. A sleep runs the same two hops the other way round."""

    def __init__(
        self, ops: Any, peer: int, *, slot_bytes: int = DEFAULT_SLOT_BYTES, slots: int = DEFAULT_SLOTS
    ) -> None:
        if slot_bytes <= 0 or slots < 1:
            raise ValueError(f"a relay needs at least one staging slot of positive size, got {slots} x {slot_bytes}")
        self.ops, self.peer, self.slot_bytes = ops, peer, slot_bytes
        self.name = f"relay/{peer}"
        self.peer_stream = ops.peer_stream(peer)  # on the peer: its host link
        self.hop_stream = ops.hop_stream(peer)  # on the rank's device: the NVLink hop
        base = ops.staging(peer, slot_bytes * slots)
        self.slots = [base + i * slot_bytes for i in range(slots)]
        self.slot_free: list[Any] = [None] * slots  # event after which slot i may be written
        self.next_slot = 0
        self.tail: Any = self.hop_stream  # the stream that ends the latest piece
        ops.after_current(self.hop_stream)  # a sleep reads what the compute stream wrote

    def copy(self, dst: int, src: int, nbytes: int, to_device: bool) -> None:
        try:
            self._copy(dst, src, nbytes, to_device)
        except Exception as exc:
            raise RelayFailed(self.peer, exc) from exc

    def _copy(self, dst: int, src: int, nbytes: int, to_device: bool) -> None:
        ops = self.ops
        first, second = (self.peer_stream, self.hop_stream) if to_device else (self.hop_stream, self.peer_stream)
        for offset in range(0, nbytes, self.slot_bytes):
            n = min(self.slot_bytes, nbytes - offset)
            i, self.next_slot = self.next_slot, (self.next_slot + 1) % len(self.slots)
            if self.slot_free[i] is not None:
                ops.stream_wait(first, self.slot_free[i])
            ops.copy_any(self.slots[i], src + offset, n, first)  # into staging
            ops.stream_wait(second, ops.record(first))
            ops.copy_any(dst + offset, self.slots[i], n, second)  # out of staging
            self.slot_free[i] = ops.record(second)
        self.tail = second

    def record(self) -> Any:
        return self.ops.record(self.tail)

    def close(self) -> None:
        """Free the staging buffers once nothing queued on either stream can touch them (after
        a failure too: a hop still queued would read freed memory)."""
        try:
            for stream in (self.peer_stream, self.hop_stream):
                self.ops.wait(self.ops.record(stream))
        finally:
            self.ops.release_staging(self.peer)


class LanePicker:
    """Hands each copy to the lane with the least bytes per unit of share so far."""

    def __init__(self, lanes: Sequence[tuple[Lane, float]]) -> None:
        if not lanes or any(share <= 0 for _, share in lanes):
            raise ValueError(f"lanes need positive shares, got {[(lane.name, s) for lane, s in lanes]}")
        self.lanes = [lane for lane, _ in lanes]
        self.shares = [share for _, share in lanes]
        self.assigned = [0] * len(self.lanes)

    def pick(self, nbytes: int) -> Lane:
        k = min(range(len(self.lanes)), key=lambda i: ((self.assigned[i] + nbytes) / self.shares[i], i))
        self.assigned[k] += nbytes
        return self.lanes[k]

    def bytes_by_lane(self) -> dict[str, int]:
        return {lane.name: n for lane, n in zip(self.lanes, self.assigned, strict=True)}


WARM_SLOT_BYTES = 2 * MiB  # the staging of a load-time relay warm-up


def wait_on(ops: Any, lane: Lane, event: Any) -> None:
    """Wait for `event` of `lane`; a relay's failure is named as the relay's (RelayFailed)."""
    try:
        ops.wait(event)
    except Exception as exc:
        if isinstance(lane, RelayLane):
            raise RelayFailed(lane.peer, exc) from exc
        raise


def synchronize_lanes(ops: Any, relays: list[RelayLane]) -> None:
    """Every lane's copies have landed: a relay's last hop runs on the rank's device, so its
    synchronize covers a wake; each relay's own tail is waited on first to name a failure."""
    for relay in relays:
        wait_on(ops, relay, relay.record())
    ops.synchronize()


def warm_relays(ops: Any, device: int, host: int, peers: Iterable[int]) -> None:
    """Open each peer's context, enable peer access both ways and send the byte at `device`
    through a relay to `host` and back, at load: a first sleep over k links then runs at
    their speed instead of paying for k contexts (each costs the peer about 0.5 GiB of
    device memory from now on). A peer that cannot relay is only logged: its commands fall
    back then."""
    for peer in peers:
        try:
            lane = RelayLane(ops, peer, slot_bytes=WARM_SLOT_BYTES, slots=1)
            try:  # device -> host -> device: the byte comes back as it was
                for dst, src, to_device in ((host, device, False), (device, host, True)):
                    lane.copy(dst, src, 1, to_device)
                    ops.wait(lane.record())
            finally:
                lane.close()
        except Exception as exc:
            log.warning(
                "fast backend: cuda:%s cannot relay this rank's copies (%s: %s); plans through it "
                "will run on the own link",
                peer,
                type(exc).__name__,
                exc,
            )
