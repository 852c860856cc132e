"""A test double: the portable backend as one that keeps no host copy an update can reach
(`supports_host_refit` False), so its ranks' Hello lists no host_refit."""

from __future__ import annotations

from omni_core.workers.backends.portable import PortableBackend


class NoHostRefitBackend(PortableBackend):
    name = "no-host-refit"
    supports_host_refit = False
