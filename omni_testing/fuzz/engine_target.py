"""Engine direction: stranger DEALER sockets send fuzzed frames to a real engine's ROUTER.

The engine runs in its own process (`omni_testing.fuzz.engine_host`): one synthetic stage of
two ranks, and a client thread that keeps calling execute / sleep / wake / reload_weights
and checks every answer against a reference. The fuzzer connects strangers to
`engine.address` and sends replies of every type with mutated fields (the stage's real
epoch, its real rank pids in Hellos, task ids of the form the engine uses), commands, raw
bytes, random msgpack, and frames of 2 to 5 parts.

The engine answers strangers with nothing, so the oracle is its own accounting: every
frame a stranger delivers is dropped and counted exactly once, in `status()["_engine"]`
(`bad_replies`: not one part or not decodable; `unknown_peers`: a message from an identity
no rank has bound, or a Hello for a stage/rank that does not exist; `rebind_refused`: a
Hello for a rank already bound; `forged_hellos`; `rank_mismatch`). The sum of their
increments must equal the frames sent. Meanwhile the client's answers must all be right,
no rank may restart (same pids, alive), the orchestrator thread must live, the stage must
end RUNNING and the engine process's RSS must stay flat.
"""

from __future__ import annotations

import json
import os
import random
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from omni_core.protocol import DEFAULT_MAX_FRAME_BYTES
from omni_core.transport.zmq_socket import SOCKET_FRAME_SLACK_BYTES
from omni_testing.fuzz.common import MAX_RSS_GROWTH_BYTES, Finding, FuzzReport, Progress, count, log_tail
from omni_testing.fuzz.engine_host import LINE_PREFIX, STAGE
from omni_testing.fuzz.generate import FuzzContext
from omni_testing.fuzz.schema import make_generator

# Counters a stranger's frame may land in; each frame in exactly one of them.
REFUSAL_COUNTERS = ("bad_replies", "unknown_peers", "rebind_refused", "forged_hellos", "rank_mismatch")
START_TIMEOUT_S = 180.0  # two ranks importing torch on a loaded 2-core machine
HOST_REPLY_TIMEOUT_S = 60.0  # generous: engine.status() is bounded at 15 s inside the host
STRANGERS = 8
CHURN_EVERY_FRAMES = 500  # a stranger disconnects and a new one connects (the ROUTER's peer table)
SETTLE_TIMEOUT_S = 30.0  # for the counters to take in the last frames sent


@dataclass
class EngineFuzzConfig:
    seed: int = 0
    frames: int = 10_000
    time_box_s: float | None = None
    transport: str = "ipc"
    ranks: int = 2
    probe_every_frames: int = 1_000  # a status probe (hang check, RSS, ranks) this often
    big_every_frames: int = 0  # every N-th frame is at or over the frame limit (0: none)
    warmup_frames: int = 2_000
    max_rss_growth_bytes: int = MAX_RSS_GROWTH_BYTES
    send_timeout_s: float = 30.0  # a send blocked this long (the engine stopped reading) is a hang
    progress_interval_s: float = 5.0
    out_dir: str | None = None
    # Share of frames derived from the wire schema (omni_testing.fuzz.schema); 0: hand-built only.
    schema_share: float = 0.0


