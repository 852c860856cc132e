"""Serve tests run the real thing: rank processes, the engine, uvicorn on a loopback port,
HTTP through httpx. Engines are shared (starting ranks costs seconds on 2 cores); each test
that uses `served` starts from RUNNING stages (`settle`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from omni_core.config import OmniConfig, parse_config
from omni_core.engine import Engine
from omni_core.serve import create_app, serve_in_thread
from tests.engine.conftest import wait_for

__all__ = ["wait_for"]  # shared with the engine tests: polls a condition, the bound only turns a hang into a failure

MiB = 1 << 20
SMALL_RUNNER = {"weights_bytes": 2 * MiB, "tensor_count": 4, "kv_bytes": MiB // 4, "cpu_threads": 1}
PROBE = {"seed": 3, "batch": 2}
API_KEY = "test-key-0123456789abcdef"
HTTP_TIMEOUT_S = 120.0  # far above any deadline here: a hang fails on the engine's deadline, not this


def stage_table(name: str, ranks: int = 1, **overrides: Any) -> dict[str, Any]:
    table = {
        "name": name,
        "ranks": ranks,
        "backend": "portable",
        "runner_args": dict(SMALL_RUNNER, seed=len(name)),
        "deadline_s": 30.0,
        "request_timeout_s": 60.0,
    }
    table.update(overrides)
    return table


def make_config(*stages: dict[str, Any], **server: Any) -> OmniConfig:
    return parse_config({"server": server, "stages": list(stages)}, "<test>")


@dataclass
class Served:
    url: str
    engine: Engine
    config: OmniConfig
    app: Any
    client: httpx.Client

    def stage(self, name: str) -> dict[str, Any]:
        return self.client.get(f"/v1/stages/{name}").json()

    def settle(self, *names: str) -> None:
        """Bring stages back to RUNNING (a test's sleeps must not leak into the next)."""
        for name in names or self.config.stage_names:
            state = self.stage(name)["state"]
            if state == "FAILED":
                self.engine.restart(name)
            elif state in ("SLEEPING", "PARTIAL"):
                self.engine.wake(name)
            elif state == "PAUSED":
                self.engine.resume(name)
            if self.engine.status()[name]["version_floor"]:  # a version lost with its ranks
                self.engine.restart(name, from_checkpoint=True)
            if self.engine.status()[name]["state"] == "NEEDS_RELOAD":
                self.engine.reload_weights(name)
            self.engine.set_admission(name, self.config.stages[self.config.stage_names.index(name)].admission)
            assert self.engine.status()[name]["state"] == "RUNNING", self.engine.status()[name]


@contextlib.contextmanager
def serving(config: OmniConfig, *, api_key: str | None = None, engine: Engine | None = None) -> Iterator[Served]:
    own = engine is None
    engine = engine or Engine(config.stages)
    try:
        app = create_app(engine, config, api_key=api_key)
        with serve_in_thread(app) as running:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            with httpx.Client(base_url=running.url, timeout=HTTP_TIMEOUT_S, headers=headers) as client:
                yield Served(running.url, engine, config, app, client)
    finally:
        if own:
            engine.shutdown()


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition, 0 when absent (a counter not yet touched)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


@pytest.fixture
def settled(served: Served) -> Served:
    """The session's server with every stage back at RUNNING: a test's sleeps must not leak
    into the next (modules opt in with `pytestmark = pytest.mark.usefixtures("settled")`)."""
    served.settle()
    return served


@pytest.fixture(scope="session")
def served() -> Iterator[Served]:
    """Two stages: "talker" (2 ranks, queue admission, queue_limit 2) and "decoder" (1 rank).
    One engine for the session: tests start from `settle()`, so none inherits another's sleep."""
    config = make_config(stage_table("talker", ranks=2, queue_limit=2), stage_table("decoder"), default_stage="talker")
    with serving(config) as s:
        yield s
