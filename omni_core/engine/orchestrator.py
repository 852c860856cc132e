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
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any, overload

import zmq

from omni_core.engine.binding import choose_binding
from omni_core.engine.calls import (
    EngineCall,
    LifecycleCall,
    ReportCall,
    ShutdownCall,
    StageCall,
    StatusQuery,
    SwapRequest,
    check_request,
)
from omni_core.engine.errors import (
    EngineClosedError,
    InvalidArgumentError,
    RestartInProgressError,
)
from omni_core.engine.incoming import incoming_bytes, stage_devices
from omni_core.engine.launch import LocalLauncher, RankHandle, RankLauncher
from omni_core.engine.link_plan import LinkLedger
from omni_core.engine.loop_io import LoopIO
from omni_core.engine.native_heap import NativeHeap
from omni_core.engine.outcomes import request_error, start_error, start_report, task_answer
from omni_core.engine.report import ExecuteResult, LifecycleReport, ProfileReport, RestartReport
from omni_core.engine.spec import StageSpec
from omni_core.engine.stage_slot import StageSlot, settle
from omni_core.engine.swaps import Swaps
from omni_core.fsm import InvariantViolation, StageCommandError, StageStep, TaskOutcome
from omni_core.fsm import inputs as I
from omni_core.fsm.inputs import RequestOutcome
from omni_core.fsm.trace_records import PeerRefused, RankSpawned, TraceRecord, clip
from omni_core.isolation import FrameErrors
from omni_core.protocol import (
    Ack,
    Capability,
    Command,
    Hello,
    Nack,
    ProtocolError,
    Reply,
    Shutdown,
    StageState,
    decode,
    encode,
)
from omni_core.protocol.auth import verify_hello_proof
from omni_core.trace import open_trace

log = logging.getLogger("omni_core.engine")