class _Host:
    """The engine process and its line protocol."""

    def __init__(self, transport: str, ranks: int, log_path: str) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "omni_testing.fuzz.engine_host",
                    "--transport",
                    transport,
                    "--ranks",
                    str(ranks),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                bufsize=1,
            )

    def read(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        deadline_at = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            while True:
                left_s = deadline_at - time.monotonic()
                if left_s <= 0:
                    raise TimeoutError(f"the engine host said nothing for {timeout_s} s")
                if not selector.select(min(left_s, 1.0)):
                    if self.proc.poll() is not None:
                        raise EOFError(f"the engine host exited with {self.proc.returncode}")
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    raise EOFError(f"the engine host closed its output (exit {self.proc.poll()})")
                if line.startswith(LINE_PREFIX):
                    return json.loads(line[len(LINE_PREFIX) :])

    def ask(self, op: str, timeout_s: float = HOST_REPLY_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout_s)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("stop", timeout_s=60.0)
                self.proc.wait(30)
            except (TimeoutError, EOFError, BrokenPipeError, OSError, subprocess.TimeoutExpired):
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class EngineFuzzer:
    def __init__(self, config: EngineFuzzConfig, *, emit: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.emit = emit
        self.report = FuzzReport.for_run("engine", config)
        self.generator = make_generator(config.seed, "engine", config.schema_share)
        # Stranger choice and churn from their own stream: the frames stay those of the seed.
        self.rng = random.Random(config.seed ^ 0x5EED)
        self.ctx = zmq.Context()
        self.strangers: list[zmq.Socket] = []
        self._stranger_serial = 0
        self.address = ""
        self.fuzz_ctx = FuzzContext(stage=STAGE, ranks=config.ranks)
        self.ranks: dict[str, int] = {}
        self.base_counters: dict[str, int] = {}
        self.counted_frames = 0  # frames that must show up in the refusal counters
        self._cpu_started_s = time.process_time()
        self._reported: set[str] = set()
        self._client_errors_seen = 0

    # ================================================================ run

    def run(self) -> FuzzReport:
        cfg, report = self.config, self.report
        started_at = time.monotonic()
        fuzz_started_at = started_at
        log_path = os.path.join(tempfile.gettempdir(), f"omni-fz-engine-{os.getpid()}-{cfg.transport}.log")
        host = _Host(cfg.transport, cfg.ranks, log_path)
        try:
            ready = host.read(START_TIMEOUT_S)
            if ready.get("event") != "ready":
                raise RuntimeError(f"the engine did not start: {ready}")
            self.address = ready["address"]
            self.ranks = ready["ranks"]
            self.fuzz_ctx = FuzzContext(
                epoch=ready["epoch"],
                stage=STAGE,
                ranks=cfg.ranks,
                pids=tuple(sorted(self.ranks.values())),
                task_ids=tuple(f"req-{STAGE}-{n}" for n in range(1, 65))
                + tuple(f"fz-{kind}-{n}" for kind in ("sleep", "wake", "reload") for n in range(1, 9))
                + ("hello",),
            )
            first = host.ask("status")
            report.rss_start_bytes = first["rss_bytes"]
            self.base_counters = dict(first["status"]["_engine"])
            self.strangers = [self._new_stranger() for _ in range(STRANGERS)]
            fuzz_started_at = time.monotonic()
            report.extra["startup_s"] = round(fuzz_started_at - started_at, 2)
            deadline_at = started_at + cfg.time_box_s if cfg.time_box_s else None
            progress = Progress(self.emit, cfg.progress_interval_s)
            while report.frames_sent < cfg.frames:
                if deadline_at is not None and time.monotonic() >= deadline_at:
                    report.time_boxed = True
                    break
                batch = min(cfg.probe_every_frames, cfg.frames - report.frames_sent)
                if not self._fuzz_batch(batch):
                    break
                if not self._probe(host):
                    break
                progress.maybe(report.frames_sent, lambda: self._progress_extra(host))
            fuzz_ended_at = time.monotonic()
            report.frames_per_s = report.frames_sent / max(fuzz_ended_at - fuzz_started_at, 1e-9)
            self._settle(host)
            self._final(host)
        except (TimeoutError, EOFError) as exc:
            report.hangs += isinstance(exc, TimeoutError)
            report.crashes += isinstance(exc, EOFError)
            report.add_finding(
                Finding(
                    "crash" if isinstance(exc, EOFError) else "hang", f"{exc}; engine log:\n{log_tail(host.log_path)}"
                )
            )
        finally:
            self.ctx.destroy(linger=0)  # every socket, whatever state the run ended in
            host.close()
            report.duration_s = time.monotonic() - started_at
            if not report.frames_per_s:
                report.frames_per_s = report.frames_sent / max(report.duration_s, 1e-9)
            report.settle_memory()
            samples = report.extra.get("rss_samples", [])
            step = max(1, len(samples) // 200)  # at most ~200 points, evenly spread
            report.extra["rss_samples"] = samples[::step] + samples[-1:]
            report.extra["fuzzer_cpu_s"] = round(time.process_time() - self._cpu_started_s, 1)
            if report.ok:
                os.unlink(log_path)
            else:  # kept for the findings
                report.extra["engine_log"] = log_path
        return report

    def _progress_extra(self, host: _Host) -> str:
        r = self.report
        return (
            f"{r.crashes} crashes, {r.hangs} hangs, {r.violations} violations, "
            f"engine RSS {(r.rss_max_bytes or 0) >> 20} MiB"
        )

    # ================================================================ frames

    def _new_stranger(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        self._stranger_serial += 1
        roll = self.rng.random()
        # Distinct identities only: zmq silently refuses a second peer with an identity in use,
        # and its frames would then be missing from the engine's counts for a reason of ours.
        if roll < 0.4:
            sock.setsockopt(zmq.IDENTITY, f"{STAGE}/0/stranger-{self._stranger_serial}".encode())
        elif roll < 0.7:
            # zmq identities are 1..255 bytes and must not start with a zero byte (reserved).
            sock.setsockopt(
                zmq.IDENTITY,
                bytes((1 + self.rng.randrange(255),))
                + self.rng.randbytes(self.rng.randrange(250))
                + self._stranger_serial.to_bytes(4, "big"),
            )
        # else: zmq picks an identity for it
        sock.setsockopt(zmq.LINGER, 5000)  # frames already queued still reach the engine
        sock.setsockopt(zmq.SNDTIMEO, int(self.config.send_timeout_s * 1000))
        sock.connect(self.address)
        return sock

    def _fuzz_batch(self, frames: int) -> bool:
        cfg, report = self.config, self.report
        for _ in range(frames):
            number = report.frames_sent + 1
            if cfg.big_every_frames and number % cfg.big_every_frames == 0:
                frame = self.generator._big(self._big_ctx())
            else:
                frame = self.generator.next(self.fuzz_ctx)
            if number % CHURN_EVERY_FRAMES == 0:
                index = self.rng.randrange(len(self.strangers))
                self.strangers[index].close()  # with LINGER: what it queued is still delivered
                self.strangers[index] = self._new_stranger()
            over_socket_limit = any(len(p) > DEFAULT_MAX_FRAME_BYTES + SOCKET_FRAME_SLACK_BYTES for p in frame.parts)
            if over_socket_limit:  # alone on a socket of its own: zmq drops that connection
                sock = self._new_stranger()
            else:
                sock = self.strangers[self.rng.randrange(len(self.strangers))]
            try:
                sock.send_multipart(list(frame.parts))
            except zmq.Again:
                report.hangs += 1
                report.add_finding(
                    Finding("hang", f"a send blocked for {cfg.send_timeout_s} s: the engine stopped reading its socket")
                )
                return False
            report.frames_sent += 1
            report.bytes_sent += frame.size_bytes
            count(report.frames_by_kind, frame.kind)
            if frame.kind == "valid":  # for duplicates and reorderings of well-formed frames
                self.generator.remember_valid(frame.payload)
            if over_socket_limit:  # zmq drops the connection unread: nothing to count
                count(report.extra, "socket_dropped_frames")
                sock.close(0)
            else:
                self.counted_frames += 1
        return True

    def _big_ctx(self) -> FuzzContext:
        ctx = self.fuzz_ctx
        return FuzzContext(
            epoch=ctx.epoch,
            stage=ctx.stage,
            ranks=ctx.ranks,
            pids=ctx.pids,
            task_ids=ctx.task_ids,
            max_frame_bytes=DEFAULT_MAX_FRAME_BYTES,
        )

    # ================================================================ checks

    def _probe(self, host: _Host) -> bool:
        """Hang check, ranks, orchestrator, memory, counters so far."""
        started = time.monotonic()
        snapshot = host.ask("status")
        report = self.report
        report.extra["max_probe_s"] = round(max(report.extra.get("max_probe_s", 0.0), time.monotonic() - started), 3)
        if snapshot.get("status") is None:
            report.hangs += 1
            report.add_finding(Finding("hang", f"engine.status() failed: {snapshot.get('status_error')}"))
            return False
        self._check_snapshot(snapshot, final=False)
        rss = snapshot["rss_bytes"]
        if rss is not None:
            if report.rss_before_bytes is None and report.frames_sent >= self.config.warmup_frames:
                report.rss_before_bytes = rss
            if report.rss_before_bytes is not None:
                report.rss_max_bytes = max(report.rss_max_bytes or 0, rss)
            report.extra.setdefault("rss_samples", []).append((report.frames_sent, rss))
        return True

    def _refused(self, counters: dict[str, int]) -> int:
        return sum(counters.get(k, 0) - self.base_counters.get(k, 0) for k in REFUSAL_COUNTERS)

    def _check_snapshot(self, snapshot: dict[str, Any], *, final: bool) -> None:
        status = snapshot["status"]
        stage = status[STAGE]
        if not snapshot["orchestrator_alive"]:
            self._violation("orchestrator_dead", "the orchestrator thread is gone", once="orchestrator")
        ranks = {str(r): info for r, info in stage["ranks"].items()}
        for rank, pid in self.ranks.items():
            info = ranks.get(rank)
            if info is None or info["pid"] != pid or not info["alive"]:
                self._violation("rank_restarted", f"rank {rank}: was pid {pid}, now {info}", once=f"rank{rank}")
        if stage["state"] == "FAILED":
            self._violation("stage_failed", f"stage {STAGE} FAILED: {stage.get('failure')}", once="failed")
        raised = status["_engine"].get("frame_errors", 0) - self.base_counters.get("frame_errors", 0)
        if raised > 0:  # caught by the loop's isolation, but a handler raised: a bug to report
            causes = {k: v for k, v in status["_engine"].items() if k.startswith("frame_errors_")}
            self._violation(
                "handler_raised",
                f"{raised} frame(s) raised in a handler of the engine's loop: {causes}",
                once="handler_raised",
            )
        refused = self._refused(status["_engine"])
        if refused > self.counted_frames:
            self._violation(
                "counters",
                f"{refused} frames refused but only {self.counted_frames} sent by strangers: "
                "the engine refused its own ranks' traffic",
                once="over_count",
            )
        client = snapshot.get("client") or {}
        errors = client.get("errors", 0)
        if errors > self._client_errors_seen:
            samples = client["error_samples"][self._client_errors_seen : self._client_errors_seen + 3]
            self.report.violations += errors - self._client_errors_seen - 1  # one more in _violation
            self._client_errors_seen = errors
            self._violation("client", f"{errors} client errors so far: {samples}")

    def _settle(self, host: _Host) -> None:
        """Wait until the engine has counted every frame the strangers sent."""
        deadline_at = time.monotonic() + SETTLE_TIMEOUT_S
        refused = 0
        while time.monotonic() < deadline_at:
            snapshot = host.ask("status")
            if snapshot.get("status") is None:
                break
            refused = self._refused(snapshot["status"]["_engine"])
            if refused >= self.counted_frames:
                break
            time.sleep(0.2)
        self.report.extra["frames_counted_by_engine"] = refused
        if refused != self.counted_frames:
            self._violation(
                "counters",
                f"the engine counted {refused} refused frames; strangers sent "
                f"{self.counted_frames} it should have refused",
            )

    def _final(self, host: _Host) -> None:
        snapshot = host.ask("pause", timeout_s=180.0)
        report = self.report
        if snapshot.get("client_alive"):
            report.hangs += 1
            report.add_finding(Finding("hang", "the client thread did not finish its call within 120 s"))
        if snapshot.get("status") is None:
            report.hangs += 1
            report.add_finding(Finding("hang", f"final engine.status() failed: {snapshot.get('status_error')}"))
            return
        self._check_snapshot(snapshot, final=True)
        status = snapshot["status"]
        stage = status[STAGE]
        if stage["state"] != "RUNNING":
            self._violation("stage_state", f"stage {STAGE} ended {stage['state']}, not RUNNING")
        engine = status["_engine"]
        report.extra["engine_counters"] = {k: engine[k] - self.base_counters.get(k, 0) for k in sorted(engine)}
        report.extra["stage_counters"] = stage.get("counters")
        client = snapshot["client"]
        report.extra["client"] = client
        report.valid_commands = client["executes"] + client["lifecycle_calls"]
        report.valid_answered = client["executes_ok"] + client["lifecycle_ok"]
        report.replies = report.valid_answered  # strangers get no replies; these are the client's
        report.rss_after_bytes = snapshot["rss_bytes"]
        report.extra["engine_peak_rss_bytes"] = snapshot["peak_rss_bytes"]
        report.extra["rank_rss_bytes"] = snapshot["rank_rss_bytes"]
        if report.rss_before_bytes is None:  # a run shorter than the warm-up: compare with the start
            report.rss_before_bytes = report.rss_start_bytes

    def _violation(self, kind: str, detail: str, *, once: str | None = None) -> None:
        """Record a violation; `once`: a key for a lasting condition, seen at every probe."""
        if once is not None:
            if once in self._reported:
                return
            self._reported.add(once)
        self.report.violations += 1
        count(self.report.extra.setdefault("violations_by_kind", {}), kind)
        self.report.add_finding(Finding(kind, detail))
