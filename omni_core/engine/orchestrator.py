"""The orchestrator: one thread that owns the ROUTER socket, the rank processes and one
`StageCore` per stage. Every core call happens on that thread, so the cores need no locks;
API callers hand it closures through a queue and wait on futures.

The loop polls the socket, a wake-up pipe and every rank's process sentinel (a dead rank
is noticed from the OS, not only from a silent socket), then enforces deadlines. It is a
thin shell: decode, call the core, send what the core returns, resolve futures.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    OmniCoreError,
    RequestFailedError,
    RequestRejectedError,
    StageFailedError,
    TaskAbandonedError,
)
from omni_core.engine.report import LifecycleReport
from omni_core.engine.spec import AdmissionPolicy, StageSpec
from omni_core.fsm import StageCommandError, StageCore, StageStep, TaskOutcome
from omni_core.protocol import (
    Command,
    Execute,
    Hello,
    Nack,
    ProtocolError,
    Result,
    Shutdown,
    StageState,
    decode,
    encode,
)
from omni_core.protocol.auth import RANK_SECRET_ENV, new_rank_secret, verify_hello_proof
from omni_core.trace import open_trace
from omni_core.transport import CurveKeys, is_loopback, make_router
from omni_core.workers.config import WorkerConfig

log = logging.getLogger("omni_core.engine")

POLL_INTERVAL_S = 0.05  # upper bound on deadline lateness
TICK_INTERVAL_S = 0.01  # deadlines are checked at most this often
# Messages queued per peer before a send fails. Above StageSpec's max_in_flight bound plus
# the lifecycle commands, so a full queue means an overloaded engine, never a normal burst.
SOCKET_HWM = 10_000
TERMINATE_GRACE_S = 3.0


@dataclass
class _Request:
    task_id: str
    payload: Any
    future: Future
    deadline_at: float
    replies: dict[int, Result | Nack | None] = field(default_factory=dict)  # None: never sent


class _RankProcess:
    """One rank: a fresh interpreter running `python -m omni_core.workers` (a spawn that
    never re-imports the caller's __main__, so a plain script can start an Engine), plus a
    pollable descriptor that becomes readable when it exits (pidfd), so the loop learns of
    a death from the OS, not only from a silent socket."""

    def __init__(self, config: WorkerConfig, env: dict[str, str]) -> None:
        self.rank = config.rank
        self.epoch = config.epoch
        # Proves this process's Hello (protocol.auth); handed over in the environment only.
        self.secret = new_rank_secret()
        env = dict(env, **{RANK_SECRET_ENV: self.secret.hex()})
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "omni_core.workers", "--config", msgspec.json.encode(config).decode()],
            env=env, stdin=subprocess.DEVNULL)  # fmt: skip
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        self.identity: bytes | None = None
        self.expected_exit = False  # we told it to go (Shutdown, restart)
        self.exit_handled = False  # its end was seen once (sentinel or poll) and acted on

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def join(self, timeout_s: float) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(max(0.0, timeout_s))

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.terminate()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.popen.kill()

    def close_sentinel(self) -> None:
        if self.sentinel is not None:
            with contextlib.suppress(OSError):
                os.close(self.sentinel)
            self.sentinel = None


@dataclass
class _Stage:
    spec: StageSpec
    core: StageCore
    procs: list[_RankProcess] = field(default_factory=list)
    queue: deque[_Request] = field(default_factory=deque)
    inflight: dict[str, _Request] = field(default_factory=dict)
    waiters: dict[str, list[Future]] = field(default_factory=dict)
    start_waiters: list[Future] = field(default_factory=list)
    admission: AdmissionPolicy = AdmissionPolicy.QUEUE


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Orchestrator:
    def __init__(self, specs: Iterable[StageSpec], *, transport: str = "ipc", host: str = "127.0.0.1",
                 curve: bool | None = None, trace_path: str | None = None) -> None:  # fmt: skip
        specs = list(specs)
        if not specs:
            raise InvalidArgumentError("an engine needs at least one StageSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"stage names must be unique, got {names}")
        if transport not in ("ipc", "tcp"):
            raise InvalidArgumentError(f"transport must be 'ipc' or 'tcp', got {transport!r}")
        if transport == "ipc" and (host != "127.0.0.1" or curve):
            raise InvalidArgumentError("host and curve apply to transport='tcp'; ipc never leaves the host")
        # Traffic that can leave the host is encrypted and authenticated (CURVE); loopback
        # and ipc rely on the per-rank Hello proof alone (see specs/protocol.md, threat model).
        use_curve = curve if curve is not None else transport == "tcp" and not is_loopback(host)
        if transport == "tcp" and not is_loopback(host) and not use_curve:
            raise InvalidArgumentError(f"tcp on {host!r} leaves the host; it needs curve=True (the default there)")
        self.trace_path = trace_path
        self._trace = open_trace(trace_path, "engine")
        self._stages = {s.name: _Stage(s, StageCore(s.name, s.ranks, tags=s.tags),
                                       admission=AdmissionPolicy(s.admission)) for s in specs}  # fmt: skip
        self.max_frame_bytes = max(s.max_frame_bytes for s in specs)
        self._ctx = zmq.Context()
        self._curve = CurveKeys.generate() if use_curve else None
        self._curve_gate = None
        if self._curve is not None:
            from omni_core.transport.curve_auth import CurveGate  # a thread: only where CURVE is used

            self._curve_gate = CurveGate(self._ctx, self._curve)
        self._tmpdir = tempfile.mkdtemp(prefix="omni-core-")
        bind = f"ipc://{self._tmpdir}/router.sock" if transport == "ipc" else f"tcp://{host}:*"
        self._router = make_router(self._ctx, bind, hwm=SOCKET_HWM, max_frame_bytes=self.max_frame_bytes,
                                   curve=self._curve)  # fmt: skip
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._by_identity: dict[bytes, tuple[_Stage, int]] = {}
        self._sentinels: dict[int, tuple[_Stage, _RankProcess]] = {}
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._ids = itertools.count(1)
        self._next_tick_at = 0.0
        self._closing: Future | None = None
        self._closing_deadline_at = 0.0
        self._closed = threading.Event()
        # What strangers and faulty peers tried; each attempt is counted, none changes anything.
        self.counters = {"bad_replies": 0, "unknown_peers": 0, "late_results": 0, "send_failures": 0,
                         "forged_hellos": 0, "rebind_refused": 0, "rank_mismatch": 0}  # fmt: skip
        self.died_of: str | None = None
        self._thread = threading.Thread(target=self._loop, name="omni-core-orchestrator", daemon=True)
        self._thread.start()

    # ================================================================ calls from API threads

    def call(self, fn: Callable[[Future], None]) -> Future:
        """Run `fn(future)` on the loop thread; exceptions it raises settle the future."""
        future: Future = Future()
        if self.died_of is not None:
            future.set_exception(EngineClosedError(f"the engine's orchestrator failed ({self.died_of}); "
                                                   "its ranks were stopped; create a new Engine"))  # fmt: skip
            return future
        if self._closed.is_set() or self._closing is not None:
            future.set_exception(EngineClosedError("the engine is shut down; create a new Engine"))
            return future

        def run() -> None:
            try:
                fn(future)
            except StageCommandError as exc:
                _settle(future, error=InvalidArgumentError(str(exc)))
            except BaseException as exc:  # the loop must survive a bad call
                _settle(future, error=exc)

        self._calls.put((run, future))
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        return future

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def join(self, timeout_s: float) -> None:
        """Wait for the loop thread to end (after op_shutdown)."""
        self._thread.join(timeout_s)

    def stage(self, name: str) -> _Stage:
        try:
            return self._stages[name]
        except KeyError:
            raise InvalidArgumentError(f"unknown stage {name!r}; stages are {sorted(self._stages)}") from None

    def new_task_id(self, kind: str, stage: str) -> str:
        return f"{kind}-{stage}-{uuid.uuid4().hex[:12]}"

    # ---------------------------------------------------------------- operations (loop thread)

    def op_start(self, future: Future, name: str) -> None:
        stage = self.stage(name)
        stage.core.start(time.monotonic(), stage.spec.start_deadline_s)
        self._spawn_ranks(stage)
        stage.start_waiters.append(future)

    def op_execute(self, future: Future, name: str, payload: Any, timeout_s: float | None) -> None:
        stage = self.stage(name)
        now = time.monotonic()
        budget_s = stage.spec.request_timeout_s if timeout_s is None else float(timeout_s)
        request = _Request(f"req-{name}-{next(self._ids)}", payload, future, now + budget_s)
        if stage.core.admits() and len(stage.inflight) < stage.spec.max_in_flight and not stage.queue:
            self._dispatch(stage, request)
            return
        state = stage.core.state
        if stage.core.admits():  # RUNNING but at max_in_flight: wait in the bounded queue
            if len(stage.queue) >= stage.spec.queue_limit:
                raise RequestRejectedError(f"stage {name!r} has {len(stage.inflight)} requests in flight "
                                           f"(max_in_flight) and {len(stage.queue)} queued (queue_limit); "
                                           "retry later or raise the limits")  # fmt: skip
            stage.queue.append(request)
            return
        policy = stage.admission
        if state in (StageState.FAILED, StageState.STOPPED):
            raise RequestRejectedError(f"stage {name!r} is {state.value}: "
                                       f"{stage.core.failure or 'stopped'}; restart() it first")  # fmt: skip
        if policy is AdmissionPolicy.REJECT:
            raise RequestRejectedError(f"stage {name!r} is {state.value}, not RUNNING, and its "
                                       "admission policy is 'reject'; wake it first or use "
                                       "admission='queue' or 'wake'")  # fmt: skip
        if state is StageState.NEEDS_RELOAD:
            raise RequestRejectedError(f"stage {name!r} is NEEDS_RELOAD (weights discarded by a "
                                       "level-2 sleep); call reload_weights() before sending requests")  # fmt: skip
        if len(stage.queue) >= stage.spec.queue_limit:
            raise RequestRejectedError(f"stage {name!r} is {state.value} and its queue is full "
                                       f"({stage.spec.queue_limit} requests); retry later or raise "
                                       "queue_limit")  # fmt: skip
        stage.queue.append(request)
        self._pump(stage)

    def op_lifecycle(self, future: Future, name: str, call: Callable[[StageCore, float], StageStep],
                     task_id: str, abort_in_flight: bool = False) -> None:  # fmt: skip
        stage = self.stage(name)
        now = time.monotonic()
        stage.waiters.setdefault(task_id, []).append(future)
        try:
            step = self._core_call(stage, lambda: call(stage.core, now))
        except BaseException:
            stage.waiters[task_id].remove(future)
            if not stage.waiters[task_id]:
                del stage.waiters[task_id]
            raise
        if abort_in_flight and stage.core.state is StageState.DRAINING:
            # The callers hear now; the ranks still run these requests, so the Sleep goes
            # out only once every rank has answered them (retired), never over a running one.
            for request in stage.inflight.values():
                _settle(request.future, error=RequestFailedError(
                    f"request {request.task_id} aborted: stage {name!r} is going to sleep "
                    "(abort_in_flight=True)"))  # fmt: skip
        self._apply(stage, step)

    def op_set_admission(self, future: Future, name: str, policy: AdmissionPolicy) -> None:
        stage = self.stage(name)
        stage.admission = policy
        self._pump(stage)
        future.set_result(None)

    def op_restart(self, future: Future, name: str) -> None:
        stage = self.stage(name)
        core = stage.core
        if core.task_id is not None:
            raise InvalidArgumentError(f"stage {name!r} cannot restart while task {core.task_id!r} "
                                       "is in flight; wait for it to end")  # fmt: skip
        self._reap_ranks(stage)
        before = core.state
        core.restart(time.monotonic(), stage.spec.start_deadline_s)
        self._trace_state(stage, before, "restart")
        self._fail_requests(stage, RequestRejectedError(f"stage {name!r} restarted"))
        self._spawn_ranks(stage)
        stage.start_waiters.append(future)

    def op_status(self, future: Future) -> None:
        out = {}
        for name, stage in self._stages.items():
            core = stage.core
            out[name] = {
                "state": core.state.value, "epoch": core.epoch, "task_id": core.task_id,
                "admission": stage.admission.value,
                "failure": core.failure, "queued": len(stage.queue),
                "in_flight": len(stage.inflight), "counters": asdict(core.counters),
                "ranks": {p.rank: {"pid": p.pid, "alive": p.is_alive(),
                                   "state": core.rank_state[p.rank].value if p.rank in core.rank_state else "-"}
                          for p in stage.procs},
            }  # fmt: skip
        out["_engine"] = dict(self.counters, curve_refused=self._curve_gate.refused if self._curve_gate else 0)
        future.set_result(out)

    def op_shutdown(self, future: Future, timeout_s: float) -> None:
        if self._closing is not None:
            self._closing.add_done_callback(lambda f: _settle(future, result=None))
            return
        self._closing = future
        self._closing_deadline_at = time.monotonic() + timeout_s
        for stage in self._stages.values():
            self._fail_requests(stage, EngineClosedError("the engine shut down before this request ran"))
            for proc in stage.procs:
                proc.expected_exit = True
                if proc.is_alive():
                    self._send(stage, proc.rank, Shutdown(task_id=f"shutdown-{stage.core.epoch}-{proc.rank}",
                                                          epoch=stage.core.epoch))  # fmt: skip
            before = stage.core.state
            step = stage.core.stop(time.monotonic())
            self._trace_state(stage, before, "shutdown")
            self._resolve(stage, step.outcome)

    # ================================================================ the loop

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # last resort: never a silent zombie engine
            self._die(exc)
        finally:
            self._close_resources()

    def _die(self, exc: BaseException) -> None:
        """The loop itself failed (a bug): every waiting caller hears why at once, every stage
        fails, and the rank processes are stopped instead of outliving a dead orchestrator."""
        self.died_of = f"{type(exc).__name__}: {exc}"
        log.exception("orchestrator loop died; failing every caller and stopping the ranks")
        error = EngineClosedError(f"the engine's orchestrator failed ({self.died_of}); its ranks were stopped; "
                                  "create a new Engine (please report this with the log)")  # fmt: skip
        for stage in self._stages.values():
            self._fail_requests(stage, error)
            for future in [f for fs in stage.waiters.values() for f in fs] + stage.start_waiters:
                _settle(future, error=error)
            stage.waiters.clear()
            stage.start_waiters.clear()
            with contextlib.suppress(Exception):
                stage.core.on_ranks_unresponsive({r: f"stopped: the orchestrator failed ({self.died_of})"
                                                  for r in stage.core.ranks}, time.monotonic())  # fmt: skip
            with contextlib.suppress(Exception):
                self._reap_ranks(stage)
        if self._closing is not None:
            _settle(self._closing, result=None)

    def _serve(self) -> None:
        while True:
            ready = dict(self._poller.poll(self._poll_timeout_ms()))
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            self._run_calls()
            if self._router in ready:
                self._receive_all()
            for fd in [fd for fd in ready if fd in self._sentinels]:
                self._on_sentinel(fd)
            now = time.monotonic()
            if now >= self._next_tick_at:  # deadlines need ms, not a scan per message
                self._next_tick_at = now + TICK_INTERVAL_S
                self._tick(now)
            if self._closing is not None and self._finish_close():
                return

    def _poll_timeout_ms(self) -> int:
        return int(POLL_INTERVAL_S * 1000)

    def _run_calls(self) -> None:
        while True:
            try:
                run, _ = self._calls.get_nowait()
            except queue.Empty:
                return
            run()

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.counters["bad_replies"] += 1
                continue
            self._on_frames(frames[0], frames[1])

    def _on_frames(self, identity: bytes, data: bytes) -> None:
        try:
            message = decode(data, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError as exc:
            self.counters["bad_replies"] += 1
            self._trace.event("bad_reply", detail=exc.detail[:200])
            return
        now = time.monotonic()
        if isinstance(message, Hello):
            self._on_hello(identity, message, now)
            return
        where = self._by_identity.get(identity)
        if where is None or isinstance(message, Command):
            self.counters["unknown_peers"] += 1
            return
        stage, rank = where
        if message.rank != rank:  # a rank speaks only for itself: the socket names it, not the body
            self.counters["rank_mismatch"] += 1
            self._trace.event("rank_mismatch", stage=stage.spec.name, rank=rank, claimed=message.rank)
            return
        if self._trace.enabled:
            self._trace.event("recv", task_id=message.task_id, epoch=message.epoch,
                              state=stage.core.state.value, stage=stage.spec.name, rank=rank,
                              msg=type(message).__name__,
                              worker_state=getattr(message, "state", None),
                              status=getattr(message, "status", None),
                              reason=getattr(message, "reason", None))  # fmt: skip
        request = stage.inflight.get(message.task_id)
        if isinstance(message, Result) or (isinstance(message, Nack) and message.command == "Execute"):
            if request is None or message.epoch != stage.core.epoch:
                self.counters["late_results"] += 1
                return
            self._on_request_reply(stage, request, rank, message)
            return
        self._apply(stage, self._core_call(stage, lambda: stage.core.on_reply(message, now)))

    def _on_hello(self, identity: bytes, hello: Hello, now: float) -> None:
        """Bind a socket identity to a rank, once, and only for a process that proves it is
        the one the engine spawned (protocol.auth). Everything else is counted and dropped."""
        stage = self._stages.get(hello.stage)
        proc = stage.procs[hello.rank] if stage is not None and hello.rank < len(stage.procs) else None
        if stage is None or proc is None:
            self.counters["unknown_peers"] += 1
            return
        proven = hello.epoch == proc.epoch and hello.pid == proc.pid and verify_hello_proof(
            proc.secret, hello.proof, stage=hello.stage, rank=hello.rank, epoch=hello.epoch, pid=hello.pid,
            identity=identity)  # fmt: skip
        if not proven:
            self.counters["forged_hellos"] += 1
            self._trace.event("forged_hello", stage=stage.spec.name, rank=proc.rank)
            return
        if proc.identity is not None or identity in self._by_identity:
            self.counters["rebind_refused"] += 1  # a rank's identity, once bound, stays
            self._trace.event("rebind_refused", stage=stage.spec.name, rank=proc.rank)
            return
        proc.identity = identity
        self._by_identity[identity] = (stage, proc.rank)
        self._trace.event("recv", task_id=hello.task_id, epoch=hello.epoch, state=stage.core.state.value,
                          stage=stage.spec.name, rank=hello.rank, msg="Hello",
                          worker_state=hello.state.value)  # fmt: skip
        self._apply(stage, self._core_call(stage, lambda: stage.core.on_hello(hello, now)))

    def _on_sentinel(self, fd: int) -> None:
        stage, proc = self._sentinels.pop(fd)
        self._poller.unregister(fd)
        proc.close_sentinel()
        proc.join(0.5)
        self._on_rank_exit(stage, proc)

    def _on_rank_exit(self, stage: _Stage, proc: _RankProcess) -> None:
        if proc.exit_handled:
            return
        proc.exit_handled = True
        if proc.expected_exit:
            return
        code = proc.exitcode
        detail = f"pid {proc.pid} exited with code {code}"
        self._trace.event("rank_died", epoch=stage.core.epoch, state=stage.core.state.value,
                          stage=stage.spec.name, rank=proc.rank, detail=detail)  # fmt: skip
        self._apply(stage, self._core_call(stage, lambda: stage.core.on_rank_died(
            proc.rank, detail, time.monotonic(), epoch=proc.epoch)))

    def _tick(self, now: float) -> None:
        for stage in self._stages.values():
            for proc in stage.procs:  # platforms without pidfd: notice deaths by polling
                if proc.sentinel is None and not proc.exit_handled and not proc.is_alive():
                    self._on_rank_exit(stage, proc)
            self._apply(stage, self._core_call(stage, lambda s=stage: s.core.on_tick(now)))
            silent = self._expire_requests(stage, now)
            if silent:
                unresponsive = functools.partial(stage.core.on_ranks_unresponsive, silent, now)
                self._apply(stage, self._core_call(stage, unresponsive))
            while stage.queue and now >= stage.queue[0].deadline_at:
                request = stage.queue.popleft()
                _settle(request.future, error=RequestRejectedError(
                    f"request {request.task_id} waited in the queue of stage {stage.spec.name!r} "
                    f"until its deadline; the stage stayed {stage.core.state.value}"))  # fmt: skip

    def _expire_requests(self, stage: _Stage, now: float) -> dict[int, str]:
        """Requests past their deadline: tell their callers, return the ranks that stayed silent."""
        silent: dict[int, str] = {}
        for request in [r for r in stage.inflight.values() if now >= r.deadline_at]:
            missing = [p.rank for p in stage.procs if p.rank not in request.replies]
            _settle(request.future, error=RequestFailedError(
                f"request {request.task_id} to stage {stage.spec.name!r}: ranks {missing} gave no "
                "result before its deadline; the stage fails, since a rank still running a "
                "request cannot be put to sleep safely"))  # fmt: skip
            for rank in missing:
                silent.setdefault(rank, f"no result for request {request.task_id} before its deadline")
        return silent

    # ================================================================ helpers (loop thread)

    def _core_call(self, stage: _Stage, call: Callable[[], StageStep]) -> StageStep:
        before = stage.core.state
        step = call()
        self._trace_state(stage, before, "core")
        return step

    def _trace_state(self, stage: _Stage, before: StageState, why: str) -> None:
        after = stage.core.state
        if after is not before and self._trace.enabled:
            self._trace.event("state", epoch=stage.core.epoch, state=after.value, stage=stage.spec.name,
                              before=before.value, task_id=stage.core.task_id or "", why=why)  # fmt: skip

    def _apply(self, stage: _Stage, step: StageStep) -> None:
        for out in step.sends:
            self._send(stage, out.rank, out.command)
        self._resolve(stage, step.outcome)
        self._pump(stage)

    def _resolve(self, stage: _Stage, outcome: TaskOutcome | None) -> None:
        if outcome is None:
            return
        name = stage.spec.name
        if outcome.ok:
            result: Any = LifecycleReport.from_outcome(name, outcome)
            error: BaseException | None = None
        elif outcome.refused:
            result, error = None, InvalidArgumentError(f"stage {name!r}: {outcome.error}; the stage stays "
                                                       f"{outcome.state.value}")  # fmt: skip
        elif outcome.state is StageState.FAILED:
            result, error = None, StageFailedError(name, outcome.error, outcome.failures)
        else:
            result, error = None, TaskAbandonedError(outcome.error)
        for future in stage.waiters.pop(outcome.task_id, []):
            _settle(future, result=result, error=error)

    def _pump(self, stage: _Stage) -> None:
        """Move the stage's queue forward after anything changed."""
        core = stage.core
        state = core.state
        if state is StageState.RUNNING:
            for future in stage.start_waiters:
                _settle(future, result=None)
            stage.start_waiters.clear()
            while stage.queue and core.admits() and len(stage.inflight) < stage.spec.max_in_flight:
                self._dispatch(stage, stage.queue.popleft())
        elif state is StageState.FAILED:
            failed = StageFailedError(stage.spec.name, core.failure, core.failed_ranks)
            for future in stage.start_waiters:
                _settle(future, error=failed)
            stage.start_waiters.clear()
            self._fail_requests(stage, RequestRejectedError(f"{core.failure}; restart() the stage"))
        elif state is StageState.NEEDS_RELOAD and stage.queue:
            self._fail_requests(stage, RequestRejectedError(
                f"stage {stage.spec.name!r} is NEEDS_RELOAD; call reload_weights() first"))
        elif (stage.admission is AdmissionPolicy.WAKE and stage.queue and core.task_id is None
              and state in (StageState.SLEEPING, StageState.PARTIAL)):  # fmt: skip
            task_id = self.new_task_id("auto-wake", stage.spec.name)
            now = time.monotonic()
            self._trace.event("auto_wake", task_id=task_id, epoch=core.epoch, state=state.value,
                              stage=stage.spec.name)  # fmt: skip
            self._apply(stage, self._core_call(
                stage, lambda: core.wake(task_id, None, now, stage.spec.deadline_s)))

    def _dispatch(self, stage: _Stage, request: _Request) -> None:
        stage.core.request_started()
        stage.inflight[request.task_id] = request
        command = Execute(task_id=request.task_id, epoch=stage.core.epoch, payload=request.payload)
        unsent = [proc.rank for proc in stage.procs if not self._send(stage, proc.rank, command)]
        if not unsent:
            return
        # The engine, not a rank, is at fault: its socket queue to these ranks is full (or they
        # are gone, which the sentinel reports on its own). The caller hears it now; ranks that
        # did get the request still answer it, and it retires when they have.
        _settle(request.future, error=RequestFailedError(
            f"request {request.task_id} to stage {stage.spec.name!r} could not be sent to ranks {unsent}: "
            f"the engine is overloaded (socket queue of {SOCKET_HWM} messages full); retry later or "
            "lower max_in_flight"))  # fmt: skip
        for rank in unsent:
            request.replies[rank] = None
        if len(request.replies) == len(stage.procs):
            self._retire(stage, request)

    def _on_request_reply(self, stage: _Stage, request: _Request, rank: int, reply: Result | Nack) -> None:
        request.replies[rank] = reply
        if len(request.replies) < len(stage.procs):
            return  # a request retires only when every rank has answered it
        refusals = {r: m for r, m in sorted(request.replies.items()) if isinstance(m, Nack)}
        if refusals:
            named = "; ".join(f"rank {r}: {m.reason.value} in {m.state.value}: {m.detail}"
                              for r, m in refusals.items())  # fmt: skip
            _settle(request.future, error=RequestFailedError(
                f"stage {stage.spec.name!r} refused request {request.task_id} ({named})"))
        else:  # rank 0's output (ranks of one stage compute the same result); None: never sent
            results = [m for _, m in sorted(request.replies.items()) if isinstance(m, Result)]
            if results:
                _settle(request.future, result=results[0].output)
        self._retire(stage, request)

    def _retire(self, stage: _Stage, request: _Request) -> None:
        """Every rank has answered: the request no longer holds the stage's drain open."""
        if stage.inflight.pop(request.task_id, None) is None:
            return
        if stage.core.in_flight_requests > 0:
            now = time.monotonic()
            self._apply(stage, self._core_call(stage, lambda: stage.core.request_finished(now)))

    def _fail_requests(self, stage: _Stage, error: OmniCoreError) -> None:
        for request in list(stage.inflight.values()) + list(stage.queue):
            _settle(request.future, error=error)
        stage.inflight.clear()
        stage.queue.clear()

    def _send(self, stage: _Stage, rank: int, command: Command) -> bool:
        """Queue one command for a rank; False when it could not be (counted)."""
        proc = stage.procs[rank] if rank < len(stage.procs) else None
        if self._trace.enabled:
            self._trace.event("send", task_id=command.task_id, epoch=command.epoch,
                              state=stage.core.state.value, stage=stage.spec.name, rank=rank,
                              msg=type(command).__name__, level=getattr(command, "level", None),
                              tags=getattr(command, "tags", None))  # fmt: skip
        if proc is None or proc.identity is None:
            self.counters["send_failures"] += 1  # the deadline names this rank (P-9)
            return False
        try:
            self._router.send_multipart([proc.identity, encode(command)], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            self.counters["send_failures"] += 1
            return False
        return True

    def _spawn_ranks(self, stage: _Stage) -> None:
        spec = stage.spec
        stage.procs = []
        master_port = _free_tcp_port()  # for runners that form a torch.distributed group
        for rank in range(spec.ranks):
            config = WorkerConfig(address=self.address, rank=rank, epoch=stage.core.epoch,
                                  stage=spec.name, runner=spec.runner, runner_args=dict(spec.runner_args),
                                  backend=spec.backend, device=spec.device, tags=spec.tags,
                                  gpu_memory_fraction=spec.gpu_memory_fraction,
                                  max_frame_bytes=spec.max_frame_bytes,
                                  curve_server_key=self._curve.server_public.decode() if self._curve else None,
                                  trace_path=self.trace_path, parent_pid=os.getpid())  # fmt: skip
            # torchrun-style variables for runners that form a process group, and the rank's GPU.
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(spec.ranks), LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port))  # fmt: skip
            if spec.devices:
                env["CUDA_VISIBLE_DEVICES"] = spec.devices[rank]
            if self._curve is not None:
                env.update(self._curve.client_env())
            proc = _RankProcess(config, env)
            stage.procs.append(proc)
            if proc.sentinel is not None:
                self._sentinels[proc.sentinel] = (stage, proc)
                self._poller.register(proc.sentinel, zmq.POLLIN)
            self._trace.event("spawn", epoch=stage.core.epoch, state=stage.core.state.value,
                              stage=spec.name, rank=rank, pid=proc.pid)  # fmt: skip

    def _reap_ranks(self, stage: _Stage) -> None:
        for proc in stage.procs:
            proc.expected_exit = True
            if proc.is_alive():
                proc.terminate()
        deadline_at = time.monotonic() + TERMINATE_GRACE_S
        for proc in stage.procs:
            proc.join(max(0.0, deadline_at - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(TERMINATE_GRACE_S)
            self._forget(proc)

    def _forget(self, proc: _RankProcess) -> None:
        if proc.identity is not None:
            self._by_identity.pop(proc.identity, None)
        if proc.sentinel is not None and self._sentinels.pop(proc.sentinel, None) is not None:
            self._poller.unregister(proc.sentinel)
        proc.close_sentinel()

    def _finish_close(self) -> bool:
        procs = [p for s in self._stages.values() for p in s.procs]
        if any(p.is_alive() for p in procs) and time.monotonic() < self._closing_deadline_at:
            return False
        for stage in self._stages.values():
            self._reap_ranks(stage)
        assert self._closing is not None
        _settle(self._closing, result=None)
        return True

    def _close_resources(self) -> None:
        self._closed.set()
        while True:  # settle calls that raced the shutdown
            try:
                _, future = self._calls.get_nowait()
            except queue.Empty:
                break
            _settle(future, error=EngineClosedError("the engine shut down before this call ran"))
        self._router.close(0)
        if self._curve_gate is not None:
            self._curve_gate.stop()
        self._ctx.term()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._trace.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
