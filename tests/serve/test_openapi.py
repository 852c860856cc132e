"""specs/openapi.json is generated from the routes; a route change without regenerating it fails here."""

from __future__ import annotations

import json

from omni_core.serve.openapi import DEFAULT_PATH, openapi_schema, render


def test_committed_schema_is_fresh() -> None:
    committed = DEFAULT_PATH.read_text(encoding="utf-8")
    assert committed == render(), (
        "specs/openapi.json is stale: run `omni-core serve --write-openapi specs/openapi.json` and commit it"
    )


def test_schema_has_every_route_family() -> None:
    paths = set(json.loads(render())["paths"])
    own = {"/v1/stages", "/v1/stages/{name}", "/health", "/metrics", "/v1/swap"} | {
        f"/v1/stages/{{name}}/{verb}" for verb in ("sleep", "wake", "reload", "restart", "execute")
    }
    vllm = {
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/collective_rpc",
        "/pause",
        "/resume",
        "/is_paused",
        "/reset_prefix_cache",
    }
    omni = {"/v1/omni/sleep", "/v1/omni/wakeup"}
    sglang = {"/release_memory_occupation", "/resume_memory_occupation", "/flush_cache"}
    assert own | vllm | omni | sglang <= paths


def test_error_codes_are_documented() -> None:
    sleep = openapi_schema()["paths"]["/v1/stages/{name}/sleep"]["post"]["responses"]
    assert {"200", "400", "401", "404", "409", "413", "429", "503", "504"} <= set(sleep)
