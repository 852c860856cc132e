"""`omni-core demo`: the colocation scenario on real processes.

Two stages share one device: a "talker" with 2 ranks and a "decoder" with 1 rank, both
synthetic runners. The talker sleeps (level 1) while the decoder serves, wakes, and must
answer bit-identically; the decoder goes through level 2 and a weight reload; a request
sent to a sleeping stage is shown under each admission policy. Prints a lifecycle table
and a one-line verdict; exits non-zero on any mismatch.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO, TypedDict

from omni_core.engine import Engine, LifecycleReport, RequestRejectedError, StageSpec
from omni_core.units import fmt_bytes

MiB = 1 << 20
# A refused request carries this long a deadline of its own, so a refusal that came from a
# deadline (queued, then expired) would take all of it ...
REFUSAL_PROBE_TIMEOUT_S = 30.0
# ... while a refusal "at once" is measured against a tenth of it: milliseconds in practice,
# and still met on a loaded 2-core machine.
AT_ONCE_BOUND_S = REFUSAL_PROBE_TIMEOUT_S / 10


class _Common(TypedDict):
    """The StageSpec fields both stages share."""

    device: str
    backend: str
    deadline_s: float


@dataclass
class _Row:
    step: str
    stage: str
    state: str
    duration_s: float
    freed: str


class Demo:
    def __init__(
        self,
        *,
        device: str = "cpu",
        backend: str | None = None,
        weights_mib: int = 64,
        trace_path: str | None = None,
        out: TextIO = sys.stdout,
    ) -> None:
        self.device = device
        self.backend = backend or ("portable" if device == "cpu" else "auto")
        self.weights_mib = weights_mib
        self.trace_path = trace_path
        self.out = out
        self.rows: list[_Row] = []
        self.mismatches: list[str] = []

    def specs(self) -> list[StageSpec]:
        def runner_args(seed: int, tensors: int) -> dict[str, Any]:
            return {
                "weights_bytes": self.weights_mib * MiB,
                "tensor_count": tensors,
                "kv_bytes": self.weights_mib * MiB // 4,
                "seed": seed,
                "cpu_threads": 1,
            }

        common: _Common = {"device": self.device, "backend": self.backend, "deadline_s": 60.0}
        return [
            StageSpec("talker", runner_args=runner_args(1, 32), ranks=2, **common),
            StageSpec("decoder", runner_args=runner_args(2, 16), ranks=1, **common),
        ]

    def record(self, step: str, report: LifecycleReport) -> None:
        freed = ", ".join(
            f"r{r}: freed {fmt_bytes(rr.freed_bytes)}, restored {fmt_bytes(rr.restored_bytes)}"
            for r, rr in report.ranks.items()
        )
        status = "" if report.status == "OK" else f" ({report.status})"
        self.rows.append(_Row(step, report.stage, report.state + status, report.duration_s, freed or "-"))

    def note(self, step: str, stage: str, state: str, duration_s: float, what: str) -> None:
        self.rows.append(_Row(step, stage, state, duration_s, what))

    def check(self, what: str, ok: bool) -> None:
        if not ok:
            self.mismatches.append(what)

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        started = time.perf_counter()
        value = fn()
        return value, time.perf_counter() - started

    def refused_at_once(self, what: str, engine: Engine, stage: str, probe: dict, needle: str) -> tuple[bool, float]:
        """Send a request that must be refused by admission, and time the refusal: it must
        come well before the request's own deadline and say why (`needle`)."""
        started = time.perf_counter()
        try:
            engine.execute(stage, probe, timeout_s=REFUSAL_PROBE_TIMEOUT_S)
        except RequestRejectedError as exc:
            elapsed_s = time.perf_counter() - started
            self.check(f"{what}: refusal names the cause ({needle!r} not in {str(exc)!r})", needle in str(exc))
            self.check(
                f"{what}: refused in {elapsed_s:.2f} s, not at once (< {AT_ONCE_BOUND_S:.1f} s)",
                elapsed_s < AT_ONCE_BOUND_S,
            )
            return needle in str(exc) and elapsed_s < AT_ONCE_BOUND_S, elapsed_s
        self.check(f"{what}: the request was served", False)
        return False, time.perf_counter() - started

    def run(self) -> int:
        w = self.out.write
        w(
            f"omni-core demo: 2 stages on one device ({self.device}, backend {self.backend}), "
            f"synthetic runners with {self.weights_mib} MiB of weights per rank\n"
        )
        started = time.perf_counter()
        with Engine(self.specs(), trace_path=self.trace_path) as engine:
            w(f"started 3 rank processes in {time.perf_counter() - started:.2f} s\n")
            self.scenario(engine)
        self.print_table()
        verdict = "PASS" if not self.mismatches else "FAIL: " + "; ".join(self.mismatches)
        w(f"verdict: {verdict} ({len(self.rows)} steps, {time.perf_counter() - started:.1f} s)\n")
        return 0 if not self.mismatches else 1

    def scenario(self, engine: Engine) -> None:
        probe = {"seed": 7, "batch": 4}
        talker_ref, t = self.timed(lambda: engine.execute("talker", probe))
        self.note("1 serve", "talker", "RUNNING", t, "reference output taken")
        decoder_ref, t = self.timed(lambda: engine.execute("decoder", probe))
        self.note("1 serve", "decoder", "RUNNING", t, "reference output taken")

        self.record("2 sleep L1", engine.sleep("talker", level=1))
        out, t = self.timed(lambda: engine.execute("decoder", probe))
        self.check("decoder output while talker sleeps", out == decoder_ref)
        self.note("2 serve", "decoder", "RUNNING", t, "same output: " + str(out == decoder_ref))
        self.record("2 sleep again", engine.sleep("talker", level=1))
        self.record("3 wake", engine.wake("talker"))
        out, t = self.timed(lambda: engine.execute("talker", probe))
        self.check("talker output after L1 wake", out == talker_ref)
        self.note("3 serve", "talker", "RUNNING", t, "bit-identical: " + str(out == talker_ref))

        self.record("4 sleep L2", engine.sleep("decoder", level=2))
        self.record("4 wake", engine.wake("decoder"))
        ok, t = self.refused_at_once("decoder refuses requests before reload", engine, "decoder", probe, "NEEDS_RELOAD")
        self.note("4 serve", "decoder", "NEEDS_RELOAD", t, f"request refused at once until reload: {ok}")
        self.record("4 reload", engine.reload_weights("decoder"))
        out, t = self.timed(lambda: engine.execute("decoder", probe))
        self.check("decoder output after L2 + reload", out == decoder_ref)
        self.note("4 serve", "decoder", "RUNNING", t, "bit-identical: " + str(out == decoder_ref))

        self.admission_policies(engine, probe, talker_ref)

    def admission_policies(self, engine: Engine, probe: dict, talker_ref: Any) -> None:
        engine.sleep("talker", level=1)
        engine.set_admission("talker", "reject")
        ok, t = self.refused_at_once("reject policy refuses", engine, "talker", probe, "'reject'")
        self.note("5 reject", "talker", "SLEEPING", t, f"request rejected at once: {ok}")
        engine.set_admission("talker", "queue")
        queued = engine.submit("talker", probe)
        # The orchestrator takes calls in order: this status is taken after the submit.
        held = engine.status()["talker"]["queued"] == 1 and not queued.done()
        self.check("queue policy holds the request", held)
        self.record("5 queue: wake", engine.wake("talker"))
        out, t = self.timed(lambda: queued.result(60))
        self.check("queued request served after wake", out == talker_ref)
        self.note("5 queue", "talker", "RUNNING", t, "queued request served, identical: " + str(out == talker_ref))
        engine.sleep("talker", level=1)
        engine.set_admission("talker", "wake")
        out, t = self.timed(lambda: engine.execute("talker", probe))
        self.check("wake policy wakes and serves", out == talker_ref)
        state = engine.status()["talker"]["state"]
        self.note("5 wake", "talker", state, t, "request woke the stage, identical: " + str(out == talker_ref))
        engine.set_admission("talker", "queue")

    def summary(self) -> dict[str, Any]:
        """The run as data (`omni-core demo --synthetic --json`)."""
        return {
            "verdict": "PASS" if not self.mismatches else "FAIL",
            "mismatches": self.mismatches,
            "device": self.device,
            "backend": self.backend,
            "weights_mib": self.weights_mib,
            "steps": [vars(row) for row in self.rows],
        }

    def print_table(self) -> None:
        write_table(
            self.out,
            [(r.step, r.stage, r.state, r.duration_s, r.freed) for r in self.rows],
            "memory freed per rank / check",
        )


def write_table(
    out: TextIO,
    rows: list[tuple[str, str, str, float, str]],
    last_column: str,
    *,
    stage_width: int = 8,
    rule_width: int = 100,
) -> None:
    """The lifecycle table: step, stage, state, duration, then what happened (also the real-model demo's)."""
    w = out.write
    w(f"\n{'step':<16} {'stage':<{stage_width}} {'state':<20} {'duration':>10}  {last_column}\n")
    w("-" * rule_width + "\n")
    for step, stage, state, duration_s, what in rows:
        w(f"{step:<16} {stage:<{stage_width}} {state:<20} {duration_s * 1000:>8.1f}ms  {what}\n")
    w("\n")


def main(
    device: str = "cpu",
    backend: str | None = None,
    weights_mib: int = 64,
    trace_path: str | None = None,
    json_out: bool = False,
) -> int:
    """`json_out`: the table and verdict on stderr, `Demo.summary()` as JSON on stdout."""
    demo = Demo(
        device=device,
        backend=backend,
        weights_mib=weights_mib,
        trace_path=trace_path,
        out=sys.stderr if json_out else sys.stdout,
    )
    code = demo.run()
    if json_out:
        print(json.dumps(demo.summary(), indent=2))
    return code
