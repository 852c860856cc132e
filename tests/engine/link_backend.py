"""A test double for multi-path on CPU: the portable backend, declaring relay peers (from
$OMNI_TEST_RELAY_PEERS, e.g. "1,2") and logging each sleep's and wake's link plan as a JSON
line to $OMNI_TEST_LINKS_LOG. The copies themselves stay on the own link (there is no GPU)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from omni_core.protocol import LinkShare
from omni_core.workers.backends.portable import PortableBackend
from omni_core.workers.memory_gate import MemoryGate


class LinkRecordingBackend(PortableBackend):
    name = "link-recording"
    supports_links = True

    def relay_peers(self) -> tuple[int, ...]:
        peers = os.environ.get("OMNI_TEST_RELAY_PEERS", "")
        return tuple(int(p) for p in peers.split(",") if p)

    def _log(self, op: str, links: Sequence[LinkShare]) -> None:
        with open(os.environ["OMNI_TEST_LINKS_LOG"], "a") as f:
            f.write(json.dumps({"op": op, "links": [[s.peer, s.share] for s in links]}) + "\n")

    def _sleep(self, offload: frozenset[str], discard: frozenset[str], links: Sequence[LinkShare] = ()) -> None:
        self._log("sleep", links)
        super()._sleep(offload, discard)

    def _wake(self, tags: frozenset[str], gate: MemoryGate | None = None, links: Sequence[LinkShare] = ()) -> None:
        self._log("wake", links)
        super()._wake(tags, gate)
