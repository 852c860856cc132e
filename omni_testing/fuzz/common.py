"""What both fuzz targets share: memory readings, findings, progress lines, the report."""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# "Flat" memory: after warm-up, the target's RSS may not grow by more than this over the
# whole run. Every cache and queue on the path is bounded (reply cache: 16 MiB and 1024
# entries; socket queues: 1024 messages), so steady growth past it would be a leak.
MAX_RSS_GROWTH_BYTES = 64 << 20
MAX_FINDINGS = 50  # kept in the report; the count goes on
FINDING_BYTES_KEPT = 4096  # hex of a reproducer is cut here (the full bytes go to --out)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process (VmRSS), None when it is gone."""
    return _status_field(pid, "VmRSS")


def peak_rss_bytes(pid: int) -> int | None:
    return _status_field(pid, "VmHWM")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    return round((int(fields[11]) + int(fields[12])) / ticks_per_s, 1)  # utime, stime


def _status_field(pid: int, name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None


def log_tail(path: str, lines: int = 30) -> str:
    """The end of a child process's log, for a finding."""
    try:
        with open(path, encoding="utf-8", errors="replace") as log:
            return "".join(log.readlines()[-lines:])
    except FileNotFoundError:
        return ""


@dataclass
class Finding:
    """Something the oracle refused: a crash, a hang, a missing or wrong reply."""

    kind: str
    detail: str
    frame_hex: list[str] = field(default_factory=list)  # the frame's parts (cut), when one is to blame
    frame_sha256: str = ""


@dataclass
class FuzzReport:
    target: str
    seed: int
    transport: str = "ipc"
    frames_requested: int = 0
    frames_sent: int = 0
    frames_by_kind: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    replies: int = 0
    replies_by_type: dict[str, int] = field(default_factory=dict)
    valid_commands: int = 0  # the oracle's own commands (probes, executes, lifecycle)
    valid_answered: int = 0
    crashes: int = 0
    hangs: int = 0
    violations: int = 0  # missing, extra, undecodable or wrong replies; wrong results
    findings: list[Finding] = field(default_factory=list)
    rss_start_bytes: int | None = None
    rss_before_bytes: int | None = None  # after warm-up
    rss_after_bytes: int | None = None
    rss_max_bytes: int | None = None  # highest sample after warm-up
    rss_growth_bytes: int | None = None
    rss_limit_bytes: int = MAX_RSS_GROWTH_BYTES
    memory_flat: bool | None = None
    duration_s: float = 0.0
    frames_per_s: float = 0.0
    time_boxed: bool = False  # stopped by --time-box-s before the requested frames
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def for_run(cls, target: str, config: Any) -> FuzzReport:
        """An empty report for a run of `config` (a WorkerFuzzConfig or EngineFuzzConfig)."""
        return cls(
            target=target,
            seed=config.seed,
            transport=config.transport,
            frames_requested=config.frames,
            rss_limit_bytes=config.max_rss_growth_bytes,
        )

    def add_finding(self, finding: Finding) -> None:
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(finding)

    def settle_memory(self) -> None:
        if self.rss_before_bytes is not None and self.rss_after_bytes is not None:
            self.rss_growth_bytes = self.rss_after_bytes - self.rss_before_bytes
            self.memory_flat = self.rss_growth_bytes < self.rss_limit_bytes

    @property
    def ok(self) -> bool:
        return self.crashes == 0 and self.hangs == 0 and self.violations == 0 and self.memory_flat is not False

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out

    def summary(self) -> str:
        mib = 1 << 20

        def mb(value: int | None) -> str:
            return "-" if value is None else f"{value / mib:.1f} MiB"

        lines = [
            f"target {self.target} ({self.transport}), seed {self.seed}: "
            f"{'OK' if self.ok else 'FAILED'}{' (time-boxed)' if self.time_boxed else ''}",
            f"  frames sent      {self.frames_sent} of {self.frames_requested} ({self.bytes_sent} bytes)",
            f"  replies          {self.replies}",
            f"  valid commands   {self.valid_answered}/{self.valid_commands} answered and correct",
            f"  crashes          {self.crashes}",
            f"  hangs            {self.hangs}",
            f"  violations       {self.violations}",
            f"  memory (RSS)     start {mb(self.rss_start_bytes)}, after warm-up {mb(self.rss_before_bytes)}, "
            f"end {mb(self.rss_after_bytes)}, max {mb(self.rss_max_bytes)}, growth {mb(self.rss_growth_bytes)} "
            f"(limit {mb(self.rss_limit_bytes)}): {'flat' if self.memory_flat else 'NOT flat'}",
            f"  duration         {self.duration_s:.1f} s, {self.frames_per_s:.0f} frames/s",
        ]
        for key, value in sorted(self.extra.items()):
            if isinstance(value, (int, float, str, bool)) or value is None:
                lines.append(f"  {key:<16} {value}")
        for finding in self.findings[:10]:
            lines.append(f"  finding: {finding.kind}: {finding.detail[:300]}")
        return "\n".join(lines)


def write_report(report: FuzzReport, out_dir: str | os.PathLike[str]) -> Path:
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = path / f"fuzz-{report.target}-{report.transport}-seed{report.seed}.json"
    target.write_text(json.dumps(report.to_json(), indent=2, sort_keys=True, default=str) + "\n")
    return target


class Progress:
    """A line every `interval_s` with frames/s since the last line and since the start."""

    def __init__(self, emit: Callable[[str], None] | None, interval_s: float) -> None:
        self.emit = emit
        self.interval_s = interval_s
        self.started_at = time.monotonic()
        self._last_at = self.started_at
        self._last_frames = 0

    def maybe(self, frames: int, extra: Callable[[], str]) -> None:
        now = time.monotonic()
        if self.emit is None or now - self._last_at < self.interval_s:
            return
        window_frames_per_s = (frames - self._last_frames) / (now - self._last_at)
        total_frames_per_s = frames / max(now - self.started_at, 1e-9)
        self.emit(
            f"[{now - self.started_at:7.1f} s] {frames} frames, {window_frames_per_s:.0f} frames/s "
            f"(avg {total_frames_per_s:.0f}); {extra()}"
        )
        self._last_at, self._last_frames = now, frames


def count(counter: dict[str, int], key: str, by: int = 1) -> None:
    counter[key] = counter.get(key, 0) + by


def top(counter: Counter[str] | dict[str, int]) -> dict[str, int]:
    return dict(sorted(counter.items()))
