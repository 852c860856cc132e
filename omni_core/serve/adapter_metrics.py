"""The LoRA adapters' metrics (P-20), from the status snapshot: how many adapters each stage
holds where (resident, offloaded, gone, stale), and each adapter's version and base version.

An adapter's name is a label value the caller chose, so its series are bounded: the first
MAX_ADAPTER_LABELS adapters of a stage by name get series of their own; the others are counted
in `omni_core_adapters` (every adapter is, whatever its name) and in
`omni_core_adapters_unlabelled`, and have none. A stage holds at most MAX_ADAPTERS per rank, so
a stage's adapter series are at most MAX_ADAPTER_LABELS x 2 whatever callers name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from omni_core.engine.adapter_view import RESIDENCIES

MAX_ADAPTER_LABELS = 16  # adapters per stage with series of their own


def adapter_families(stages: dict[str, Any]) -> Iterator[GaugeMetricFamily]:
    counts = GaugeMetricFamily(
        "omni_core_adapters",
        "LoRA adapters a stage's rank 0 listed last, by where each is: resident, offloaded (a "
        "level-1 sleep keeps it on the host), gone (a level-2 sleep discarded it), stale (made for "
        "other base weights)",
        labels=["stage", "residency"],
    )
    version = GaugeMetricFamily(
        "omni_core_adapter_version",
        f"An adapter's version (a refit raises it), for the first {MAX_ADAPTER_LABELS} adapters of a "
        "stage by name; `residency` as in omni_core_adapters",
        labels=["stage", "adapter", "residency", "pinned"],
    )
    base = GaugeMetricFamily(
        "omni_core_adapter_base_version",
        f"The base weights version an adapter was made for, for the first {MAX_ADAPTER_LABELS} adapters",
        labels=["stage", "adapter"],
    )
    unlabelled = GaugeMetricFamily(
        "omni_core_adapters_unlabelled",
        f"Adapters beyond the first {MAX_ADAPTER_LABELS} of a stage: counted in omni_core_adapters, "
        "with no series of their own (label values stay bounded)",
        labels=["stage"],
    )
    for name, stage in stages.items():
        adapters = sorted(stage.get("adapters") or [], key=lambda a: a["name"])
        for where in RESIDENCIES:
            counts.add_metric([name, where], sum(1 for a in adapters if a["residency"] == where))
        for a in adapters[:MAX_ADAPTER_LABELS]:
            version.add_metric([name, a["name"], a["residency"], "true" if a["pinned"] else "false"], a["version"])
            base.add_metric([name, a["name"]], a["base_version"])
        unlabelled.add_metric([name], max(0, len(adapters) - MAX_ADAPTER_LABELS))
    yield from (counts, version, base, unlabelled)
