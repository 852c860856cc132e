"""What the records of a run must show about time and order before any of them is replayed:
every writer's lines in program order (`program_order`), and every deadline tied to the issue
that set it and fired no earlier than it (`DeadlineClock`). trace_export marks a line that
breaks either as refuted, so the replay stops there with the reason.
"""

from __future__ import annotations

from typing import Any

from omni_core.fsm import trace_records as T

CLOCK_SLACK_S = 1e-6  # float rounding of `now + timeout_s`; far below any deadline a caller can set


class DeadlineClock:
    """Ties every deadline to the record that set it and checks it against the clock across
    records. The engine reads its clock for a step after writing the previous step's lines
    and before writing this one's, so a deadline set at `now` by an issue satisfies
    previous engine line's stamp + timeout <= deadline_at <= issue line's stamp + timeout; it
    fires no earlier than that deadline by both the core's clock and the line's stamp."""

    def __init__(self, lines: list[T.TraceLine]) -> None:
        self._lines = lines
        self._set: dict[str, tuple[int, float]] = {}  # task id ("" for a start) -> (line, deadline_at_s)
        self._bad: dict[str, str] = {}  # task id -> why the deadline its issue set is not its timeout

    def _previous_stamp(self, n: int) -> float:
        pid = self._lines[n - 1].pid
        return next(
            (line.mono_s for line in reversed(self._lines[: n - 1]) if line.pid == pid and line.is_engine),
            float("-inf"),
        )

    def set_by(self, n: int, line: T.TraceLine) -> None:
        r: Any = line.record
        key = getattr(r, "task_id", "") or getattr(r, "request_id", "")
        self._set[key] = (n, r.deadline_at_s)
        self._bad.pop(key, None)
        timeout_s = getattr(r, "timeout_s", 0.0)
        if timeout_s > 0 and not r.already:
            # An issue the queue started (auto) shares its step with the input that moved the
            # queue, whose lines come first: only the upper bound holds for it.
            low = float("-inf") if r.auto else self._previous_stamp(n) + timeout_s
            high = line.mono_s + timeout_s
            if not low - CLOCK_SLACK_S <= r.deadline_at_s <= high + CLOCK_SLACK_S:
                self._bad[key] = (
                    f"the deadline {r.deadline_at_s:.6f} s set at line {n} is not its issue time "
                    f"plus its timeout of {timeout_s:g} s (between {low:.6f} and {high:.6f} s)"
                )

    def check(self, n: int, line: T.TraceLine) -> str:
        r: Any = line.record
        key = r.task_id if r.before != "STARTING" else ""
        if key not in self._set:
            return f"a deadline of task {r.task_id!r}, which no earlier line of this stage set"
        at, deadline_at_s = self._set[key]
        if key in self._bad:
            return self._bad[key]
        if abs(r.deadline_at_s - deadline_at_s) > CLOCK_SLACK_S:
            return (
                f"a deadline at {r.deadline_at_s:.6f} s; the one line {at} set for this task is at "
                f"{deadline_at_s:.6f} s"
            )
        fired_s = min(r.now_s, line.mono_s)
        if fired_s < deadline_at_s:
            return f"a deadline fired at {fired_s:.6f} s, before the {deadline_at_s:.6f} s line {at} set"
        return ""


def program_order(lines: list[T.TraceLine], wanted: set[int] | None = None) -> tuple[int, str] | None:
    """The first line (1-based, among `wanted`) that breaks its process's program order:
    each writer (pid, rank, and a worker's epoch) numbers its lines 0, 1, 2, ... (`seq`) on
    a clock that never goes back (`mono_s`), and they reach the file in that order (one
    O_APPEND write each). A gap is a line missing, a step back a line moved."""
    last: dict[tuple[int, int, int], tuple[int, float]] = {}
    for n, line in enumerate(lines, start=1):
        key = (line.pid, line.rank, -1 if line.is_engine else line.epoch)
        seq0, mono0 = last.get(key, (-1, float("-inf")))
        last[key] = (line.seq, line.mono_s)
        if wanted is not None and n not in wanted:
            continue
        who = f"pid {line.pid} ({'engine' if line.is_engine else f'rank {line.rank} of epoch {line.epoch}'})"
        if line.seq != seq0 + 1:
            what = "a line before this one is missing or was moved" if line.seq > seq0 + 1 else "this line was moved"
            return n, f"{who} wrote seq {line.seq} after seq {seq0}: {what}"
        if line.mono_s < mono0:
            return n, f"{who}'s clock went back from {mono0:.6f} s to {line.mono_s:.6f} s: this line was moved"
    return None
