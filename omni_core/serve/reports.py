"""The JSON shape of the engine's reports in HTTP answers (success bodies and the halves of a
failed swap's error body alike)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import msgspec

from omni_core.engine import LifecycleReport, SwapReport


def report_json(report: LifecycleReport) -> dict[str, Any]:
    out = asdict(report)
    out["ranks"] = {
        str(rank): dict(
            asdict(rr),
            freed_bytes=rr.freed_bytes,
            restored_bytes=rr.restored_bytes,
            adapters=msgspec.to_builtins(rr.adapters),  # P-20: wire structs, as plain JSON
        )
        for rank, rr in report.ranks.items()
    }
    return out


def swap_json(report: SwapReport) -> dict[str, Any]:
    return {
        "task_id": report.task_id,
        "duration_s": report.duration_s,
        "outgoing": report_json(report.outgoing),
        "incoming": report_json(report.incoming),
    }
