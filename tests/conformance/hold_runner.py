"""A worker whose runner really freezes its requests (pause mode keep), for the P-23 case's
other branch: the reference worker's synthetic runner cannot freeze, so a hold beside a request
has it answered first. Here every request waits, generating nothing, until the runner has been
held once; so a request the suite sends beside a hold is always running when the hold comes,
is frozen by it, and goes on (on the weights of the update between) only at the release.

    run_suite(hold_worker, only=["P-23"], options=SuiteOptions(execute_payload=HOLD_PAYLOAD))
"""

from __future__ import annotations

import time
from typing import Any

from omni_core.conformance.targets import reference_worker
from tests.engine.token_runner import TokenRunner

RUNNER = "tests.conformance.hold_runner:HeldFirstRunner"
HOLD_PAYLOAD: dict[str, Any] = {"first": 1, "max_tokens": 4}  # a token request (TokenRunner)
STEP_S = 0.002  # a step's compute while every request waits: the rank must not spin


class HeldFirstRunner(TokenRunner):
    def step_requests(self) -> list[tuple[str, Any]]:
        if self.holds == 0:  # not held yet: nothing moves
            time.sleep(STEP_S)
            return []
        return super().step_requests()


def hold_worker(address: str, rank: int, epoch: int) -> dict[str, Any]:
    """The reference worker with the runner above (started from the checkout's root)."""
    return {**reference_worker(address, rank, epoch), "runner": RUNNER}
