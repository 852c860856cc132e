"""The memory-backend interface: tagged pools that sleep and wake.

A backend owns the device memory of a worker, split by tag. `pool(tag)` is the context in
which the runner allocates that tag's tensors; `sleep(offload, discard)` releases tags
(keeping a host copy of `offload` only); `wake(tags)` maps them back. Sleep and wake never
replace the runner's tensor objects: the same Python tensors hold the memory again after
a wake, which is why a runner can keep plain references.

Buffers a runner lists in `buffers_to_save()` that live in a discarded tag are copied to
host before the discard and written back when their tag wakes (level 2: the weights are
reloaded from their source, but buffers computed at start-up are not in that source).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from omni_core.protocol import Capability, LinkShare
from omni_core.workers.memory_gate import MemoryGate, MemoryWaitExpired, WakeRefused


class BackendUnavailable(RuntimeError):
    """This backend cannot work in this process; the message says why and what to install."""


class BackendStateError(RuntimeError):
    """A sleep/wake that does not fit the tags' current state (a caller bug, refused whole)."""


@dataclass
class _SavedBuffer:
    tensor: torch.Tensor  # the runner's own tensor: restored in place
    host: torch.Tensor
    tag: str


class MemoryBackend(ABC):
    name: str = "?"
    capabilities: tuple[Capability, ...] = ()
    # `_wake` honours a memory gate and rolls back when it expires (Capability.SWAP). False: a
    # wake given a gate is refused, and `_wake` is only ever called with none.
    supports_memory_gate: bool = False
    # `_sleep`/`_wake` take a link plan (protocol.LinkShare) and spread their copies over it.
    supports_links: bool = False
    # `_sleep` takes `release_late`: keep every allocation until the last copy has landed.
    supports_late_release: bool = False
    # Why this backend runs, when `auto` chose it (the Hello and the stage's status carry it).
    choice_reason: str = ""
    # `host_view` reaches the host copy of a tag asleep at level 1, so an update can be written
    # there with the device untouched (Capability.HOST_REFIT, with a runner that writes in place).
    supports_host_refit: bool = False

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)
        self.tags: list[str] = []
        self.asleep: set[str] = set()
        self._saved: dict[str, _SavedBuffer] = {}

    # ------------------------------------------------------------------ allocation

    @contextmanager
    def pool(self, tag: str) -> Iterator[None]:
        """Allocations made inside belong to `tag`."""
        if tag in self.asleep:
            raise BackendStateError(f"cannot allocate in pool {tag!r} while it is asleep; wake it first")
        if tag not in self.tags:
            self.tags.append(tag)
        with self._pool(tag):
            yield

    @contextmanager
    def _pool(self, tag: str) -> Iterator[None]:
        yield

    def track(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        """The runner's tensors of `tag` (after allocating it). Backends that move tensors
        (portable) need them; allocator backends (cumem) see allocations themselves."""
        return None

    def declare_read_only(self, tags: Iterable[str], *, verify: bool = False) -> None:
        """The runner's word that execution never writes `tags` (ModelRunner.read_only_tags).
        A backend that keeps a host copy may then reuse it at the next sleep instead of
        copying again; with `verify` it checks the word at every such sleep. Others ignore it."""
        return None

    def invalidate(self, tags: Iterable[str]) -> None:
        """The content of `tags` is about to change outside execution (a reload): any host
        copy of it is stale."""
        return None

    # ------------------------------------------------------------------ lifecycle

    def sleep(
        self,
        offload: Iterable[str],
        discard: Iterable[str],
        *,
        buffers: Mapping[str, torch.Tensor] | None = None,
        links: Sequence[LinkShare] = (),
        release_late: bool = False,
    ) -> None:
        """Release `offload | discard`, copying `offload` to the host first; `links` is the
        command's link plan (a backend with `supports_links` spreads the copies over them).
        `release_late`: nothing else waits for this memory (a swap whose incoming stage fits
        beside this one), so a backend with `supports_late_release` may release it all after
        its last copy instead of each allocation as its copy lands; others ignore it."""
        offload, discard = frozenset(offload), frozenset(discard)
        self._check_links(links)
        tags = offload | discard
        if offload & discard:
            raise BackendStateError(f"tags {sorted(offload & discard)} asked to be both offloaded and discarded")
        unknown = tags - set(self.tags)
        if unknown:
            raise BackendStateError(f"unknown tag(s) {sorted(unknown)}; this backend has pools {self.tags}")
        if tags & self.asleep:
            raise BackendStateError(f"tag(s) {sorted(tags & self.asleep)} are already asleep")
        self._synchronize()
        for name, tensor in (buffers or {}).items():
            tag = self.tag_of(tensor)
            if tag in discard:
                host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=self._pin)
                host.copy_(tensor)
                self._saved[name] = _SavedBuffer(tensor, host, tag)
        options: dict[str, Any] = {"links": links} if links else {}
        if release_late and self.supports_late_release:
            options["release_late"] = True
        self._sleep(offload, discard, **options)  # supports_links / supports_late_release backends
        self.asleep |= tags
        # No gc.collect() here: backends free storage explicitly, and a full collection with
        # torch loaded costs ~200 ms per sleep, 100x the protocol's own round trip.
        self._empty_cache()

    def wake(self, tags: Iterable[str], gate: MemoryGate | None = None, links: Sequence[LinkShare] = ()) -> None:
        """Map `tags` back. With a `gate`, each allocation waits for free device memory first;
        when the gate's wait expires, what this wake mapped is unmapped again, the tags stay
        asleep with their host copies and saved buffers intact, and WakeRefused is raised.
        `links`: the command's link plan, as for sleep."""
        tags = frozenset(tags)
        self._check_links(links)
        if tags - self.asleep:
            raise BackendStateError(
                f"tag(s) {sorted(tags - self.asleep)} are not asleep (asleep: {sorted(self.asleep)})"
            )
        if gate is not None and not self.supports_memory_gate:
            raise BackendStateError(
                f"backend {self.name!r} cannot wait for device memory (no memory gate); wake it without memory_wait_s"
            )
        try:
            if links:
                self._wake(tags, gate, links)  # type: ignore[call-arg]  # supports_links backends
            else:
                self._wake(tags, gate)
        except MemoryWaitExpired as exc:
            raise WakeRefused(str(exc)) from exc
        # Only now: a refused wake leaves the saved buffers for the next one.
        self.asleep -= tags
        for name in [n for n, s in self._saved.items() if s.tag in tags]:
            saved = self._saved.pop(name)
            saved.tensor.copy_(saved.host)
        self._synchronize()

    def relay_peers(self) -> tuple[int, ...]:
        """The device indices (as this process sees them) a link plan may relay through."""
        return ()

    def _check_links(self, links: Sequence[LinkShare]) -> None:
        if links and not self.supports_links:
            raise BackendStateError(
                f"backend {self.name!r} copies over its own link only, but the command plans {len(links)} "
                "links; plan links only for ranks whose Hello declares multi_path"
            )

    def adopt(self, tag: str) -> None:
        """Know `tag` as a pool whose allocations the framework makes itself inside this
        backend's allocator (vLLM's CUDA graph pool: `cuda_graph`), so it sleeps and wakes with
        the others. A backend whose allocator has no such pool refuses, saying so."""
        raise BackendStateError(
            f"backend {self.name!r} holds no pool the framework fills for tag {tag!r}; "
            f"drop {tag!r} from the stage's tags, or use the cumem backend"
        )

    def host_view(self, tag: str, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor of `tensor`'s dtype, shape and strides over the bytes that stand for it
        in the host copy of `tag`, asleep at level 1: what is written into it is what the next
        wake maps back (HOST_REFIT). Raises BackendStateError where no such copy exists."""
        if tag not in self.asleep:
            raise BackendStateError(f"tag {tag!r} is not asleep: write its tensors on the device, not its host copy")
        host, offset_bytes = self._host_copy_of(tag, tensor)
        return host_tensor_view(host, offset_bytes, tensor)

    def _host_copy_of(self, tag: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The uint8 host copy holding `tensor`'s storage and the storage's byte offset in it."""
        raise BackendStateError(
            f"backend {self.name!r} keeps no host copy an update can be written into; wake {tag!r} first"
        )

    def usage(self) -> dict[str, int]:
        """Device bytes resident per tag (0 for a tag that is asleep)."""
        return {tag: self._resident_bytes(tag) for tag in self.tags}

    def unmapped_reserved_bytes(self) -> int:
        """Device bytes torch's allocator still counts as reserved whose physical memory this
        backend released (an allocation unmapped in place keeps its address). 0 for a backend
        that frees through the allocator; the process's own tally subtracts it."""
        return 0

    def host_bytes(self) -> int:
        """Host bytes this backend holds for sleeping tags (copies and saved buffers)."""
        return self._host_bytes() + sum(s.host.numel() * s.host.element_size() for s in self._saved.values())

    def release(self) -> None:
        """Shutdown: drop host copies. The runner drops its tensors after this."""
        self._saved.clear()

    @property
    def last_sleep_path(self) -> str:
        """How the last sleep moved the memory, where a backend has several ways (traced)."""
        return ""

    @property
    def hard_exit_required(self) -> bool:
        """True when the process must leave with os._exit after Shutdown because freeing the
        remaining tensors through the normal path is unsafe (see the cumem backend)."""
        return False

    # ------------------------------------------------------------------ per backend

    @abstractmethod
    def tag_of(self, tensor: torch.Tensor) -> str | None:
        """The pool a tensor's memory belongs to, or None if it is in none."""

    @abstractmethod
    def _sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None: ...

    @abstractmethod
    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None) -> None:
        """Map `tags`, each allocation through `gate.admit` when given. On MemoryWaitExpired:
        unmap every allocation this call mapped (after its copies landed), leave the host
        copies as they were, and let the exception go."""

    @abstractmethod
    def _resident_bytes(self, tag: str) -> int: ...

    def _host_bytes(self) -> int:
        return 0

    # ------------------------------------------------------------------ helpers

    @property
    def _pin(self) -> bool:
        # Pinned host memory makes device<->host copies run at link speed; on a CPU-only
        # process there is nothing to pin for.
        return self.device.type == "cuda"

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def host_tensor_view(host: torch.Tensor, offset_bytes: int, like: torch.Tensor) -> torch.Tensor:
    """`like` (its dtype, shape and strides) laid over the uint8 `host` from `offset_bytes`, the
    byte where `like`'s storage starts there; refused when it would reach past `host`."""
    size = like.element_size()
    start_bytes = host.storage_offset() + offset_bytes + like.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(like.shape, like.stride(), strict=True)) if like.numel() else 0
    if start_bytes % size or offset_bytes < 0 or start_bytes + extent * size > host.untyped_storage().nbytes():
        raise BackendStateError(
            f"a {like.dtype} tensor of shape {list(like.shape)} at byte {start_bytes} does not fit the host "
            f"copy of {host.untyped_storage().nbytes()} bytes its storage maps to; wake the tag and update "
            "on the device"
        )
    view = torch.empty(0, dtype=like.dtype, device=host.device)
    return view.set_(host.untyped_storage(), start_bytes // size, like.shape, like.stride())
