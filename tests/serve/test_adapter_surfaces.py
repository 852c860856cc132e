"""A stage's LoRA adapters (P-20) on the operator's surfaces: `omni-core adapters
list|add|remove|pin` over omni-core's `/v1/stages/{name}/adapters` routes, `/v1/stages`'s and
the status snapshot's `adapters` (name, version, base version, pinned, residency: resident,
offloaded after a level-1 sleep, gone after a level-2 one), and the metrics, whose adapter
names are a bounded label (MAX_ADAPTER_LABELS a stage; the others counted, unnamed)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_core.cli import main as cli_main
from omni_core.serve.adapter_metrics import MAX_ADAPTER_LABELS
from tests.serve.checkpoint_runner import write_checkpoint
from tests.serve.conftest import Served, make_config, metric_value, serving, stage_table, wait_for

RUNNER = "tests.serve.checkpoint_runner:CheckpointRunner"
TAGS = ["weights", "kv_cache", "adapters"]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("adapters")


@pytest.fixture(scope="module")
def lora(root) -> Iterator[Served]:
    table = stage_table("lora", runner=RUNNER, tags=TAGS, max_loras=MAX_ADAPTER_LABELS + 4)
    with serving(make_config(table, allowed_reload_sources=[str(root)])) as served:
        yield served


def _cli(capsys, *argv: str, url: str) -> str:
    assert cli_main(["adapters", *argv, "--url", url]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def _adapters(served: Served) -> dict[str, dict]:
    return {a["name"]: a for a in served.engine.status()["lora"]["adapters"]}


def test_the_cli_adds_lists_pins_and_removes_and_status_follows_sleeps(lora: Served, root: Path, capsys) -> None:
    url = lora.url
    sql = write_checkpoint(root, "sql", 7)
    out = _cli(capsys, "add", "lora", "sql", str(sql), "--rank", "4", "--target-modules", "w0,w2", url=url)
    assert out.splitlines() == ["lora: AddAdapter -> RUNNING (OK)", "  sql v1 on base v0 rank 4: loaded"]
    out = _cli(capsys, "pin", "lora", "sql", url=url)
    assert "  sql v1 on base v0 rank 4: loaded pinned" in out.splitlines()
    listed = json.loads(_cli(capsys, "list", "lora", "--json", url=url))
    assert [(a["name"], a["pinned"]) for a in listed["ranks"]["0"]["adapters"]] == [("sql", True)]
    assert cli_main(["adapters", "add", "lora", "x", "--url", url]) == 2
    assert "SOURCE is required" in capsys.readouterr().err
    assert cli_main(["adapters", "add", "lora", "x", str(sql), "--url", url]) == 1  # no adapter_config.json
    assert "cannot read its rank and target modules" in capsys.readouterr().err

    row = {"name": "sql", "version": 1, "base_version": 0, "pinned": True, "status": "loaded", "residency": "resident"}
    assert row.items() <= _adapters(lora)["sql"].items()
    lora.engine.sleep("lora", 1)
    assert _adapters(lora)["sql"]["residency"] == "offloaded"
    lora.engine.wake("lora")
    lora.engine.sleep("lora", 2)
    lora.engine.wake("lora")
    lora.engine.reload_weights("lora")
    assert _adapters(lora)["sql"]["residency"] == "gone"  # the ranks said so in their Acks
    view = lora.client.get("/v1/stages/lora").json()["adapters"]
    assert [(a["name"], a["residency"]) for a in view] == [("sql", "gone")]
    out = _cli(capsys, "remove", "lora", "sql", url=url)
    assert out.splitlines()[1:] == ["  no adapters"]
    assert _adapters(lora) == {}


def test_metrics_name_at_most_max_adapter_labels_adapters_and_count_them_all(lora: Served, root: Path) -> None:
    count = MAX_ADAPTER_LABELS + 2
    for i in range(count):
        body = {"name": f"a{i:02d}", "source": str(write_checkpoint(root, f"a{i:02d}", i)), "rank": 2}
        added = lora.client.post("/v1/stages/lora/adapters", json=body | {"target_modules": ["w1"]})
        assert added.status_code == 200, added.text

    def scraped() -> str:
        return lora.client.get("/metrics").text

    # The snapshot is refreshed after each call through the server: the metrics follow it.
    wait_for(
        lambda: metric_value(scraped(), "omni_core_adapters", stage="lora", residency="resident") == count,
        what="every adapter counted in /metrics",
    )
    text = scraped()
    named = {
        line.split('adapter="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("omni_core_adapter_version{")
    }
    assert named == {f"a{i:02d}" for i in range(MAX_ADAPTER_LABELS)}  # the first by name, no more
    assert metric_value(text, "omni_core_adapters_unlabelled", stage="lora") == 2
    assert metric_value(text, "omni_core_adapter_version", stage="lora", adapter="a00", pinned="false") == 1
    for i in range(count):
        lora.engine.remove_adapter("lora", f"a{i:02d}")
