"""Worker direction: fuzzed frames into a real worker process, checked by an oracle.

The fuzzer binds a ROUTER, starts `python -m omni_core.workers` (synthetic runner, CPU,
portable backend), receives its Hello and then sends frames in batches, several in flight
at once. The worker handles one frame at a time and answers in order, so every frame's
expected reply is known before it is sent, from the protocol's own codec:

- bytes that do not decode: one NACK with the reason the codec names (BAD_MESSAGE or
  UNSUPPORTED_VERSION), `command="?"` and the task_id the envelope revealed (or "-");
- a valid command (the mutator's untouched fields, replays and reorderings of real
  commands): exactly one reply with its task_id, an Ack/Result or a Nack naming it. Its
  state is tracked, and the epoch it moves the worker to is followed (the core's fencing
  rule), so the oracle's own commands stay in the current epoch. A valid Shutdown in the
  worker's epoch window is withheld: it would end the process by design; so is a valid
  gloo InitWeightGroup that may wait for its trainer longer than a reply may take (the rank
  waits up to its timeout_s by design, as the generator's own weight commands avoid).

Between batches the oracle runs lockstep (`worker_oracle`); the rule a reply must meet is
`worker_expect`'s, and the worker process is started and stopped by `worker_spawn`.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq

from omni_core.conformance.targets import REFERENCE_RUNNER_ARGS
from omni_core.fsm.worker import MAX_EPOCH_AHEAD
from omni_core.protocol import (
    DEFAULT_MAX_FRAME_BYTES,
    Ack,
    Command,
    Execute,
    InitWeightGroup,
    Message,
    Nack,
    ProtocolError,
    ReloadWeights,
    Result,
    Shutdown,
    Status,
    WorkerState,
    decode,
    decode_command,
    encode,
)
from omni_core.transport import ipc_address, make_router
from omni_core.transport.zmq_socket import SOCKET_FRAME_SLACK_BYTES
from omni_testing.fuzz.common import (
    MAX_RSS_GROWTH_BYTES,
    Finding,
    FuzzReport,
    Progress,
    count,
    cpu_seconds,
    log_tail,
    peak_rss_bytes,
    rss_bytes,
)
from omni_testing.fuzz.generate import Frame, FuzzContext
from omni_testing.fuzz.known_issues import open_issues
from omni_testing.fuzz.schema import make_generator
from omni_testing.fuzz.worker_expect import Expect, frames_hex, matches, reply_problems, serial_of, short
from omni_testing.fuzz.worker_oracle import REFERENCE_PAYLOAD, OracleRounds
from omni_testing.fuzz.worker_spawn import (
    LOG_TAIL_LINES,
    WorkerCrashed,
    WorkerHung,
    await_hello,
    handler_raised_excerpts,
    handler_raised_lines,
    kill_worker,
    spawn_worker,
)

MAX_RESTARTS = 5  # after a crash or hang the worker is replaced; more means stop and report


@dataclass
class WorkerFuzzConfig:
    seed: int = 0
    frames: int = 10_000
    time_box_s: float | None = None
    transport: str = "ipc"  # "ipc" | "tcp" (loopback)
    probe_every_frames: int = 200  # fuzzed frames between two oracle rounds
    lifecycle_every_rounds: int = 8  # a sleep/wake cycle every this many rounds (levels alternate)
    window_frames: int = 128  # fuzzed frames in flight before the fuzzer waits for replies
    reply_timeout_s: float = 30.0  # generous: a reply later than this is a hang
    big_every_frames: int = 0  # every N-th frame is at or over the frame limit (0: none)
    socket_drop_frames: bool = False  # big frames may exceed the socket's own limit too
    warmup_frames: int = 2_000  # RSS "before" is taken at the first round after this many frames
    max_rss_growth_bytes: int = MAX_RSS_GROWTH_BYTES
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    runner_args: dict[str, Any] = field(default_factory=lambda: dict(REFERENCE_RUNNER_ARGS))
    progress_interval_s: float = 5.0
    out_dir: str | None = None  # reproducers of findings are written here
    # Withhold frames that trigger a reported, still-open bug (omni_testing.fuzz.known_issues),
    # counted in the report; a fixed bug's frames are sent again automatically.
    withhold_known_issues: bool = True
    # Share of frames derived from the wire schema (omni_testing.fuzz.schema); 0: hand-built only.
    schema_share: float = 0.0


class WorkerFuzzer(OracleRounds):
    def __init__(self, config: WorkerFuzzConfig, *, emit: Callable[[str], None] | None = None) -> None:
        self.config = config
        self.emit = emit
        self.report = FuzzReport.for_run("worker", config)
        self.generator = make_generator(
            config.seed, "worker", config.schema_share, socket_drop_frames=config.socket_drop_frames
        )
        self.directory = tempfile.mkdtemp(prefix="omni-fz-", dir="/tmp")
        self.ctx = zmq.Context()
        address = ipc_address(self.directory) if config.transport == "ipc" else "tcp://127.0.0.1:*"
        self.sock = make_router(self.ctx, address, max_frame_bytes=config.max_frame_bytes)
        self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.proc: subprocess.Popen | None = None
        self.identity: bytes = b""
        self.log_path = os.path.join(self.directory, "worker.log")
        self.expect: deque[Expect] = deque()
        self.epoch = 0  # the worker's epoch, followed by the core's fencing rule
        self.state = WorkerState.ACTIVE  # last state a reply reported
        self.weights_dirty = False  # a fuzzed ReloadWeights refilled them from another source
        self.reference: Any = None
        self.rounds = 0
        self._oracle_serial = 0
        self._ids_taken: set[str] = set()  # oracle-shaped ids beyond the serial that fuzzed frames used
        self._withheld = 0
        self._restarts = 0
        self._nack_reasons: dict[str, int] = {}
        self._rss_samples: list[tuple[int, int]] = []
        self._oracle_reply: Message | None = None
        self._cpu_started_s = time.process_time()
        self._open_issues = open_issues() if config.withhold_known_issues else ()
        self._withheld_known: dict[str, int] = {}

    # ================================================================ run

    def run(self) -> FuzzReport:
        cfg, report = self.config, self.report
        started_at = time.monotonic()
        fuzz_started_at = started_at
        try:
            self._start_worker()
            report.rss_start_bytes = rss_bytes(self._pid)
            fuzz_started_at = time.monotonic()  # frames/s counts the fuzzing, not torch's import
            report.extra["startup_s"] = round(fuzz_started_at - started_at, 2)
            deadline_at = started_at + cfg.time_box_s if cfg.time_box_s else None
            progress = Progress(self.emit, cfg.progress_interval_s)
            while report.frames_sent < cfg.frames:
                if deadline_at is not None and time.monotonic() >= deadline_at:
                    report.time_boxed = True
                    break
                if self._restarts > MAX_RESTARTS:
                    break
                try:
                    self._fuzz_batch(min(cfg.probe_every_frames, cfg.frames - report.frames_sent))
                    self._sync()
                    self._oracle_round()
                except (WorkerHung, WorkerCrashed):
                    self._recover()
                progress.maybe(report.frames_sent, self._progress_extra)
            try:
                self._sync()
                self._oracle_round(final=True)
            except (WorkerHung, WorkerCrashed):
                self._recover()
        finally:
            ended_at = time.monotonic()
            report.duration_s = ended_at - started_at
            report.frames_per_s = report.frames_sent / max(ended_at - fuzz_started_at, 1e-9)
            self._finish()
        return report

    def _progress_extra(self) -> str:
        r = self.report
        rss = rss_bytes(self._pid) if self.proc else None
        return (
            f"{r.replies} replies, {r.crashes} crashes, {r.hangs} hangs, {r.violations} violations, "
            f"worker RSS {0 if rss is None else rss >> 20} MiB, epoch {self.epoch}"
        )

    @property
    def _pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    # ================================================================ the worker process

    def _start_worker(self) -> None:
        self.proc = spawn_worker(
            self.address,
            self.epoch,
            runner_args=self.config.runner_args,
            max_frame_bytes=self.config.max_frame_bytes,
            log_path=self.log_path,
        )
        self.identity = await_hello(self.sock, self.proc, self.log_path)
        self.expect.clear()
        self.state = WorkerState.ACTIVE
        self.weights_dirty = False
        reply = self._lockstep(Execute(task_id=self._task_id("ref"), epoch=self.epoch, payload=REFERENCE_PAYLOAD))
        if not isinstance(reply, Result):
            raise RuntimeError(f"the worker's first Execute was not a Result: {reply!r}")
        if self.reference is None:
            self.reference = reply.output
            self.report.valid_answered += 1
        elif reply.output != self.reference:
            self._violation("wrong_result", "after a restart the reference request gave another output")
        else:
            self.report.valid_answered += 1

    def _recover(self) -> None:
        """After a crash or a hang: record it, replace the worker, go on (fresh epoch)."""
        self._restarts += 1
        self.report.extra["worker_restarts"] = self._restarts
        kill_worker(self.proc)
        if self._restarts > MAX_RESTARTS:
            return
        self.epoch += 1
        self._start_worker()

    def _log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return log_tail(self.log_path, lines)

    def _keep_log(self) -> str:
        """The worker's whole log, copied into out_dir (its own directory goes at the end)."""
        if not self.config.out_dir:
            return ""
        os.makedirs(self.config.out_dir, exist_ok=True)
        kept = os.path.join(self.config.out_dir, "worker.log")
        shutil.copyfile(self.log_path, kept)
        return f"; its whole log: {kept}"

    def _finish(self) -> None:
        report = self.report
        if self.proc is not None and self.proc.poll() is None:
            report.rss_after_bytes = report.rss_after_bytes or rss_bytes(self._pid)
            report.extra["worker_peak_rss_bytes"] = peak_rss_bytes(self._pid)
            report.extra["worker_cpu_s"] = cpu_seconds(self._pid)
            try:  # a clean end: Shutdown must be answered too
                self.expect.clear()
                reply = self._lockstep(Shutdown(task_id=self._task_id("shutdown"), epoch=self.epoch))
                self._expect_ack(reply, "Shutdown", WorkerState.STOPPED)
                self.proc.wait(15)
            except (WorkerHung, WorkerCrashed, subprocess.TimeoutExpired):
                pass
            if self.proc.poll() is None:
                kill_worker(self.proc)
            elif self.proc.returncode != 0:
                self._violation(
                    "exit_code",
                    f"the worker exited with {self.proc.returncode} after Shutdown; its log ends:\n{self._log_tail(3)}",
                )
        # The worker answers a frame whose handling raised (isolation) and logs it: still a bug.
        raised = handler_raised_lines(self.log_path)
        report.extra["handler_raised_log_lines"] = raised
        if raised:
            self._violation(
                "handler_raised",
                f"{raised} frame(s) raised in a handler of the worker's loop (caught and answered by "
                f"its isolation){self._keep_log()}:\n{handler_raised_excerpts(self.log_path)}",
            )
        report.settle_memory()
        report.replies_by_type.update({f"Nack:{k}": v for k, v in sorted(self._nack_reasons.items())})
        report.extra["shutdowns_withheld"] = self._withheld
        report.extra["known_issues_open"] = [issue.name for issue in self._open_issues]
        report.extra["withheld_known_issue_frames"] = dict(self._withheld_known)
        report.extra["epoch_final"] = self.epoch
        report.extra["oracle_rounds"] = self.rounds
        report.extra["fuzzer_cpu_s"] = round(time.process_time() - self._cpu_started_s, 1)
        step = max(1, len(self._rss_samples) // 200)  # at most ~200 points, evenly spread
        report.extra["rss_samples"] = self._rss_samples[::step] + self._rss_samples[-1:]
        self.sock.close(0)
        self.ctx.term()
        shutil.rmtree(self.directory, ignore_errors=True)

    # ================================================================ fuzzed frames

    def _fuzz_batch(self, frames: int) -> None:
        cfg, report = self.config, self.report
        sent = 0
        while sent < frames:
            while len(self.expect) >= cfg.window_frames:
                self._receive(block=True)
            ctx = FuzzContext(
                epoch=self.epoch,
                stage="fuzz",
                ranks=1,
                tags=("weights", "kv_cache"),
                task_ids=self._recent_task_ids,
                max_frame_bytes=cfg.max_frame_bytes,
            )
            number = report.frames_sent + 1
            if cfg.big_every_frames and number % cfg.big_every_frames == 0:
                frame = self.generator._big(ctx)
            else:
                frame = self.generator.next(ctx)
            expect = self._expectation(frame)
            if expect is None:
                continue
            if len(frame.payload) > cfg.max_frame_bytes + SOCKET_FRAME_SLACK_BYTES:
                # zmq refuses it by dropping the connection: no reply, and what was in flight
                # may be lost with it. Sent alone, then the worker must come back.
                self._sync()
                self._send(frame.parts)
                count(report.frames_by_kind, frame.kind)
                report.frames_sent += 1
                sent += 1
                report.extra["socket_dropped_frames"] = report.extra.get("socket_dropped_frames", 0) + 1
                self._resync_after_drop()
                continue
            self._send(frame.parts)
            count(report.frames_by_kind, frame.kind)
            report.frames_sent += 1
            sent += 1
            self.expect.append(expect)
            self._receive(block=False)

    def _expectation(self, frame: Frame) -> Expect | None:
        """The reply this frame must get (None: withhold the frame). Follows the epoch."""
        try:
            command = decode_command(frame.payload, max_frame_bytes=self.config.max_frame_bytes)
        except ProtocolError as err:
            return Expect(frame, err.task_id or "-", "?", reason=err.reason)
        except Exception as exc:  # the codec itself broke its contract (P-10)
            self._violation("codec_raised", f"decode_command raised {type(exc).__name__}: {exc}", frame)
            return None
        accepted = self.epoch <= command.epoch <= self.epoch + MAX_EPOCH_AHEAD
        if isinstance(command, Shutdown) and accepted:
            self._withheld += 1
            return None
        waits = isinstance(command, InitWeightGroup) and command.backend == "gloo"
        if waits and accepted and command.timeout_s >= self.config.reply_timeout_s / 2:
            count(self._withheld_known, "rendezvous_waits_by_design")
            return None
        for issue in self._open_issues:
            if accepted and issue.matches(command):
                count(self._withheld_known, issue.name)
                return None
        if accepted:
            self.epoch = command.epoch
        if serial_of(command.task_id) > self._oracle_serial:
            self._ids_taken.add(command.task_id)  # the oracle must not use it later
        return Expect(frame, command.task_id, type(command).__name__, message=command)

    def _resync_after_drop(self) -> None:
        """After zmq dropped the connection: the worker reconnects; a probe must get through."""
        deadline_at = time.monotonic() + self.config.reply_timeout_s
        while time.monotonic() < deadline_at:
            self._check_alive()
            status = Status(task_id=self._task_id("resync"), epoch=self.epoch)
            try:
                self.sock.send_multipart([self.identity, encode(status)], zmq.NOBLOCK)
            except zmq.ZMQError:  # not reconnected yet (ROUTER_MANDATORY)
                time.sleep(0.05)
                continue
            if self.sock.poll(1000):
                _, *parts = self.sock.recv_multipart()
                reply = self._decode_reply(parts[-1])
                if reply is not None and reply.task_id == status.task_id:
                    self.report.replies += 1
                    return
        self.report.hangs += 1
        self.report.add_finding(Finding("hang", "no answer after a frame over the socket limit dropped the link"))
        raise WorkerHung

    # ================================================================ replies

    def _receive(self, *, block: bool) -> None:
        """Take replies off the socket and match them against what was expected."""
        timeout_ms = int(self.config.reply_timeout_s * 1000) if block else 0
        waited_ms = 0
        while True:
            slice_ms = min(timeout_ms - waited_ms, 500) if block else 0
            if self.sock.poll(max(slice_ms, 0)):
                break
            if not block:
                return
            waited_ms += slice_ms
            self._check_alive()
            if waited_ms >= timeout_ms:
                self._on_hang()
        while True:
            try:
                identity, *parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if identity != self.identity:
                self._violation("stranger", f"a message from identity {identity!r}, not the worker's")
                continue
            reply = self._decode_reply(parts[-1])
            if reply is not None:
                self._match(reply)

    def _decode_reply(self, data: bytes) -> Message | None:
        self.report.replies += 1
        try:
            reply = decode(data)
        except ProtocolError as err:
            self._violation(
                "undecodable_reply", f"the worker sent bytes our codec refuses: {err.detail}", Frame((data,), "reply")
            )
            return None
        count(self.report.replies_by_type, type(reply).__name__)
        if isinstance(reply, Nack):
            count(self._nack_reasons, reply.reason.value)
        return reply

    def _match(self, reply: Message) -> None:
        for index, expect in enumerate(self.expect):
            if matches(expect, reply):
                for _ in range(index):  # frames before it got no reply
                    missed = self.expect.popleft()
                    self._violation(
                        "missing_reply",
                        f"no reply to a frame expecting {missed.command} task_id={missed.task_id!r}",
                        missed.frame,
                    )
                self.expect.popleft()
                self._check_reply(expect, reply)
                return
        self._violation("unexpected_reply", f"a reply no frame asked for: {short(reply)}")

    def _check_reply(self, expect: Expect, reply: Message) -> None:
        if expect.oracle:
            self._oracle_reply = reply
        for kind, detail in reply_problems(expect, reply):
            self._violation(kind, detail, expect.frame)
        self._follow_state(reply)
        command = expect.message
        if isinstance(command, ReloadWeights) and isinstance(reply, Ack) and command.source is not None:
            self.weights_dirty = True

    def _follow_state(self, reply: Message) -> None:
        if isinstance(reply, (Ack, Nack)):
            self.state = reply.state
        elif isinstance(reply, Result):
            self.state = WorkerState.ACTIVE

    def _sync(self) -> None:
        """Wait until every frame in flight has its reply."""
        while self.expect:
            self._receive(block=True)

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            code = self.proc.returncode
            self.report.crashes += 1
            last = [e.frame for e in list(self.expect)[-8:]]
            self.report.add_finding(
                Finding(
                    "crash",
                    f"the worker exited with code {code}; last log lines:\n{self._log_tail()}",
                    *frames_hex(last),
                )
            )
            self._write_reproducer("crash", last)
            self.expect.clear()
            raise WorkerCrashed

    def _on_hang(self) -> None:
        self.report.hangs += 1
        waiting = list(self.expect)
        self.report.add_finding(
            Finding(
                "hang",
                f"no reply in {self.config.reply_timeout_s} s; {len(waiting)} frames waiting",
                *frames_hex([e.frame for e in waiting[:8]]),
            )
        )
        self._write_reproducer("hang", [e.frame for e in waiting])
        self.expect.clear()
        raise WorkerHung

    def _lockstep(self, command: Command) -> Message:
        """Send one of the oracle's commands and wait for its one reply."""
        data = encode(command)
        self.report.valid_commands += 1
        self.generator.remember_valid(data)
        self._oracle_reply = None
        self._send((data,))
        self.expect.append(
            Expect(Frame((data,), "oracle"), command.task_id, type(command).__name__, message=command, oracle=True)
        )
        self._sync()
        reply = self._oracle_reply
        if reply is None:  # its expectation was passed over: a violation is recorded already
            raise WorkerHung
        return reply

    def _send(self, parts: tuple[bytes, ...]) -> None:
        self.report.bytes_sent += sum(len(p) for p in parts)
        deadline_at = time.monotonic() + self.config.reply_timeout_s
        while True:
            try:
                self.sock.send_multipart([self.identity, *parts], zmq.NOBLOCK)
                return
            except zmq.Again:  # the worker's queue is full: wait for replies, it is reading
                if time.monotonic() > deadline_at:
                    self._on_hang()
                self._receive(block=False)
                time.sleep(0.001)
            except zmq.ZMQError as exc:  # EHOSTUNREACH: the link is gone (ROUTER_MANDATORY)
                self._check_alive()
                if time.monotonic() > deadline_at:
                    self.report.add_finding(Finding("hang", f"cannot reach the worker: {exc}"))
                    self.report.hangs += 1
                    raise WorkerHung from None
                time.sleep(0.01)

    def _sample_rss(self, final: bool) -> None:
        rss = rss_bytes(self._pid)
        if rss is None:
            return
        report = self.report
        self._rss_samples.append((report.frames_sent, rss))
        if report.rss_before_bytes is None and report.frames_sent >= self.config.warmup_frames:
            report.rss_before_bytes = rss
        if report.rss_before_bytes is not None:
            report.rss_max_bytes = max(report.rss_max_bytes or 0, rss)
        if final:
            report.rss_after_bytes = rss

    # ================================================================ helpers

    @property
    def _recent_task_ids(self) -> tuple[str, ...]:
        """Task ids the worker knows: the oracle's recent ones (duplicates of real tasks)."""
        serial = self._oracle_serial
        return tuple(
            f"{kind}-{n}" for n in range(max(0, serial - 4), serial + 1) for kind in ("probe", "exec", "sleep", "wake")
        )

    def _task_id(self, kind: str) -> str:
        """A fresh id for the oracle, never one a fuzzed frame already gave the worker (a bit
        flip can turn a plausible id into one the oracle is about to use)."""
        while True:
            self._oracle_serial += 1
            task_id = f"{kind}-{self._oracle_serial}"
            if task_id not in self._ids_taken:
                self._ids_taken = {t for t in self._ids_taken if serial_of(t) > self._oracle_serial}
                return task_id

    def _violation(self, kind: str, detail: str, frame: Frame | None = None) -> None:
        self.report.violations += 1
        count(self.report.extra.setdefault("violations_by_kind", {}), kind)
        self.report.add_finding(Finding(kind, detail, *frames_hex([frame] if frame else [])))
        if frame is not None:
            self._write_reproducer(kind, [frame])

    def _write_reproducer(self, kind: str, frames: list[Frame]) -> None:
        if not self.config.out_dir or not frames:
            return
        directory = os.path.join(self.config.out_dir, "reproducers")
        os.makedirs(directory, exist_ok=True)
        for frame in frames[-16:]:
            digest = hashlib.sha256(b"".join(frame.parts)).hexdigest()[:16]
            with open(os.path.join(directory, f"worker-{kind}-{digest}.msgpack"), "wb") as out:
                out.write(msgspec.msgpack.encode(list(frame.parts)))