POLL_INTERVAL_S = 0.05  # upper bound on deadline lateness
TICK_INTERVAL_S = 0.01  # deadlines are checked at most this often
# Frames read per loop turn before calls and deadlines are served again: a peer that floods
# the ROUTER (junk from any local user over tcp without CURVE) delays a call by one batch,
# a few milliseconds, instead of for as long as the flood lasts. The ROUTER queues inbound
# frames fairly across peers, so a rank's reply is never stuck behind a flooder's backlog.
MAX_FRAMES_PER_TURN = 256


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
        binding = choose_binding(self._launcher, transport, host, curve)
        self.trace_path = trace_path
        self._trace = open_trace(trace_path)
        self._stages = {s.name: StageSlot.of(s) for s in specs}
        self.max_frame_bytes = max(s.max_frame_bytes for s in specs)
        self._io = LoopIO(binding, self.max_frame_bytes)
        self._curve = self._io.curve
        self.address = self._io.address
        self._by_identity: dict[bytes, tuple[StageSlot, int]] = {}
        self._sentinels: dict[int, tuple[StageSlot, RankHandle]] = {}
        # Each call with its caller's future, of the answer type `submit` names for that call.
        self._calls: queue.SimpleQueue[tuple[str | None, StageCall | EngineCall, Future[Any]]] = queue.SimpleQueue()
        self._next_tick_at = 0.0
        self._request_ids = itertools.count(1)
        self._closing: Future[None] | None = None
        self._closing_deadline_at = 0.0
        self._closed = threading.Event()
        self._links = LinkLedger()
        self._engine_visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        self._swaps = Swaps(
            self._lifecycle, self._incoming_of, lambda name, record: self._write(self.stage(name), (record,))
        )
        self.native_heap = NativeHeap(now_s=time.monotonic())  # arenas capped before the loop's threads
        # What strangers and faulty peers tried; each attempt is counted, none changes anything.
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

    # What each call's future holds once the loop answered it (`_dispatch` and the settles).
    @overload
    def submit(self, stage: str | None, call: I.Submit) -> Future[ExecuteResult]: ...
    @overload
    def submit(self, stage: str | None, call: I.Start | I.Restart) -> Future[RestartReport]: ...
    @overload
    def submit(self, stage: str | None, call: ReportCall) -> Future[LifecycleReport]: ...
    @overload
    def submit(self, stage: str | None, call: I.ProfileCall) -> Future[ProfileReport]: ...
    @overload
    def submit(self, stage: str | None, call: LifecycleCall) -> Future[LifecycleReport | ProfileReport]: ...
    @overload
    def submit(self, stage: str | None, call: StatusQuery) -> Future[dict[str, Any]]: ...
    @overload
    def submit(self, stage: str | None, call: I.SetAdmission | ShutdownCall | SwapRequest) -> Future[None]: ...
    def submit(self, stage: str | None, call: StageCall | EngineCall) -> Future[Any]:
        """Queue `call` (for `stage`, when it is one stage's input) for the loop thread; the
        future holds its answer, or the error that refused it."""
        future: Future[Any] = Future()
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
        self._calls.put((stage, call, future))
        self._io.wake()
        return future

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def join(self, timeout_s: float) -> None:
        """Wait for the loop thread to end (after a ShutdownCall)."""
        self._thread.join(timeout_s)

    def stage(self, name: str | None) -> StageSlot:
        """The slot of stage `name`; None (a stage call queued without its stage) is unknown too."""
        slot = None if name is None else self._stages.get(name)
        if slot is None:
            raise InvalidArgumentError(f"unknown stage {name!r}; stages are {sorted(self._stages)}")
        return slot

    def new_task_id(self, kind: str, stage: str) -> str:
        return f"{kind}-{stage}-{uuid.uuid4().hex[:12]}"

    def new_request_id(self, stage: str) -> str:
        return f"req-{stage}-{next(self._request_ids)}"

    # ---------------------------------------------------------------- calls (loop thread)

    def _run_calls(self) -> None:
        while True:
            try:
                name, call, future = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                self._dispatch(name, call, future)
            except StageCommandError as exc:
                settle(future, error=InvalidArgumentError(str(exc)))
            except InvariantViolation:
                raise  # a core left in a state its invariants forbid: the loop dies loudly (_die)
            except BaseException as exc:  # the loop must survive a bad call
                settle(future, error=exc)

    def _dispatch(self, name: str | None, call: StageCall | EngineCall, future: Future[Any]) -> None:
        match call:
            case StatusQuery():
                future.set_result(self._status())
            case ShutdownCall(timeout_s=timeout_s):
                self._shutdown(future, timeout_s)
            case SwapRequest():
                self._swap(future, call)
            case I.Start():
                stage = self.stage(name)
                self._spawn(stage)
                stage.start_waiters.append(future)
                self._step(stage, call)
            case I.Restart():
                self._restart(future, self.stage(name), call)
            case I.Submit():
                self._execute(future, self.stage(name), call)
            case I.SetAdmission():
                self._step(self.stage(name), call)
                future.set_result(None)
            case _ if isinstance(call, LifecycleCall):  # the one list: engine/calls.py
                self._lifecycle(future, name, call)
            case _:  # pragma: no cover - the Engine queues only the calls above
                raise TypeError(f"the orchestrator has no handler for {call!r}")

    def _execute(self, future: Future[ExecuteResult], stage: StageSlot, submit: I.Submit) -> None:
        # Refused here, whole: a rank cannot name the task of a frame it refuses unread, so an
        # oversized request sent on would only end at its deadline.
        check_request(stage.spec, submit, stage.core.epoch)
        stage.requests[submit.request_id] = future
        self._step(stage, submit)

    def _lifecycle(self, future: Future[Any], name: str | None, event: LifecycleCall) -> None:
        stage = self.stage(name)
        stage.waiters.setdefault(event.task_id, []).append(future)
        try:
            self._step(stage, event)
        except BaseException:
            stage.waiters[event.task_id].remove(future)
            if not stage.waiters[event.task_id]:
                del stage.waiters[event.task_id]
            raise

    def _swap(self, future: Future[None], request: SwapRequest) -> None:
        self.stage(request.out_name)
        in_spec = self.stage(request.in_name).spec
        waits = request.wake.memory_wait_s > 0  # a wake that waits holds its devices until it ends
        self._swaps.offer(future, request, stage_devices(in_spec, self._engine_visible) if waits else frozenset())

    def _incoming_of(self, out_name: str, in_name: str) -> dict[int, int]:
        """Sleep.incoming_bytes per rank of `out_name` (those declaring the swap capability)."""
        out, into = self.stage(out_name), self.stage(in_name)
        per_rank = incoming_bytes(out.spec, into.spec, into.asleep_bytes(), self._engine_visible)
        return {r: n for r, n in per_rank.items() if out.declares(r, Capability.SWAP)}

    def _restart(self, future: Future[RestartReport], stage: StageSlot, restart: I.Restart) -> None:
        name = stage.spec.name
        if stage.core.task_id is not None:
            raise InvalidArgumentError(
                f"stage {name!r} cannot restart while task {stage.core.task_id!r} is in flight; wait for it to end"
            )
        # The core decides first: a refused restart leaves the ranks of the one in progress
        # alone (reaping them first killed that restart's fresh ranks).
        try:
            self._step(stage, restart)
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

    def _status(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: stage.status(self._swaps.waiting(name)) for name, stage in self._stages.items()}
        out["_engine"] = dict(
            self.counters,
            curve_refused=self._io.curve_gate.refused if self._io.curve_gate else 0,
            **self.frame_errors.as_counters(),
        )
        return out

    def _shutdown(self, future: Future[None], timeout_s: float) -> None:
        if self._closing is not None:
            self._closing.add_done_callback(lambda f: settle(future, result=None))
            return
        self._closing = future
        self._closing_deadline_at = time.monotonic() + timeout_s
        self._swaps.drain(EngineClosedError("the engine shut down before this swap could start"))
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
            ready = self._io.poll(int(POLL_INTERVAL_S * 1000))
            self._run_calls()
            if self._io.router in ready:
                self._receive_all()
            for fd in [fd for fd in ready if fd in self._sentinels]:
                self._isolated("a rank's exit", self._on_sentinel, fd)
            now = time.monotonic()
            if now >= self._next_tick_at:  # deadlines need ms, not a scan per message
                self._next_tick_at = now + TICK_INTERVAL_S
                for stage in self._stages.values():
                    self._isolated(f"the deadline tick of stage {stage.spec.name!r}", self._tick, stage)
            self._swaps.advance()
            self.native_heap.tick(now)
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
        self._swaps.drain(error)
        for stage in self._stages.values():
            stage.fail_callers(error)
            with contextlib.suppress(Exception):
                self._launcher.reap(stage.procs)
        if self._closing is not None:
            settle(self._closing, result=None)

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

    def _receive_all(self) -> int:
        """Handle what the ROUTER holds, at most MAX_FRAMES_PER_TURN messages; the rest wait
        for the next turn (the socket stays readable, so that turn's poll returns at once).
        Returns how many were read."""
        for count in range(MAX_FRAMES_PER_TURN):
            try:
                frames = self._io.router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return count
            except zmq.ZMQError as exc:
                self.frame_errors.record(exc, "receiving a frame")
                return count
            if len(frames) != 2:
                self.counters["bad_replies"] += 1
                continue
            self._isolated("a frame from a peer", self._on_frames, frames[0], frames[1])
        return MAX_FRAMES_PER_TURN

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
        if where is None or not isinstance(message, Reply):  # a Command (Message is one or the other)
            self.counters["unknown_peers"] += 1
            return
        stage, rank = where
        if message.rank != rank:  # a rank speaks only for itself: the socket names it, not the body
            self.counters["rank_mismatch"] += 1
            self._write(stage, (PeerRefused("rank_mismatch", rank, f"claimed rank {message.rank}"),))
            return
        if isinstance(message, (Ack, Nack)):
            stage.reported[rank] = message.state
        if isinstance(message, Ack):
            stage.adapters.observe(message, stage.core.epoch)
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
        self._io.unwatch(fd)
        proc.close_sentinel()
        proc.join(0.5)
        self._on_rank_exit(stage, proc)

    def _on_rank_exit(self, stage: StageSlot, proc: RankHandle) -> None:
        if proc.exit_handled:
            return
        proc.exit_handled = True
        if proc.expected_exit:
            return
        detail = proc.exit_cause()
        self._step(stage, I.RankExited(proc.rank, detail, proc.epoch))

    def _tick(self, stage: StageSlot) -> None:
        for proc in stage.procs:  # platforms without pidfd: notice deaths by polling
            if proc.sentinel is None and not proc.exit_handled and not proc.is_alive():
                self._on_rank_exit(stage, proc)
        self._step(stage, I.Tick())

    # ================================================================ stepping the core

    def _step(self, stage: StageSlot, event: I.EngineInput) -> None:
        """One input into the stage's core, then do what its step says (its records first:
        each is written before what it describes leaves)."""
        step = stage.core.step(event, time.monotonic())
        self._write(stage, step.records)
        self._apply(stage, step)

    def _write(self, stage: StageSlot, records: tuple[TraceRecord, ...]) -> None:
        if self._trace.enabled:
            self._trace.write(records, stage=stage.spec.name, epoch=stage.core.epoch)

    def _apply(self, stage: StageSlot, step: StageStep) -> None:
        unsent: dict[str, list[int]] = {}
        # One encode per command, not per rank (a payload may be large); a command given a
        # rank's own fields (links, incoming bytes) is encoded on its own: ids of the step's
        # commands are stable while it runs, those of per-rank copies are not.
        encoded: dict[int, bytes] = {}
        for out in step.sends:
            command = stage.with_links(self._links, self._stages.values(), out.rank, out.command, self._engine_visible)
            command = self._swaps.with_incoming(stage.spec.name, out.rank, command)
            planned = stage.link_record(out.rank, command, self._engine_visible) if self._trace.enabled else None
            if planned is not None:  # the plan is decided here, after the core traced the send
                self._write(stage, (planned,))
            data = encoded.get(id(command)) if command is out.command else None
            if data is None:
                data = encode(command)
                if command is out.command:
                    encoded[id(command)] = data
            if not self._send(stage, out.rank, command, data):
                unsent.setdefault(command.task_id, []).append(out.rank)
        if step.outcome is not None:
            self._links.release(stage.spec.name, step.outcome.task_id)
            self._swaps.ended(stage.spec.name, step.outcome.task_id)
        self._resolve(stage, step.outcome)
        for answer in step.requests:
            self._answer(stage, answer)
        if step.started is not None:
            self._started(stage, step.started)
        for task_id, ranks in unsent.items():
            self._step(stage, I.SendFailed(task_id, tuple(ranks)))

    def _resolve(self, stage: StageSlot, outcome: TaskOutcome | None) -> None:
        if outcome is None:
            return
        result, error = task_answer(stage, outcome)
        for future in stage.waiters.pop(outcome.task_id, []):
            settle(future, result=result, error=error)

    def _answer(self, stage: StageSlot, answer: RequestOutcome) -> None:
        future = stage.requests.pop(answer.request_id, None)
        if future is None:
            return
        if answer.error is None:
            settle(
                future,
                result=ExecuteResult(
                    answer.output,
                    answer.weights_version,
                    answer.adapter,
                    answer.adapter_version,
                    answer.version_spans,
                    answer.discarded_tokens,
                ),
            )
        else:
            settle(future, error=request_error(answer))

    def _started(self, stage: StageSlot, state: StageState) -> None:
        error = start_error(stage, state)
        report = None if error else start_report(stage)
        if report is not None and (report.version_floor or report.version_reset_from is not None):
            log.warning("%s", report.detail)  # the operator's log: the version did not come back
        for future in stage.start_waiters:
            settle(future, result=report, error=error)
        stage.start_waiters.clear()

    def _send(self, stage: StageSlot, rank: int, command: Command, data: bytes | None = None) -> bool:
        """Queue one command (`data`: its encoding, when the caller has it) for a rank; False
        when it could not be (counted)."""
        proc = stage.procs[rank] if rank < len(stage.procs) else None
        if proc is None or proc.identity is None:
            self.counters["send_failures"] += 1  # the deadline names this rank (P-9)
            return False
        try:
            self._io.router.send_multipart([proc.identity, encode(command) if data is None else data], zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            self.counters["send_failures"] += 1
            return False
        return True

    # ================================================================ processes

    def _spawn(self, stage: StageSlot) -> None:
        stage.procs = self._launcher.spawn(
            stage.spec,
            epoch=stage.core.epoch,
            address=self.address,
            trace_path=self.trace_path,
            curve=self._curve,
            weights=stage.core.start_weights,
        )
        for proc in stage.procs:
            if proc.sentinel is not None:
                self._sentinels[proc.sentinel] = (stage, proc)
                self._io.watch(proc.sentinel)
            gpu = stage.rank_view(proc.rank, self._engine_visible).own_gpu
            self._write(stage, (RankSpawned(proc.rank, proc.pid, proc.node, gpu),))

    def _reap(self, stage: StageSlot) -> None:
        stage.reported.clear()
        self._launcher.reap(stage.procs)
        stage.hellos.clear()
        self._links.release(stage.spec.name)
        for proc in stage.procs:
            if proc.identity is not None:
                self._by_identity.pop(proc.identity, None)
            if proc.sentinel is not None and self._sentinels.pop(proc.sentinel, None) is not None:
                self._io.unwatch(proc.sentinel)
            proc.close_sentinel()

    def _finish_close(self) -> bool:
        procs = [p for s in self._stages.values() for p in s.procs]
        if any(p.is_alive() for p in procs) and time.monotonic() < self._closing_deadline_at:
            return False
        for stage in self._stages.values():
            self._reap(stage)
        assert self._closing is not None
        settle(self._closing, result=None)
        return True

    def _close_resources(self) -> None:
        self._closed.set()
        while True:  # settle calls that raced the shutdown
            try:
                _, _, future = self._calls.get_nowait()
            except queue.Empty:
                break
            settle(future, error=EngineClosedError("the engine shut down before this call ran"))
        self._io.close()
        self._trace.close()
        with contextlib.suppress(Exception):  # the launcher's own resources; the ranks are reaped
            self._launcher.close()
