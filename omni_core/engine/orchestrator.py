"""The orchestrator: one thread that owns the ROUTER socket, the rank processes and one
`StageCore` per stage. It is an IO loop and nothing else: it polls the socket, a wake-up
pipe and every rank's process sentinel; turns what it sees into typed engine inputs
(`omni_core.fsm.inputs`); hands each to its stage's core (`StageCore.step`); sends the
commands the core returns and resolves the callers' futures with the outcomes. Admission,
queues, request aggregation, deadlines and the lifecycle are the core's.

Every core call happens on this thread, so the cores need no locks; API callers hand it
inputs through a queue and wait on futures. Only processes the engine spawned may speak for
a rank: a Hello binds a socket identity once, on a valid proof (protocol.auth).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
import zmq

from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    InvalidPayloadError,
    NoMemoryError,
    OmniCoreError,
    PayloadTooLargeError,
    ProfileRefusedError,
    RequestFailedError,
    RequestRejectedError,
    RestartInProgressError,
    StageFailedError,
    TaskAbandonedError,
    WeightUpdateFailedError,
)
from omni_core.engine.incoming import IncomingSlots, SwapCall, stage_devices
from omni_core.engine.launch import LocalLauncher, RankHandle, RankLauncher
from omni_core.engine.link_plan import LinkLedger, RankView, rank_view
from omni_core.engine.report import ExecuteResult, LifecycleReport, ProfileReport
from omni_core.engine.spec import StageSpec
from omni_core.fsm import InvariantViolation, StageCommandError, StageCore, StageStep, TaskOutcome
from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestError, RequestOutcome
from omni_core.fsm.trace_records import PeerRefused, RankSpawned, TraceRecord, clip
from omni_core.isolation import FrameErrors
from omni_core.protocol import (
    Ack,
    Capability,
    Command,
    Execute,
    Hello,
    Nack,
    ProtocolError,
    Shutdown,
    Sleep,
    StageState,
    Wake,
    WorkerState,
    decode,
    encode,
    payload_problem,
)
from omni_core.protocol.auth import verify_hello_proof
from omni_core.protocol.codec import wire_int_problem
from omni_core.trace import open_trace
from omni_core.transport import CurveKeys, is_loopback, make_router

log = logging.getLogger("omni_core.engine")

POLL_INTERVAL_S = 0.05  # upper bound on deadline lateness
TICK_INTERVAL_S = 0.01  # deadlines are checked at most this often
# Messages queued per peer before a send fails. Above StageSpec's max_in_flight bound plus
# the lifecycle commands, so a full queue means an overloaded engine, never a normal burst.
SOCKET_HWM = 10_000

# A rank's state in status() once its process is gone (beside WorkerState's values).
RANK_EXITED = "EXITED"

_REQUEST_ERRORS: dict[RequestError, type[OmniCoreError]] = {
    RequestError.REJECTED: RequestRejectedError,
    RequestError.FAILED: RequestFailedError,
    RequestError.ABORTED: RequestFailedError,
    RequestError.OVERLOADED: RequestFailedError,
    RequestError.CLOSED: EngineClosedError,
}


@dataclass
class _Stage:
    spec: StageSpec
    core: StageCore
    procs: list[RankHandle] = field(default_factory=list)
    waiters: dict[str, list[Future]] = field(default_factory=dict)  # lifecycle task_id -> callers
    requests: dict[str, Future] = field(default_factory=dict)  # request_id -> caller
    versioned: set[str] = field(default_factory=set)  # requests whose caller hears the weights version too
    start_waiters: list[Future] = field(default_factory=list)
    hellos: dict[int, Hello] = field(default_factory=dict)  # each rank's proven Hello of this epoch
    # rank -> the state its own latest reply named (Hello, Ack, Nack). The core keeps the
    # committed state; after a task failed part-way the ranks may be elsewhere, and status
    # shows where they said they are.
    reported: dict[int, WorkerState] = field(default_factory=dict)


def _settle(future: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _nodes(stage: _Stage) -> dict[int, str]:
    return {p.rank: p.node for p in stage.procs}


def _core_for(spec: StageSpec) -> StageCore:
    return StageCore(
        spec.name,
        spec.ranks,
        tags=spec.tags,
        policy=spec.admission,
        queue_limit=spec.queue_limit,
        max_in_flight=spec.max_in_flight,
        wake_deadline_s=spec.deadline_s,
    )


class Orchestrator:
    def __init__(
        self,
        specs: Iterable[StageSpec],
        *,
        transport: str | None = None,
        host: str | None = None,
        curve: bool | None = None,
        trace_path: str | None = None,
        launcher: RankLauncher | None = None,
    ) -> None:
        specs = list(specs)
        self._launcher: RankLauncher = launcher if launcher is not None else LocalLauncher()
        if not specs:
            raise InvalidArgumentError("an engine needs at least one StageSpec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"stage names must be unique, got {names}")
        if self._launcher.remote:
            # Ranks elsewhere reach us over tcp on the interface the cluster knows this node
            # by, always with CURVE: the network between hosts is not ours.
            if transport not in (None, "tcp") or curve is False:
                raise InvalidArgumentError(
                    f"the {self._launcher.name} launcher runs ranks on other hosts: "
                    "transport must be 'tcp' and curve not False"
                )
            transport, curve = "tcp", True
            host = host if host is not None else self._launcher.bind_host()
        transport = transport if transport is not None else "ipc"
        host = host if host is not None else "127.0.0.1"
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
        self._trace = open_trace(trace_path)
        self._stages = {s.name: _Stage(s, _core_for(s)) for s in specs}
        self.max_frame_bytes = max(s.max_frame_bytes for s in specs)
        self._ctx = zmq.Context()
        self._curve = CurveKeys.generate() if use_curve else None
        self._curve_gate = None
        if self._curve is not None:
            from omni_core.transport.curve_auth import CurveGate  # a thread: only where CURVE is used

            self._curve_gate = CurveGate(self._ctx, self._curve)
        self._tmpdir = tempfile.mkdtemp(prefix="omni-core-")
        bind = f"ipc://{self._tmpdir}/router.sock" if transport == "ipc" else f"tcp://{host}:*"
        self._router = make_router(
            self._ctx, bind, hwm=SOCKET_HWM, max_frame_bytes=self.max_frame_bytes, curve=self._curve
        )
        self.address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._by_identity: dict[bytes, tuple[_Stage, int]] = {}
        self._sentinels: dict[int, tuple[_Stage, RankHandle]] = {}
        self._calls: queue.SimpleQueue[tuple[Callable[[], None], Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._next_tick_at = 0.0
        self._request_ids = itertools.count(1)
        self._closing: Future | None = None
        self._closing_deadline_at = 0.0
        self._closed = threading.Event()
        # What strangers and faulty peers tried; each attempt is counted, none changes anything.
        self._links = LinkLedger()
        self._engine_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._incoming: IncomingSlots[SwapCall] = IncomingSlots()
        self.counters = {
            "bad_replies": 0,
            "unknown_peers": 0,
            "send_failures": 0,
            "forged_hellos": 0,
            "rebind_refused": 0,
            "rank_mismatch": 0,
        }
        # What the loop caught while handling one frame, exit or tick, by cause (bounded labels).
        self.frame_errors = FrameErrors("orchestrator", log)
        self.died_of: str | None = None
        self._thread = threading.Thread(target=self._loop, name="omni-core-orchestrator", daemon=True)
        self._thread.start()

    # ================================================================ calls from API threads

    def call(self, fn: Callable[[Future], None]) -> Future:
        """Run `fn(future)` on the loop thread; exceptions it raises settle the future."""
        future: Future = Future()
        if self.died_of is not None:
            future.set_exception(
                EngineClosedError(
                    f"the engine's orchestrator failed ({self.died_of}); its ranks were stopped; create a new Engine"
                )
            )
            return future
        if self._closed.is_set() or self._closing is not None:
            future.set_exception(EngineClosedError("the engine is shut down; create a new Engine"))
            return future

        def run() -> None:
            try:
                fn(future)
            except StageCommandError as exc:
                _settle(future, error=InvalidArgumentError(str(exc)))
            except InvariantViolation:
                raise  # a core left in a state its invariants forbid: the loop dies loudly (_die)
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
        self._spawn(stage)
        stage.start_waiters.append(future)
        self._step(stage, I.Start(stage.spec.start_deadline_s))

    def op_execute(
        self, future: Future, name: str, payload: Any, timeout_s: float | None, with_version: bool = False
    ) -> None:
        stage = self.stage(name)
        budget_s = stage.spec.request_timeout_s if timeout_s is None else float(timeout_s)
        request_id = f"req-{name}-{next(self._request_ids)}"
        # Refused here, whole: a rank cannot name the task of a frame it refuses unread, so an
        # oversized request sent on would only end at its deadline (the fuzzer found it).
        problem = payload_problem(payload)
        if problem is not None:
            raise InvalidPayloadError(f"the request to stage {name!r} was not sent: {problem}")
        try:
            size_bytes = len(encode(Execute(task_id=request_id, epoch=stage.core.epoch, payload=payload)))
        except OverflowError as exc:
            raise InvalidPayloadError(f"the request to stage {name!r} was not sent: {wire_int_problem(exc)}") from None
        except (TypeError, ValueError, RecursionError) as exc:
            raise InvalidPayloadError(
                f"the request to stage {name!r} was not sent: its payload cannot be encoded "
                f"({type(exc).__name__}: {str(exc)[:200]}); a payload must be made of dict, "
                "list, str, bytes, int, float, bool and None"
            ) from None
        if size_bytes > stage.spec.max_frame_bytes:
            raise PayloadTooLargeError(
                f"the request to stage {name!r} encodes to {size_bytes} bytes, over its "
                f"max_frame_bytes of {stage.spec.max_frame_bytes}; send less or raise "
                "StageSpec.max_frame_bytes"
            )
        stage.requests[request_id] = future
        if with_version:
            stage.versioned.add(request_id)
        self._step(stage, I.Submit(request_id, payload, budget_s))

    def op_lifecycle(
        self,
        future: Future,
        name: str,
        event: I.SleepCall | I.WakeCall | I.ReloadCall | I.ProfileCall | I.UpdateCall | I.WeightGroupCall | I.ShareCall,
    ) -> None:
        stage = self.stage(name)
        stage.waiters.setdefault(event.task_id, []).append(future)
        try:
            self._step(stage, event)
        except BaseException:
            stage.waiters[event.task_id].remove(future)
            if not stage.waiters[event.task_id]:
                del stage.waiters[event.task_id]
            raise

    def op_swap(
        self,
        future: Future,
        out_name: str,
        sleep: I.SleepCall,
        out_future: Future,
        in_name: str,
        wake: I.WakeCall,
        in_future: Future,
    ) -> None:
        """Both halves of a swap in one turn of the loop, so that the outgoing stage's copies and
        the incoming stage's wait for memory start together; `future` settles once they are
        sent. A waiting wake holds its devices until it ends (engine/incoming.py): a swap
        into a held device waits for it first, within its deadline."""
        self.stage(out_name)
        swap = SwapCall(future, out_name, sleep, out_future, in_name, wake, in_future)
        waits = wake.wait_for_memory_s > 0
        devices = stage_devices(self.stage(in_name).spec, self._engine_visible) if waits else frozenset()
        key = (in_name, wake.task_id)
        swap_id = wake.task_id.removesuffix("/in")
        if self._incoming.offer(key, swap_id, devices, time.monotonic(), wake.deadline_s, swap):
            self._swap_now(key, swap)

    def _swap_now(self, key: tuple[str, str], swap: SwapCall) -> None:
        """The sleep goes first: when it is refused nothing was sent. When the wake is refused
        the sleep goes on (its outcome comes in `out_future`) and the refusal is the wake's."""
        try:
            self.op_lifecycle(swap.out_future, swap.out_name, swap.sleep)
        except InvariantViolation:
            raise
        except BaseException as exc:
            self._incoming.release(key)
            _settle(swap.future, error=InvalidArgumentError(str(exc)) if isinstance(exc, StageCommandError) else exc)
            return
        try:
            self.op_lifecycle(swap.in_future, swap.in_name, swap.wake)
        except InvariantViolation:
            raise
        except BaseException as exc:  # the sleep goes on; the caller hears both halves
            self._incoming.release(key)
            _settle(swap.in_future, error=InvalidArgumentError(str(exc)) if isinstance(exc, StageCommandError) else exc)
        _settle(swap.future, result=None)

    def _advance_swaps(self) -> None:
        """Issue the waiting swaps whose devices are free, with what is left of their deadline
        (the wait for memory keeps its share of it); refuse those whose deadline passed."""
        while True:
            now = time.monotonic()
            due, expired = self._incoming.advance(now)
            for entry in expired:
                _settle(entry.item.future, error=self._incoming.expired_error(entry))
            if not due:
                return
            for entry in due:
                self._swap_now(entry.key, entry.item.shortened(entry.deadline_at_s - now))

    def op_set_admission(self, future: Future, name: str, event: I.SetAdmission) -> None:
        self._step(self.stage(name), event)
        future.set_result(None)

    def op_restart(self, future: Future, name: str) -> None:
        stage = self.stage(name)
        if stage.core.task_id is not None:
            raise InvalidArgumentError(
                f"stage {name!r} cannot restart while task {stage.core.task_id!r} is in flight; wait for it to end"
            )
        # The core decides first: a refused restart leaves the ranks of the one in progress
        # alone (reaping them first killed that restart's fresh ranks).
        try:
            self._step(stage, I.Restart(stage.spec.start_deadline_s))
        except StageCommandError as exc:
            if stage.core.state is StageState.STARTING:
                raise RestartInProgressError(
                    f"stage {name!r} is already starting (epoch {stage.core.epoch}): a restart or its first start "
                    "is in progress and goes on; wait for it (status shows STARTING, then RUNNING or FAILED) "
                    "instead of restarting again"
                ) from exc
            raise
        self._reap(stage)
        self._spawn(stage)
        stage.start_waiters.append(future)

    def op_status(self, future: Future) -> None:
        out: dict[str, Any] = {}
        for name, stage in self._stages.items():
            core = stage.core
            out[name] = {
                "state": core.state.value,
                "epoch": core.epoch,
                "task_id": core.task_id,
                "admission": core.policy.value,
                "failure": core.failure,
                "queued": len(core.queue),
                "in_flight": len(core.in_flight),
                "counters": asdict(core.counters),
                "weights_version": core.weights_version,
                "asleep_tags": sorted(core.residency.asleep),
                "weights_valid": core.residency.weights_valid,
                "ranks": {p.rank: self._rank_status(stage, p) for p in stage.procs},
                "swaps_waiting": self._incoming.waiting(name),
            }
        out["_engine"] = dict(
            self.counters,
            curve_refused=self._curve_gate.refused if self._curve_gate else 0,
            **self.frame_errors.as_counters(),
        )
        future.set_result(out)

    @staticmethod
    def _rank_status(stage: _Stage, proc: RankHandle) -> dict[str, Any]:
        """`state`: where the rank is, as far as the engine knows: EXITED once its process is
        gone, else the state its latest reply named; `committed_state`: the state the stage
        last committed for it (the two differ after a task failed part-way)."""
        alive = proc.is_alive()
        committed = stage.core.rank_state.get(proc.rank)
        reported = stage.reported.get(proc.rank)
        known = reported or committed
        state = RANK_EXITED if not alive else known.value if known else "-"
        hello = stage.hellos.get(proc.rank)
        return {
            "pid": proc.pid,
            "alive": alive,
            "node": proc.node,
            "state": state,
            "committed_state": committed.value if committed else "-",
            "weights_version": stage.core.rank_versions.get(proc.rank, 0),
            "pool_bytes": dict(stage.core.rank_pool_bytes.get(proc.rank, {})),
            "runner_counters": dict(stage.core.rank_counters.get(proc.rank, {})),
            "backend": hello.backend if hello else "-",
            "backend_reason": hello.backend_reason if hello else "",
        }

    def op_shutdown(self, future: Future, timeout_s: float) -> None:
        if self._closing is not None:
            self._closing.add_done_callback(lambda f: _settle(future, result=None))
            return
        self._closing = future
        self._closing_deadline_at = time.monotonic() + timeout_s
        for entry in self._incoming.drain():
            _settle(entry.item.future, error=EngineClosedError("the engine shut down before this swap could start"))
        for stage in self._stages.values():
            # The core first: its StageStopped record ends the stage's trace before any
            # rank hears of the shutdown (the spec does not model Shutdown).
            self._step(stage, I.Stop())
            for proc in stage.procs:
                proc.expected_exit = True
                if proc.is_alive() and proc.identity is None:
                    proc.terminate()  # never said Hello: no socket to tell it on, so no grace to wait out
                elif proc.is_alive():
                    self._send(
                        stage,
                        proc.rank,
                        Shutdown(task_id=f"shutdown-{stage.core.epoch}-{proc.rank}", epoch=stage.core.epoch),
                    )

    # ================================================================ the loop

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # last resort: never a silent zombie engine
            self._die(exc)
        finally:
            self._close_resources()

    def _serve(self) -> None:
        while True:
            ready = dict(self._poller.poll(int(POLL_INTERVAL_S * 1000)))
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            self._run_calls()
            if self._router in ready:
                self._receive_all()
            for fd in [fd for fd in ready if fd in self._sentinels]:
                self._isolated("a rank's exit", self._on_sentinel, fd)
            now = time.monotonic()
            if now >= self._next_tick_at:  # deadlines need ms, not a scan per message
                self._next_tick_at = now + TICK_INTERVAL_S
                for stage in self._stages.values():
                    self._isolated(f"the deadline tick of stage {stage.spec.name!r}", self._tick, stage)
            self._advance_swaps()
            if self._closing is not None and self._finish_close():
                return

    def _die(self, exc: BaseException) -> None:
        """The loop itself failed (a bug): every waiting caller hears why at once, every stage
        fails, and the rank processes are stopped instead of outliving a dead orchestrator."""
        self.died_of = f"{type(exc).__name__}: {exc}"
        log.exception("orchestrator loop died; failing every caller and stopping the ranks")
        error = EngineClosedError(
            f"the engine's orchestrator failed ({self.died_of}); its ranks were stopped; "
            "create a new Engine (please report this with the log)"
        )
        for stage in self._stages.values():
            for future in [
                *stage.requests.values(),
                *stage.start_waiters,
                *(f for fs in stage.waiters.values() for f in fs),
            ]:
                _settle(future, error=error)
            stage.requests.clear()
            stage.versioned.clear()
            stage.waiters.clear()
            for entry in self._incoming.drain():
                _settle(entry.item.future, error=error)
            stage.start_waiters.clear()
            with contextlib.suppress(Exception):
                self._launcher.reap(stage.procs)
        if self._closing is not None:
            _settle(self._closing, result=None)

    def _run_calls(self) -> None:
        while True:
            try:
                run, _ = self._calls.get_nowait()
            except queue.Empty:
                return
            run()

    def _isolated(self, handling: str, handler: Callable[..., None], *args: Any) -> None:
        """One frame's (or one exit's, one tick's) handling: whatever it raises ends here,
        counted by cause and logged at a bounded rate (omni_core.isolation); the frame is
        dropped. A violated invariant of a core is the one exception: the loop dies loudly."""
        try:
            handler(*args)
        except InvariantViolation:
            raise
        except Exception as exc:
            self.frame_errors.record(exc, handling)

    def _receive_all(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as exc:
                self.frame_errors.record(exc, "receiving a frame")
                return
            if len(frames) != 2:
                self.counters["bad_replies"] += 1
                continue
            self._isolated("a frame from a peer", self._on_frames, frames[0], frames[1])

    def _on_frames(self, identity: bytes, data: bytes) -> None:
        try:
            message = decode(data, max_frame_bytes=self.max_frame_bytes)
        except ProtocolError as exc:
            self.counters["bad_replies"] += 1
            self._trace.write((PeerRefused("bad_reply", detail=clip(exc.detail)),))
            return
        if isinstance(message, Hello):
            self._on_hello(identity, message)
            return
        where = self._by_identity.get(identity)
        if where is None or isinstance(message, Command):
            self.counters["unknown_peers"] += 1
            return
        stage, rank = where
        if message.rank != rank:  # a rank speaks only for itself: the socket names it, not the body
            self.counters["rank_mismatch"] += 1
            self._write(stage, (PeerRefused("rank_mismatch", rank, f"claimed rank {message.rank}"),))
            return
        if isinstance(message, (Ack, Nack)):
            stage.reported[rank] = message.state
        self._step(stage, I.Received(message))

    def _on_hello(self, identity: bytes, hello: Hello) -> None:
        """Bind a socket identity to a rank, once, and only for a process that proves it is
        the one the engine spawned (protocol.auth). Everything else is counted and dropped."""
        stage = self._stages.get(hello.stage)
        proc = stage.procs[hello.rank] if stage is not None and hello.rank < len(stage.procs) else None
        if stage is None or proc is None:
            self.counters["unknown_peers"] += 1
            return
        # A rank on another node may say Hello before its launcher learned its pid: the proof
        # (a secret only that rank was given) is what authenticates; a known pid must match.
        pid_ok = proc.pid is None or hello.pid == proc.pid
        proven = (
            hello.epoch == proc.epoch
            and pid_ok
            and verify_hello_proof(
                proc.secret,
                hello.proof,
                stage=hello.stage,
                rank=hello.rank,
                epoch=hello.epoch,
                pid=hello.pid,
                identity=identity,
            )
        )
        if not proven:
            self.counters["forged_hellos"] += 1
            self._write(stage, (PeerRefused("forged_hello", proc.rank),))
            return
        if proc.identity is not None or identity in self._by_identity:
            self.counters["rebind_refused"] += 1  # a rank's identity, once bound, stays
            self._write(stage, (PeerRefused("rebind_refused", proc.rank),))
            return
        proc.identity = identity
        proc.pid = hello.pid
        stage.hellos[proc.rank] = hello
        self._by_identity[identity] = (stage, proc.rank)
        stage.reported[proc.rank] = hello.state
        self._step(stage, I.Received(hello))

    def _on_sentinel(self, fd: int) -> None:
        stage, proc = self._sentinels.pop(fd)
        self._poller.unregister(fd)
        proc.close_sentinel()
        proc.join(0.5)
        self._on_rank_exit(stage, proc)

    def _on_rank_exit(self, stage: _Stage, proc: RankHandle) -> None:
        if proc.exit_handled:
            return
        proc.exit_handled = True
        if proc.expected_exit:
            return
        detail = proc.exit_cause()
        self._step(stage, I.RankExited(proc.rank, detail, proc.epoch))

    def _tick(self, stage: _Stage) -> None:
        for proc in stage.procs:  # platforms without pidfd: notice deaths by polling
            if proc.sentinel is None and not proc.exit_handled and not proc.is_alive():
                self._on_rank_exit(stage, proc)
        self._step(stage, I.Tick())

    # ================================================================ stepping the core

    def _step(self, stage: _Stage, event: I.EngineInput) -> None:
        """One input into the stage's core, then do what its step says (its records first:
        each is written before what it describes leaves)."""
        step = stage.core.step(event, time.monotonic())
        self._write(stage, step.records)
        self._apply(stage, step)

    def _write(self, stage: _Stage, records: tuple[TraceRecord, ...]) -> None:
        if self._trace.enabled:
            self._trace.write(records, stage=stage.spec.name, epoch=stage.core.epoch)

    def _apply(self, stage: _Stage, step: StageStep) -> None:
        unsent: dict[str, list[int]] = {}
        encoded: dict[int, bytes] = {}  # one encode per command, not per rank (a payload may be large)
        for out in step.sends:
            command = self._with_links(stage, out.rank, out.command)
            data = encoded.get(id(command))
            if data is None:
                data = encoded[id(command)] = encode(command)
            if not self._send(stage, out.rank, command, data):
                unsent.setdefault(command.task_id, []).append(out.rank)
        if step.outcome is not None:
            self._links.release(stage.spec.name, step.outcome.task_id)
            self._incoming.release((stage.spec.name, step.outcome.task_id))
        self._resolve(stage, step.outcome)
        for answer in step.requests:
            self._answer(stage, answer)
        if step.started is not None:
            self._started(stage, step.started)
        for task_id, ranks in unsent.items():
            self._step(stage, I.SendFailed(task_id, tuple(ranks)))

    def _with_links(self, stage: _Stage, rank: int, command: Command) -> Command:
        """A Sleep or Wake with the rank's link plan (P-18), planned once per task over the
        node's idle GPUs (engine/link_plan.py); every other command as it is."""
        if not isinstance(command, (Sleep, Wake)) or not stage.spec.multi_path:
            return command
        plan = self._links.planned(stage.spec.name, command.task_id)
        if plan is None:  # the task's first send: every rank's view and the busy GPUs, once
            views = {
                r: self._rank_view(stage.spec, r, hello.relay_peers)
                for r, hello in stage.hellos.items()
                if Capability.MULTI_PATH in hello.capabilities
            }
            busy = {
                self._rank_view(other.spec, r).own_gpu
                for other in self._stages.values()
                if other is not stage and other.core.task_id is not None
                for r in range(other.spec.ranks)
            }
            plan = self._links.plan(stage.spec.name, command.task_id, views, busy)
        links = plan.links.get(rank)
        return msgspec.structs.replace(command, links=links) if links else command

    def _rank_view(self, spec: StageSpec, rank: int, relay_peers: tuple[int, ...] = ()) -> RankView:
        return rank_view(spec.devices[rank] if spec.devices else None, self._engine_visible, spec.device, relay_peers)

    def _resolve(self, stage: _Stage, outcome: TaskOutcome | None) -> None:
        if outcome is None:
            return
        name = stage.spec.name
        if outcome.command == "Profile" and (outcome.ok or outcome.refused):
            # The core just recorded the task under its signature ("Profile", start, prefix).
            (_, start, _), _ = stage.core.completed.get(outcome.task_id)  # type: ignore[misc]
            report = ProfileReport.from_outcome(name, outcome, start)
            result, error = (
                (report, None)
                if outcome.ok
                else (
                    None,
                    ProfileRefusedError(
                        name, f"{outcome.error}; the stage stays {outcome.state.value}", outcome.refusals, report
                    ),
                )
            )
        elif outcome.ok:
            result: Any = LifecycleReport.from_outcome(name, outcome, stage.core.weights_version)
            error: BaseException | None = None
        elif outcome.command in ("InitWeightGroup", "ShareWeights") and outcome.refused:
            result, error = None, InvalidArgumentError(f"{outcome.error}; the stage stays {outcome.state.value}")
        elif outcome.command == "UpdateWeights" and outcome.state is StageState.NEEDS_RELOAD and not outcome.refused:
            result, error = (
                None,
                WeightUpdateFailedError(name, outcome.error, stage.core.weights_version, outcome.failures),
            )
        elif outcome.refused and outcome.command == "Wake":
            result, error = (
                None,
                NoMemoryError(
                    name,
                    f"stage {name!r}: {outcome.error}; the stage stays "
                    f"{outcome.state.value}. To fix: free what the holders keep "
                    "(put that stage to sleep: `omni-core sleep STAGE`, "
                    "Engine.sleep; or end that process), then wake it again",
                    outcome.refusals,
                ),
            )
        elif outcome.refused:
            result, error = (
                None,
                InvalidArgumentError(f"stage {name!r}: {outcome.error}; the stage stays {outcome.state.value}"),
            )
        elif outcome.state is StageState.FAILED:
            result, error = None, StageFailedError(name, outcome.error, outcome.failures, _nodes(stage))
        else:
            result, error = None, TaskAbandonedError(outcome.error)
        for future in stage.waiters.pop(outcome.task_id, []):
            _settle(future, result=result, error=error)

    def _answer(self, stage: _Stage, answer: RequestOutcome) -> None:
        future = stage.requests.pop(answer.request_id, None)
        versioned = answer.request_id in stage.versioned
        stage.versioned.discard(answer.request_id)
        if future is None:
            return
        if answer.error is None:
            _settle(future, result=ExecuteResult(answer.output, answer.weights_version) if versioned else answer.output)
        else:
            _settle(future, error=_REQUEST_ERRORS[answer.error](answer.detail))

    def _started(self, stage: _Stage, state: StageState) -> None:
        core = stage.core
        error = (
            None
            if state is StageState.RUNNING
            else StageFailedError(
                stage.spec.name,
                core.failure or f"stage {stage.spec.name!r} is {state.value}",
                core.failed_ranks,
                _nodes(stage),
            )
        )
        for future in stage.start_waiters:
            _settle(future, error=error)
        stage.start_waiters.clear()

    def _send(self, stage: _Stage, rank: int, command: Command, data: bytes | None = None) -> bool:
        """Queue one command (`data`: its encoding, when the caller has it) for a rank; False
        when it could not be (counted)."""
        proc = stage.procs[rank] if rank < len(stage.procs) else None
        if proc is None or proc.identity is None:
            self.counters["send_failures"] += 1  # the deadline names this rank (P-9)
            return False
        try:
            self._router.send_multipart([proc.identity, encode(command) if data is None else data], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            self.counters["send_failures"] += 1
            return False
        return True

    # ================================================================ processes

    def _spawn(self, stage: _Stage) -> None:
        stage.procs = self._launcher.spawn(
            stage.spec, epoch=stage.core.epoch, address=self.address, trace_path=self.trace_path, curve=self._curve
        )
        for proc in stage.procs:
            if proc.sentinel is not None:
                self._sentinels[proc.sentinel] = (stage, proc)
                self._poller.register(proc.sentinel, zmq.POLLIN)
            self._write(stage, (RankSpawned(proc.rank, proc.pid, proc.node),))

    def _reap(self, stage: _Stage) -> None:
        stage.reported.clear()
        self._launcher.reap(stage.procs)
        stage.hellos.clear()
        self._links.release(stage.spec.name)
        for proc in stage.procs:
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
            self._reap(stage)
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
        with contextlib.suppress(Exception):  # the launcher's own resources; the ranks are reaped
            self._launcher.close()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
