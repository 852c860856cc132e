"""The portable backend: releases tensor storage in place and reallocates it on wake.

Works on any torch device, CPU included, so the whole lifecycle runs in CI. Sleep copies
an offloaded tag's storages to host (pinned on CUDA) and then resizes every storage of the
tag to 0 bytes: the tensors stay the same Python objects with the same shapes, but hold no
memory, on CPU as much as on a GPU. A missing restore therefore fails loudly (the runner
finds an empty storage), and a level-2 sleep keeps no copy at all.

Wake resizes the storages back and copies the host bytes in; a discarded tag comes back
zero-filled (its content is gone, which is what NEEDS_RELOAD is for). The storage is
reallocated, so device addresses change: no `stable_addresses`, no `cuda_graphs`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch

from omni_core.protocol import Capability
from omni_core.workers.backends.base import BackendStateError, MemoryBackend
from omni_core.workers.memory_gate import MemoryGate, MemoryWaitExpired, admit
from omni_core.workers.simulated_device import SimulatedResidency


@dataclass
class _Storage:
    storage: torch.UntypedStorage
    nbytes: int  # size while resident; restored on wake
    host: torch.Tensor | None = None  # uint8 copy while an offloaded tag sleeps


def _bytes_view(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A uint8 tensor over the whole storage (copies by bytes, whatever the dtype)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class PortableBackend(MemoryBackend):
    name = "portable"
    capabilities = (Capability.LEVEL2, Capability.PARTIAL_WAKE)
    supports_memory_gate = True  # gated per storage
    supports_host_refit = True  # each offloaded storage's bytes are one host tensor

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        # Keyed by the StorageImpl address: views and aliases of one storage share it, so
        # each storage is released and restored exactly once.
        self._storages: dict[str, dict[int, _Storage]] = {}
        self.residency: SimulatedResidency | None = None

    def track(self, tag: str, tensors: Iterable[torch.Tensor]) -> None:
        if tag in self.asleep:
            raise BackendStateError(f"cannot track tensors of {tag!r} while it is asleep")
        if tag not in self.tags:
            self.tags.append(tag)
        table: dict[int, _Storage] = {}
        for t in tensors:
            if t.device != self.device:
                raise BackendStateError(f"a {tag} tensor is on {t.device}, this backend manages {self.device}")
            storage = t.untyped_storage()
            key = storage._cdata
            for other, entries in self._storages.items():
                if other != tag and key in entries:
                    raise BackendStateError(
                        f"a tensor of {tag!r} shares its storage with {other!r}; a storage can belong to one pool only"
                    )
            table[key] = _Storage(storage, storage.nbytes())
        self._storages[tag] = table
        self._report(self._resident_total())

    def tag_of(self, tensor: torch.Tensor) -> str | None:
        key = tensor.untyped_storage()._cdata
        for tag, entries in self._storages.items():
            if key in entries:
                return tag
        return None

    def _sleep(self, offload: frozenset[str], discard: frozenset[str]) -> None:
        for tag in sorted(offload | discard):
            for entry in self._storages.get(tag, {}).values():
                if tag in offload:
                    host = torch.empty(entry.nbytes, dtype=torch.uint8, device="cpu", pin_memory=self._pin)
                    host.copy_(_bytes_view(entry.storage, entry.nbytes), non_blocking=self._pin)
                    entry.host = host
            self._synchronize()  # the copies must land before their source is freed
            for entry in self._storages.get(tag, {}).values():
                entry.storage.resize_(0)
            self._report(self._resident_total())  # a waiting wake elsewhere may go on

    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None) -> None:
        entries = [e for tag in sorted(tags) for e in self._storages.get(tag, {}).values()]
        if gate is not None:
            gate.expect(sum(e.nbytes for e in entries))
        resident = self._resident_total()
        mapped: list[_Storage] = []
        try:
            for tag in sorted(tags):
                for entry in self._storages.get(tag, {}).values():
                    admit(gate, entry.nbytes, partial(self._map, entry, resident + entry.nbytes))
                    mapped.append(entry)
                    resident += entry.nbytes
                    view = _bytes_view(entry.storage, entry.nbytes)
                    if entry.host is not None:
                        view.copy_(entry.host, non_blocking=self._pin)
                    else:
                        view.zero_()  # discarded: deterministic zeros rather than stale bytes
                self._synchronize()
        except MemoryWaitExpired:
            self._synchronize()  # copies into what is released must have landed
            for entry in mapped:
                entry.storage.resize_(0)
                if gate is not None:
                    gate.release(entry.nbytes)
            self._report(self._resident_total())
            raise
        # Only once every tag is back: a refused wake keeps every host copy for the next one.
        for entry in entries:
            entry.host = None

    def _host_copy_of(self, tag: str, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        entry = self._storages.get(tag, {}).get(tensor.untyped_storage()._cdata)
        if entry is None or entry.host is None:
            raise BackendStateError(
                f"a tensor of shape {list(tensor.shape)} has no host copy in {tag!r} (not tracked, or "
                "discarded by a level-2 sleep); wake the tag and update on the device"
            )
        return entry.host, 0

    def _map(self, entry: _Storage, resident_after: int) -> None:
        """Give a storage its memory back. On a simulated device the new figure is claimed
        first, so the next allocation's query sees it and the device refuses it past its
        capacity (SimulatedOutOfMemory, which the gate waits on like a driver's OOM)."""
        if self.residency is not None:
            self.residency.claim(resident_after)
        entry.storage.resize_(entry.nbytes)

    def report_to(self, residency: SimulatedResidency | None) -> None:
        """Write this process's resident bytes to a simulated device on every change (and
        remove its file at release), so that other ranks' gates see them."""
        self.residency = residency
        self._report(self._resident_total())

    def _report(self, resident_bytes: int) -> None:
        if self.residency is not None:
            self.residency.report(resident_bytes)

    def _resident_total(self) -> int:
        return sum(self._resident_bytes(tag) for tag in self._storages)

    def _resident_bytes(self, tag: str) -> int:
        return sum(e.storage.nbytes() for e in self._storages.get(tag, {}).values())

    def _host_bytes(self) -> int:
        return sum(
            e.host.numel() for entries in self._storages.values() for e in entries.values() if e.host is not None
        )

    def release(self) -> None:
        super().release()
        for entries in self._storages.values():
            for entry in entries.values():
                entry.host = None
        self._storages.clear()
        if self.residency is not None:
            self.residency.remove()
