"""A test double for a swap's late release on CPU: the portable backend, declaring that it can
keep its memory until its last copy (`supports_late_release`), and logging each sleep's
choice as a JSON line to $OMNI_TEST_RELEASE_LOG. It releases as the portable backend always
does: the choice, not its effect on the copies, is what the engine tests look at."""

from __future__ import annotations

import json
import os

from omni_core.workers.backends.portable import PortableBackend


class ReleaseRecordingBackend(PortableBackend):
    name = "release-recording"
    supports_late_release = True

    def _sleep(self, offload: frozenset[str], discard: frozenset[str], release_late: bool = False) -> None:
        with open(os.environ["OMNI_TEST_RELEASE_LOG"], "a") as f:
            f.write(json.dumps({"release_late": release_late, "resident_bytes": sum(self.usage().values())}) + "\n")
        super()._sleep(offload, discard)
