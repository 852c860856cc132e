"""The worker process: a thin shell around `WorkerCore`.

Start-up selects the memory backend, loads the runner into its tagged pools and sends
Hello. Then the loop: receive bytes, decode (bad bytes -> NACK BAD_MESSAGE, keep going),
hand the command to the core, perform the one effect it returns through the backend or
the runner, and send the core's replies. Every decision about legality, idempotence and
fencing is the core's; this module only does the IO and the memory operations. Whatever
one frame's handling raises is caught around that frame (`handle_isolated`,
omni_core.isolation): counted, and the frame's task answered, never the loop's end.

An exception in a lifecycle effect moves the worker to FAILED; the core then answers
every later command with the reason until Shutdown. A failed start-up (backend missing,
runner not importable, out of memory while loading) is reported the same way: a Hello
with state FAILED, then NACK FAILED naming the cause, so the orchestrator learns *why*
instead of waiting for a Hello that never comes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import zmq

from omni_core.fsm import WEIGHTS_TAG, InvariantViolation, WorkerCore
from omni_core.fsm.effects import (
    AdapterEffect,
    CommandEffect,
    Effect,
    ExecuteEffect,
    HoldEffect,
    ProfileEffect,
    ReloadEffect,
    ShareEffect,
    ShutdownEffect,
    SleepEffect,
    StatusEffect,
    UpdateEffect,
    WakeEffect,
    WeightGroupEffect,
)
from omni_core.fsm.tags import CUDA_GRAPH_TAG
from omni_core.fsm.trace_records import ParentGone, WorkerRecord
from omni_core.fsm.worker import (
    HELLO_TASK_ID,
    BadFrame,
    CommandReceived,
    EffectCompleted,
    EffectDeclined,
    EffectRaised,
    Loaded,
    LoadFailed,
    WorkerStep,
)
from omni_core.fsm.worker_table import WORKER_CALLS
from omni_core.isolation import FrameErrors, cause_of
from omni_core.log_format import LOG_FORMAT_ENV, formatter_for
from omni_core.protocol import (
    MAX_DETAIL_CHARS,
    MAX_LINKS,
    MAX_LOADED_WEIGHTS,
    AddAdapter,
    Capability,
    Command,
    Execute,
    Hello,
    HoldRequests,
    MemoryReport,
    Message,
    NackReason,
    PinAdapter,
    ProtocolError,
    RemoveAdapter,
    ResetPrefixCache,
    SaveWeights,
    Status,
    TransferIn,
    TransferOut,
    TransferRelease,
    decode_command,
    encode,
)
from omni_core.protocol.auth import RANK_SECRET_ENV, hello_proof
from omni_core.protocol.codec import envelope_of
from omni_core.protocol.messages import MAX_WEIGHT_NAME_CHARS
from omni_core.runners.base import (
    ModelRunner,
    RunnerArgumentError,
    drop_derived_caches,
    load_runner,
    refuse_kept_caches,
)
from omni_core.trace import NULL_TRACE, open_trace
from omni_core.transport import curve_client_keys, make_dealer
from omni_core.weights_sender import WeightSender
from omni_core.workers.accounting import MemoryFigure, ProcessMemory
from omni_core.workers.backends import MemoryBackend, select_backend
from omni_core.workers.config import WorkerConfig
from omni_core.workers.continuous import Finished, RunningRequests
from omni_core.workers.device_ledger import one_incoming_wake
from omni_core.workers.device_memory import CudaFreeMemory, FreeMemorySource
from omni_core.workers.host_refit import host_refit_ready, refit_into_host
from omni_core.workers.memory_gate import MemoryGate, WakeRefused, room_for
from omni_core.workers.parent_watch import set_death_signal, watch_parent
from omni_core.workers.profiler import TraceProfiler, default_profile_dir
from omni_core.workers.rank_memory import (
    cache_budget,
    check_budget,
    free_memory_source,
    ledger_directory,
    resolve_device,
)
from omni_core.workers.results import checked_output
from omni_core.workers.runner_counters import CounterStamp
from omni_core.workers.saved_weights import (
    Reloaded,
    SavedRank,
    check_saved_version,
    rank_source,
    save_rank,
    saved_version,
)
from omni_core.workers.transfers import close_transfers, drop_landed, transfer_in, transfer_out, transfer_release
from omni_core.workers.weight_receiver import WeightReceiver

log = logging.getLogger("omni_core.worker")

# Time given to zmq to deliver the last replies (the Shutdown Ack) before the socket closes.
FINAL_FLUSH_MS = 2000
# Frames handled between two steps of running requests: a flood cannot starve them.
STEP_FRAMES_MAX = 64
# Failure texts travel in every later reply; keep them well under the protocol's 4096.
MAX_ERROR_CHARS = 2000
EXIT_OK = 0
EXIT_SHUTDOWN_ERROR = 1
EXIT_PARENT_GONE = 3


class AdapterRefused(RunnerArgumentError):
    """The runner refused an AddAdapter's source before anything was loaded or evicted."""


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 3] + "..."


class WorkerProcess:
    """One rank: backend, runner, core and socket. `start()` then `serve()`."""

    def __init__(
        self, config: WorkerConfig, sock: zmq.Socket, *, identity: bytes = b"", rank_secret: bytes | None = None
    ) -> None:
        self.config = config
        self.sock = sock
        self.identity = identity
        self.rank_secret = rank_secret
        self.trace = open_trace(config.trace_path, stage=config.stage, rank=config.rank, epoch=config.epoch)
        self.device = torch.device("cpu")
        self.backend: MemoryBackend | None = None
        self.runner: ModelRunner | None = None
        self.memory: ProcessMemory | None = None
        self.free_memory: FreeMemorySource | None = None  # what a wake's memory gate asks
        self.core: WorkerCore | None = None
        self.receiver = WeightReceiver(torch.device("cpu"), config.rank)  # on the rank's device once resolved
        self.sender: WeightSender | None = None  # this rank's shared weights (ShareWeights), until the next
        self.profiler = TraceProfiler(
            config.profile_dir or default_profile_dir(), config.stage, config.rank, max_duration_s=config.profile_max_s
        )
        self.stopped = False
        self.exit_code = EXIT_OK
        # What the loop caught while handling frames, by cause (omni_core.isolation).
        self.frame_errors = FrameErrors(f"worker {config.stage}/{config.rank}", log)
        self._answered: set[str] | None = None  # task_ids this frame answered, while handling one
        # Requests the core took and the runner has not run yet: the serve loop gathers the
        # Executes waiting on the socket and hands them to the runner together (`_run_batch`).
        self._batch: list[ExecuteEffect] = []
        self._gather = False  # set by `serve`: outside its loop every request runs at once
        # Continuous batching, where the runner has it: the requests it holds between steps,
        # and whether the loop stepping them is on the stack (`_step_while_running`).
        self._running: RunningRequests | None = None
        self._stepping = False
        self._took: str | None = None  # the task whose effect the frame being handled started
        self.counters = CounterStamp(None, "")  # the runner's counters on its replies, once loaded

    # ------------------------------------------------------------------ start-up

    def start(self) -> None:
        cfg = self.config
        backend_name = cfg.backend
        capabilities: tuple[Capability, ...] = ()
        error = ""
        try:
            self.device = resolve_device(cfg.device)
            self.profiler.device_type = self.device.type  # CUDA activity only on a CUDA rank
            self.backend = select_backend(cfg.backend, self.device)
            backend_name = self.backend.name
            # Every rank of ours can profile (TraceProfiler): declared for the conformance suite.
            capabilities = (*self.backend.capabilities, Capability.PROFILE)
            if self.backend.supports_memory_gate:  # its wake waits for memory and rolls back (P-16)
                capabilities = (*capabilities, Capability.SWAP)
        except Exception as exc:
            error = _error_text(exc)
            log.error("worker %s/%s: backend %r unavailable: %s", cfg.stage, cfg.rank, cfg.backend, error)
        self.core = WorkerCore(
            cfg.rank,
            tags=cfg.tags,
            epoch=cfg.epoch,
            capabilities=capabilities,
            reply_cache_entries=cfg.reply_cache_entries,
            reply_cache_bytes=cfg.reply_cache_bytes,
            weights_version=cfg.start_version,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
            max_in_flight=cfg.batch_max_requests,
        )
        if not error:
            try:
                self._load()
            except Exception as exc:
                error = _error_text(exc)
                log.error("worker %s/%s: loading failed:\n%s", cfg.stage, cfg.rank, traceback.format_exc())
        relay_peers: tuple[int, ...] = ()
        if self.backend is not None:  # `auto` decides between fast and cumem at load
            backend_name = self.backend.name
            relay_peers = self.backend.relay_peers()[:MAX_LINKS] if self.backend.supports_links and not error else ()
            if relay_peers:  # declared only now: whether the backend relays is known after load
                capabilities = (*capabilities, Capability.MULTI_PATH)
        if not error and self.runner is not None:
            # P-17: every runner updates from disk (its reload); shm, ipc and collective need the
            # runner's update_weights, else the receiver refuses them (INVALID_ARGUMENT).
            capabilities = (*capabilities, Capability.WEIGHT_UPDATE)
            if self.runner.supports_adapters:
                capabilities = (*capabilities, Capability.ADAPTERS)
            if self.runner.supports_step_mode:
                capabilities = (*capabilities, Capability.STEP_MODE)
            if host_refit_ready(self.backend, self.runner, cfg.tags):
                capabilities = (*capabilities, Capability.HOST_REFIT)
            if self.runner.supports_save_weights:
                capabilities = (*capabilities, Capability.SAVE_WEIGHTS)
            if self.runner.transfer_exports() or self.runner.transfer_imports():  # P-22: a connector
                capabilities = (*capabilities, Capability.TRANSFER)
        self.receiver.device = self.device
        if not error:
            self.counters = CounterStamp(self.runner, f"worker {cfg.stage}/{cfg.rank}")
        # Dummy weights (load_format "dummy") are nothing to serve until an update replaces them.
        dummy = self.runner is not None and self.runner.dummy_weights and cfg.start_source is None
        loaded = Loaded(backend_name, capabilities, needs_reload=cfg.start_needs_reload or dummy)
        started = self.core.step(LoadFailed(error, backend_name) if error else loaded)
        self._write(started.records)
        device = str(self.device)
        if self.memory is not None and self.memory.physical is not None:
            device = f"{device} ({self.memory.physical.uuid})"
        pid = os.getpid()
        proof = (
            ""
            if self.rank_secret is None
            else hello_proof(
                self.rank_secret, stage=cfg.stage, rank=cfg.rank, epoch=cfg.epoch, pid=pid, identity=self.identity
            )
        )
        self._send(
            Hello(
                task_id=HELLO_TASK_ID,
                epoch=cfg.epoch,
                rank=cfg.rank,
                pid=pid,
                stage=cfg.stage,
                proof=proof,
                device=device,
                backend=backend_name,
                backend_reason=self.backend.choice_reason[:MAX_DETAIL_CHARS] if self.backend else "",
                relay_peers=relay_peers,
                tags=cfg.tags,
                capabilities=capabilities,
                state=self.core.state,
                detail=error[:MAX_DETAIL_CHARS],
                weights_version=self.core.weights_version,
                # the Hello's own tags only: a runner may open a pool of another (refused there)
                pool_bytes={} if error else {t: n for t, n in self._usage().items() if t in cfg.tags},
                runner_counters=self.counters.declared,
                loaded_weights=() if error else self._loaded_weights(),
            )
        )

    def _loaded_weights(self) -> tuple[str, ...]:
        """The runner's loaded names for the Hello, sorted; none where they exceed its bounds."""
        assert self.runner is not None
        names = sorted(self.runner.loaded_weights())
        if len(names) > MAX_LOADED_WEIGHTS or any(len(n) > MAX_WEIGHT_NAME_CHARS for n in names):
            log.warning(
                "worker %s/%s: %d loaded weight names exceed the Hello's bound (%d names of %d chars): none sent",
                *self._who(),
                len(names),
                MAX_LOADED_WEIGHTS,
                MAX_WEIGHT_NAME_CHARS,
            )
            return ()
        return tuple(names)

    def _load(self) -> None:
        assert self.backend is not None
        self.memory = ProcessMemory(self.device)
        if self.device.type == "cuda":
            self.memory.set_unmapped_reserved(self.backend.unmapped_reserved_bytes)
        self.runner = load_runner(self.config.runner, self.device, self.config.runner_args)
        fraction = self.config.gpu_memory_fraction if self.device.type == "cuda" else None
        budget = cache_budget(self.memory, fraction)
        # Before loading: the load is reported too.
        self.free_memory = free_memory_source(self.config, self.backend, self.memory, self.device)
        self.runner.load(self.backend.pool, self.config.tags, budget)
        if self.config.start_source is not None:  # a restart at the version this directory holds
            source = rank_source(self.config.start_source, self.config.rank)
            check_saved_version(source, self.config.start_version)
            self.runner.reload_weights(source)
        # Before tracking: a backend that copies read-only tags to the host once does it there.
        self.backend.declare_read_only(
            self.runner.read_only_tags() & set(self.config.tags), verify=self.config.verify_clean_sleep
        )
        held = self.runner.runner_tags()
        for tag in self.config.tags:
            if tag in held:
                continue  # the runner releases and restores it itself
            self.backend.track(tag, self.runner.tensors(tag))
            if tag == CUDA_GRAPH_TAG and tag not in self.backend.tags:
                self.backend.adopt(tag)  # filled by the framework inside the backend's allocator
        if fraction is not None:
            check_budget(self.memory, fraction)
        self._report_to_ledger()
        log.info(
            "worker %s/%s loaded: pools %s, process memory %s",
            self.config.stage,
            self.config.rank,
            self.backend.usage(),
            self._figure(),
        )

    def _wake(self, backend: MemoryBackend, effect: WakeEffect) -> None:
        """A wake that may wait for memory takes its device's incoming lock first: one such
        wake per device at a time, across engines (`device_ledger`); the gate's wait starts
        before it, so the time spent on the lock comes out of memory_wait_s. A wake that does
        not wait takes its chance."""
        gate = self._gate(effect.memory_wait_s)
        directory = ledger_directory(self.free_memory)
        incoming: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
        if directory is not None and effect.memory_wait_s > 0:
            who = f"stage {self.config.stage} rank {self.config.rank}, pid {os.getpid()} (engine pid {os.getppid()})"
            incoming = one_incoming_wake(directory, who, effect.memory_wait_s)
        held = self.runner.runner_tags() if self.runner is not None else frozenset()
        with incoming:
            backend.wake(effect.tags - held, gate, links=effect.links)  # after_wake restores the rest

    def _report_to_ledger(self) -> None:
        """The rank's resident bytes in its GPU's node ledger, after each effect and the load."""
        if isinstance(self.free_memory, CudaFreeMemory) and self.backend is not None:
            self.free_memory.report(sum(self.backend.usage().values()))

    def _gate(self, memory_wait_s: float) -> MemoryGate | None:
        """A gate for one wake (its wait starts now), when there is device memory to wait for."""
        if self.free_memory is None or self.backend is None or not self.backend.supports_memory_gate:
            return None
        return MemoryGate(
            self.free_memory,
            memory_wait_s=memory_wait_s,
            what=f"stage {self.config.stage} rank {self.config.rank}",
        )

    # ------------------------------------------------------------------ loop

    def serve(self, parent_pid: int) -> int:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        parent = parent_pid
        interval_ms = max(1, int(self.config.parent_check_interval_s * 1000))
        while not self.stopped:
            self.profiler.poll()  # cut a profile past profile_max_s, even on a loop with traffic
            if not poller.poll(interval_ms):
                if self.config.exit_with_parent and os.getppid() != parent:
                    log.error(
                        "worker %s/%s: parent process %d is gone; releasing pools and exiting",
                        self.config.stage,
                        self.config.rank,
                        parent,
                    )
                    self._write((ParentGone(parent),))
                    self._release()
                    return EXIT_PARENT_GONE
                continue
            self._gather = True
            try:
                self._serve_ready()
            finally:
                self._gather = False
        return self.exit_code

    def _serve_ready(self) -> None:
        """Every frame waiting now: the Executes among them join one batch (up to the core's
        max_in_flight), which runs once the socket has no frame left or a command that is no
        request comes (the core never lets one run beside a batch)."""
        flags = 0
        while (frame := self._receive(flags)) is not None:
            self.handle_isolated(frame)
            if not self._batch or self.stopped:
                break
            flags = zmq.NOBLOCK
        self._run_batch()
        running = self._running
        if running is not None and len(running) and not self._stepping:  # joined by _send_all
            self._step_while_running(running)

    def _receive(self, flags: int) -> memoryview | None:
        """The next frame's payload, or None when none is waiting (NOBLOCK) or receiving failed."""
        try:
            frames = self.sock.recv_multipart(flags, copy=False)
        except zmq.Again:
            return None
        except zmq.ZMQError as exc:
            self.frame_errors.record(exc, "receiving a frame")
            return None
        # A DEALER receives [payload]; tolerate a REQ-style empty delimiter before it.
        return frames[-1].buffer

    def handle_isolated(self, data: bytes | memoryview) -> None:
        """`handle` one frame; whatever it raises ends here (omni_core.isolation): counted by
        cause, logged at a bounded rate, and the frame's task answered with a NACK naming the
        cause unless this frame already answered it. Only a violated invariant of the core
        ends the loop: the process exits with it, and the engine names the dead rank."""
        core = self.core
        assert core is not None
        self._answered = set()
        self._took = None
        try:
            self.handle(data)
        except InvariantViolation:
            log.critical(
                "worker %s/%s: the worker core violated its invariants; exiting",
                self.config.stage,
                self.config.rank,
                exc_info=True,
            )
            raise
        except Exception as exc:
            self.frame_errors.record(exc, f"a frame of {len(data)} bytes")
            self._answer_failed_frame(data, exc, took=self._took)
        finally:
            self._answered = None
            self._took = None

    def _answer_failed_frame(self, data: bytes | memoryview, exc: Exception, *, took: str | None) -> None:
        """After a frame's handling raised, its task still gets its one reply (P-1), now rather
        than at the stage's deadline: the command's effect failed when the core had taken it
        on (EXECUTE_ERROR for a request, BACKEND_ERROR and FAILED for a lifecycle command, as
        any failed effect), else NACK BAD_MESSAGE. Nothing when this frame answered already."""
        core = self.core
        assert core is not None and self._answered is not None
        cause = f"{cause_of(exc)}: {str(exc)[:300]}"
        try:
            task_id, epoch = envelope_of(data)
            if task_id is not None and task_id in self._answered:
                return
            if took is not None and took in core.in_progress:  # taken on, never to be performed now
                self._batch = [effect for effect in self._batch if effect.task_id != took]
                step = core.step(EffectRaised(took, f"the worker failed while handling it ({cause})"))
            else:
                error = ProtocolError(
                    f"this worker could not handle the frame ({cause}); it was dropped and the worker serves on: "
                    "check the sender, or report a bug with the worker's log",
                    task_id=task_id,
                    epoch=epoch,
                )
                step = core.step(BadFrame(error))
            self._send_all(step)
        except InvariantViolation:
            raise
        except Exception as again:  # the socket itself failing: counted, the loop goes on
            self.frame_errors.record(again, "answering a frame whose handling failed")

    def handle(self, data: bytes | memoryview) -> None:
        core = self.core
        assert core is not None
        try:
            command = decode_command(data, max_frame_bytes=self.config.max_frame_bytes)
        except ProtocolError as err:
            self._send_all(core.step(BadFrame(err)))
            return
        held = len(self._batch) + (len(self._running) if self._running is not None else 0)
        if held and self._holds(command):
            self._start_batch()  # a hold freezes the gathered requests too, before any step
        elif (
            held
            and not isinstance(command, Status)
            and (not isinstance(command, Execute) or held >= core.max_in_flight)
        ):
            # First: the core refuses anything else beside a running batch, and more requests
            # than its bound. A command waits for every request; a request for one to finish.
            # A Status does not wait: the core answers it beside the requests, from what it knows.
            self._run_batch()
            self._finish_running(below=core.max_in_flight if isinstance(command, Execute) else 1)
        step = core.step(CommandReceived(command))
        if step.effect is not None:
            self._took = step.effect.task_id
        self._send_all(step)
        if isinstance(step.effect, ExecuteEffect):
            self._batch.append(step.effect)
            if not self._gather:
                self._run_batch()
        elif step.effect is not None:
            self._perform(step.effect)
        if isinstance(command, HoldRequests):
            self._after_hold()

    def _holds(self, command: Command) -> bool:
        """Whether the core, not the shell, decides on `command` beside the running requests:
        while they are held (pause keep), or a hold a runner that can freeze them takes. A
        runner that cannot has them finished first, so its hold holds nothing (mode wait)."""
        assert self.core is not None
        if self.core.holding:
            return True
        return isinstance(command, HoldRequests) and self.runner is not None and self.runner.supports_hold()

    def _start_batch(self) -> None:
        """The gathered requests join the running set without a step (a hold comes next)."""
        batch, self._batch = self._batch, []
        running = self._continuous()
        if running is None:  # pragma: no cover - _holds asks a runner that holds: a continuous one
            self._batch = batch
            return
        for effect in batch:
            if effect.adapter is not None:
                self._answer_request(effect, self._execute_adapter(effect), 0.0)
            elif (refused := running.start(effect)) is not None:
                self._answer_finished([refused])

    def _after_hold(self) -> None:
        """After a hold or a release: drop what the core answered itself, and once released,
        step the requests again (unless that loop is on the stack: it goes on by itself)."""
        core, running = self.core, self._running
        if core is None or running is None:
            return
        running.forget(set(core.in_progress))
        if len(running) and not core.holding and not self._stepping:
            self._step_while_running(running)

    def _run_batch(self) -> None:
        """Run the gathered requests through the runner together, then answer each: its
        output, or its own error (a raise of the whole batch is every request's error). The
        rank stays ACTIVE either way: a request says nothing about the memory. Whatever
        raises here is counted and every request still unanswered gets its error (P-1)."""
        batch, self._batch = self._batch, []
        if not batch:
            return
        running = self._continuous()
        if running is not None:
            self._start_running(running, batch)
            return
        try:
            started = time.perf_counter()
            outputs = self._execute_batch(batch)
            duration_s = time.perf_counter() - started
            for effect, output in zip(batch, outputs, strict=True):
                self._answer_request(effect, output, duration_s)
            self._report_to_ledger()
        except InvariantViolation:
            raise
        except Exception as exc:
            self.frame_errors.record(exc, f"a batch of {len(batch)} requests")
            self._answer_finished([Finished(effect, exc, 0.0) for effect in batch])

    def _continuous(self) -> RunningRequests | None:
        if self._running is None and self.runner is not None and self.runner.supports_continuous():
            self._running = RunningRequests(self.runner)
        return self._running

    def _start_running(self, running: RunningRequests, batch: list[ExecuteEffect]) -> None:
        """Hand the gathered requests to the runner's running set (a request naming an adapter
        runs on its own, as in a batch), then, unless that loop is on the stack already,
        step them until none runs."""
        for effect in batch:
            if effect.adapter is not None:
                self._answer_request(effect, self._execute_adapter(effect), 0.0)
            elif (refused := running.start(effect)) is not None:
                self._answer_finished([refused])
        if not self._stepping:
            self._step_while_running(running)

    def _step_while_running(self, running: RunningRequests) -> None:
        """Step the runner while requests run; between steps, the frames waiting on the
        socket are handled (new requests join the running set; any other command first waits
        for every request to finish), and each finished request is answered at once."""
        self._stepping = True
        try:
            # A step first: the requests just gathered run before another frame is taken.
            # The loop's test comes after the frames: a hold taken among them, not one more step.
            while len(running) and not self.stopped and not self._frozen():
                self._answer_finished(running.step())
                for _ in range(STEP_FRAMES_MAX):
                    frame = self._receive(zmq.NOBLOCK) if self._gather else None
                    if frame is None or self.stopped:
                        break
                    self.handle_isolated(frame)
                self._run_batch()
            self._report_to_ledger()
        except InvariantViolation:
            raise
        except Exception as exc:
            self.frame_errors.record(exc, f"stepping {len(running)} running requests")
            self._answer_finished(running.fail_all(exc))
        finally:
            self._stepping = False

    def _frozen(self) -> bool:
        """The running requests are held (pause keep): nothing steps them until the release."""
        return self.core is not None and self.core.holding

    def _finish_running(self, below: int) -> None:
        """Step the running requests, taking no frame, until fewer than `below` run."""
        running = self._running
        while running is not None and len(running) >= below and not self.stopped:
            self._answer_finished(running.step())

    def _answer_finished(self, finished: list[Finished]) -> None:
        """Answer each request the core still holds (one it already answered gets nothing)."""
        held = set(self.core.in_progress) if self.core is not None else set()
        for done in finished:
            if done.effect.task_id in held:
                self._answer_request(done.effect, done.output, done.duration_s)
            else:
                self._drop_landed(done.effect)

    def _answer_request(self, effect: ExecuteEffect, output: Any, duration_s: float) -> None:
        """One request of a batch: its Result, or its NACK; exactly one reply whatever raises."""
        core = self.core
        assert core is not None
        self._drop_landed(effect)  # before its reply: a pipeline releases no landing after a Result
        try:
            if isinstance(output, BaseException):
                raise output
            checked = checked_output(output, self.config.max_frame_bytes)
            done: EffectCompleted | EffectRaised = EffectCompleted(effect.task_id, None, checked, duration_s)
        except Exception as exc:
            log.warning("worker %s/%s: request %r failed: %s", *self._who(), effect.task_id, _error_text(exc))
            done = EffectRaised(effect.task_id, _error_text(exc))
        outer, self._answered = self._answered, set()
        try:
            self._send_all(core.step(done))
        except InvariantViolation:
            raise
        except Exception as exc:
            self.frame_errors.record(exc, f"answering request {effect.task_id!r}")
            if effect.task_id not in self._answered:  # its one reply now, not at the deadline (P-1)
                self._answer_lost(effect.task_id, exc)
        finally:
            if outer is not None:
                outer |= self._answered
            self._answered = outer

    def _drop_landed(self, effect: ExecuteEffect) -> None:
        """The request has ended: what landed for the transfer it names goes (P-22)."""
        if self.runner is not None:
            try:
                drop_landed(self.runner, effect.payload)
            except Exception as exc:  # a runner's inbox that raises ends no loop
                self.frame_errors.record(exc, f"dropping the landing of request {effect.task_id!r}")

    def _answer_lost(self, task_id: str, exc: Exception) -> None:
        """A request whose answer raised: its error if the core still holds it, else (the core
        took its completion and the reply was lost) NACK BAD_MESSAGE, as for a frame."""
        core = self.core
        assert core is not None
        cause = f"{cause_of(exc)}: {str(exc)[:300]}"
        try:
            if task_id in core.in_progress:
                step = core.step(EffectRaised(task_id, f"the worker failed answering it ({cause})"))
            else:
                detail = f"this worker failed answering the request ({cause}); it serves on: retry under a new task_id"
                step = core.step(BadFrame(ProtocolError(detail, task_id=task_id, epoch=core.epoch)))
            self._send_all(step)
        except InvariantViolation:
            raise
        except Exception as again:  # the socket itself failing: counted, the loop goes on
            self.frame_errors.record(again, f"answering request {task_id!r} again")

    def _who(self) -> tuple[str, int]:
        return self.config.stage, self.config.rank

    def _execute_batch(self, batch: list[ExecuteEffect]) -> list[Any]:
        """One entry per request, in order: its output or the exception that is its error.
        Requests naming an adapter (P-20) run one at a time through it; the others together."""
        if self.runner is None:
            failed = RuntimeError("the worker has no runner (start-up failed)")
            return [failed] * len(batch)
        outputs: list[Any] = [None] * len(batch)
        plain = [i for i, effect in enumerate(batch) if effect.adapter is None]
        for i, effect in enumerate(batch):
            if effect.adapter is not None:
                outputs[i] = self._execute_adapter(effect)
        for i, output in zip(plain, self._execute_plain([batch[i] for i in plain]) if plain else [], strict=True):
            outputs[i] = output
        return outputs

    def _execute_adapter(self, effect: ExecuteEffect) -> Any:
        assert self.runner is not None and effect.adapter is not None
        try:
            return self.runner.execute_adapter(effect.payload, effect.adapter)
        except Exception as exc:
            log.error("worker %s/%s: request %s failed:\n%s", *self._who(), effect.task_id, traceback.format_exc())
            return exc

    def _execute_plain(self, batch: list[ExecuteEffect]) -> list[Any]:
        assert self.runner is not None
        try:
            outputs = list(self.runner.execute_batch([effect.payload for effect in batch]))
        except Exception as exc:
            log.error(
                "worker %s/%s: a batch of %d requests failed:\n%s", *self._who(), len(batch), traceback.format_exc()
            )
            return [exc] * len(batch)
        if len(outputs) != len(batch):
            wrong = RuntimeError(
                f"{type(self.runner).__name__}.execute_batch returned {len(outputs)} results for "
                f"{len(batch)} requests; it must return one per payload, in order"
            )
            return [wrong] * len(batch)
        return outputs

    def _perform(self, effect: Effect) -> None:
        core = self.core
        assert core is not None
        started = time.perf_counter()
        try:
            measure = self._measurer(effect)
            output = self._apply(effect)
            duration_s = time.perf_counter() - started
            memory = measure()
        except Exception as exc:
            step = self._on_effect_error(effect, exc)
        else:
            path = self.backend.last_sleep_path if isinstance(effect, SleepEffect) and self.backend else ""
            trace_paths = output if isinstance(effect, ProfileEffect) else ()
            shares = isinstance(effect, ShareEffect) or _shares(effect)  # the buckets the Ack lists
            shared = output if shares else None
            output = None if isinstance(effect, ProfileEffect) or shares else output
            version = output.version if isinstance(output, Reloaded) else 0
            output = output.caches if isinstance(output, Reloaded) else output
            # Positional, in the fields' order: each value is named as its field.
            step = core.step(
                EffectCompleted(effect.task_id, memory, output, duration_s, path, trace_paths, shared, version)
            )
        self._send_all(step)
        if isinstance(effect, UpdateEffect) and self._running is not None:
            self._running.forget(set(core.in_progress))  # an update failed under held requests
        if isinstance(effect, ShutdownEffect):
            self.stopped = True

    def _measurer(self, effect: Effect) -> Callable[[], MemoryReport | None]:
        """Take the readings `effect` needs before it runs; the returned call takes the rest
        after it. The profiler, a weight group and a share move no pool memory (P-12 asks no
        report); a command the table marks as moving none (WORKER_CALLS: ResetPrefixCache)
        reads its pools once (its report shows them unchanged, P-19) and no process figure:
        a reading per command would cost more than the command. Everything else, Status
        included, is measured before and after (P-12), and the node's ledger hears of it."""
        if isinstance(effect, (ProfileEffect, WeightGroupEffect, ShareEffect)):
            return lambda: None
        if isinstance(effect, HoldEffect):  # the runner stops stepping: no memory moves
            return lambda: _unmeasured(self._usage(), "HoldRequests")
        if isinstance(effect, CommandEffect):
            name = type(effect.command).__name__
            return lambda: _unmeasured(self._usage(), name)
        pools_before, figure_before = self._usage(), self._figure()

        def after() -> MemoryReport:
            self._report_to_ledger()
            figure_after = self._figure()
            return MemoryReport(
                pool_bytes_before=pools_before,
                pool_bytes_after=self._usage(),
                process_bytes_before=figure_before.process_bytes,
                process_bytes_after=figure_after.process_bytes,
                process_bytes_source=_source(figure_before, figure_after),
            )

        return after

    def _on_effect_error(self, effect: Effect, exc: Exception) -> WorkerStep:
        """A refusal of the command's arguments (RunnerArgumentError, from any command) or of a
        wake for lack of memory is the caller's to mend: one WARNING line. Anything else is the
        backend's or the runner's failure: an ERROR with its traceback."""
        core = self.core
        assert core is not None
        name = type(getattr(effect, "command", effect)).__name__.removesuffix("Effect")  # "TransferOut", "Reload"
        if isinstance(exc, (RunnerArgumentError, WakeRefused)):
            log.warning("worker %s/%s: %s %r refused: %s", *self._who(), name, effect.task_id, _error_text(exc))
        else:
            log.error("worker %s/%s: %s %r failed:\n%s", *self._who(), name, effect.task_id, traceback.format_exc())
        if isinstance(exc, AdapterRefused) and isinstance(effect, AdapterEffect):
            # Checked before anything was loaded or evicted: the rank serves on as it was.
            return core.step(EffectDeclined(effect.task_id, str(exc), NackReason.INVALID_ARGUMENT))
        if isinstance(exc, RunnerArgumentError) and isinstance(effect, (ReloadEffect, UpdateEffect)):
            # Refused before any tensor was written: the rank keeps its state (INVALID_ARGUMENT).
            return core.step(EffectDeclined(effect.task_id, _error_text(exc), NackReason.INVALID_ARGUMENT))
        if isinstance(exc, WakeRefused) and isinstance(effect, WakeEffect):
            # Rolled back: nothing mapped is kept, the tags sleep as before (NO_MEMORY, P-16).
            return core.step(EffectDeclined(effect.task_id, str(exc), NackReason.NO_MEMORY))
        if isinstance(effect, ShutdownEffect):
            self.exit_code = EXIT_SHUTDOWN_ERROR
        return core.step(EffectRaised(effect.task_id, _error_text(exc)))

    def _apply(self, effect: Effect) -> Any:
        backend, runner = self.backend, self.runner
        if isinstance(effect, StatusEffect):
            return None
        if isinstance(effect, ProfileEffect):
            if effect.start:
                self.profiler.start(effect.prefix)
                return ()
            return self.profiler.stop()
        if isinstance(effect, ShutdownEffect):
            self._release()
            return None
        if isinstance(effect, WeightGroupEffect):
            self.receiver.join(effect.command)
            return None
        if backend is None or runner is None:
            raise RuntimeError("the worker has no backend or runner (start-up failed)")
        if isinstance(effect, CommandEffect):
            assert self.core is not None  # a CommandEffect comes from the core
            return COMMAND_HANDLERS[type(effect.command)](runner, effect.command, self.core)
        if isinstance(effect, AdapterEffect):
            return self._adapter(backend, runner, effect)
        if isinstance(effect, HoldEffect):
            return self._running.hold(effect.clear_cache) if self._running is not None else {}
        if isinstance(effect, SleepEffect):
            runner.before_sleep(effect.offload, effect.discard)
            # A swap whose incoming stage fits; the device is asked only by a backend that can use it.
            late = backend.supports_late_release and room_for(self.free_memory, effect.incoming_bytes)
            saved = runner.buffers_to_save()
            held = runner.runner_tags()  # released by before_sleep: no backend pool holds them
            offload, discard = effect.offload - held, effect.discard - held
            backend.sleep(offload, discard, buffers=saved, links=effect.links, release_late=late)
        elif isinstance(effect, WakeEffect):
            self._wake(backend, effect)
            runner.after_wake(effect.tags)
        elif isinstance(effect, ReloadEffect):
            return self._reload(backend, runner, effect)
        elif isinstance(effect, UpdateEffect) and effect.into_host:
            return refit_into_host(backend, runner, self.receiver, effect)  # the device untouched
        elif isinstance(effect, UpdateEffect):
            if not effect.flush_cache:
                refuse_kept_caches(runner)  # before anything is written: INVALID_ARGUMENT
            # As a reload: in place, outside any pool. Invalidated first, so that a host copy of
            # the previous version never comes back at a wake, even when the update fails midway.
            backend.invalidate({WEIGHTS_TAG})
            self.receiver.apply(effect.source, runner)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the Ack commits the version: every copy landed
            # No track(): the tensors were written in place (same allocations), and a fresh host
            # copy of read-only weights made here costs the update a device->host copy of every
            # byte (3 GB: ~60 ms against ~10 for the update itself); the next sleep copies.
            return drop_derived_caches(runner, flush=effect.flush_cache)
        elif isinstance(effect, ShareEffect):
            if self.sender is None or self.sender.bucket_bytes != effect.bucket_bytes:
                if self.sender is not None:
                    self.sender.close()
                self.sender = WeightSender(bucket_bytes=effect.bucket_bytes)
            return self.sender.share(runner.weights_to_share())
        else:  # pragma: no cover - the core emits only the effects above
            raise TypeError(f"unknown effect {effect!r}")
        return None

    def _reload(self, backend: MemoryBackend, runner: ModelRunner, effect: ReloadEffect) -> Reloaded:
        # In place, outside any pool: the weights' memory is already mapped, and entering
        # vLLM's use_memory_pool again would replace the MemPool that owns it.
        source = None if effect.source is None else rank_source(effect.source, self.config.rank)
        version = saved_version(source)  # a bad index refuses the reload before anything is written
        backend.invalidate({WEIGHTS_TAG})  # a host copy of the old weights no longer stands for them
        runner.reload_weights(source)
        if self.device.type == "cuda":
            # The Ack says the weights are valid: wait for the refill kernels, so that
            # duration_s is the reload's and not its launch's.
            torch.cuda.synchronize(self.device)
        if WEIGHTS_TAG in self.config.tags:
            backend.track(WEIGHTS_TAG, runner.tensors(WEIGHTS_TAG))
        return Reloaded(drop_derived_caches(runner, flush=True), version)

    def _adapter(self, backend: MemoryBackend, runner: ModelRunner, effect: AdapterEffect) -> None:
        """An adapter command on the runner (P-20): an add is checked whole before anything is
        evicted or loaded, then loaded inside the adapters' pool; the pool's tensors are tracked
        again after every change, so a level-1 sleep offloads exactly the adapters held."""
        command = effect.command
        if isinstance(command, AddAdapter):
            try:
                runner.check_adapter(command)
                # Tensors (a refit): every bucket opened and every tensor checked by the weight
                # planes' own receiver, before anything is evicted or written.
                tensors = None if command.tensors is None else self.receiver.open_adapter(command, runner)
            except RunnerArgumentError as exc:
                raise AdapterRefused(f"AddAdapter {command.name!r} refused: {exc}") from exc
            for name in effect.evict:
                runner.remove_adapter(name)
            with backend.pool(runner.adapter_tag):
                try:
                    runner.add_adapter(command) if tensors is None else runner.write_adapter(command, tensors())
                except BaseException:
                    runner.remove_adapter(command.name)  # half-written: never served (the core drops it)
                    raise
            if tensors is not None and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the Ack commits the version: every copy landed
        elif isinstance(command, RemoveAdapter):
            runner.remove_adapter(command.name)
        elif isinstance(command, PinAdapter):
            runner.pin_adapter(command.name, command.pinned)
        else:  # ListAdapters: the core's table answers it
            return
        if runner.adapter_tag in self.config.tags:
            backend.track(runner.adapter_tag, runner.tensors(runner.adapter_tag))

    def _release(self) -> None:
        self.receiver.close()
        if self.runner is not None:
            close_transfers(self.runner)  # the buckets held for other stages' requests
        if self.sender is not None:
            self.sender.close()
        self.profiler.close()  # a running profile has no one left to ask for it; finish compressing
        backend, runner = self.backend, self.runner
        if backend is not None:
            backend.release()
        if runner is not None and not (backend is not None and backend.hard_exit_required):
            runner.close()

    # ------------------------------------------------------------------ measuring

    def _usage(self) -> dict[str, int]:
        usage = self.backend.usage() if self.backend is not None else {}
        if self.runner is not None:
            usage.update({tag: self.runner.held_bytes(tag) for tag in self.runner.runner_tags()})
        return usage

    def _figure(self) -> MemoryFigure:
        if self.memory is None:
            return MemoryFigure(None, "none: accounting not started (start-up failed)")
        return self.memory.measure()

    # ------------------------------------------------------------------ sending, tracing

    def _send(self, message: Message) -> None:
        self.sock.send(encode(self.counters.stamp(message)))
        if self._answered is not None:
            self._answered.add(message.task_id)

    def _send_all(self, step: WorkerStep) -> None:
        """The step's records first (each written before what it describes leaves), then its
        replies. A batch gathered before this step starts first: one that runs whole answers
        first, so replies leave in the order their frames came (a refused or undecodable frame
        after a request included); one a continuous runner steps joins its running set, and
        the loop steps it once the waiting frames are served: the refusal of a frame never
        waits for a generation to finish."""
        if self._batch and step.replies:
            self._start_batch() if self._continuous() is not None else self._run_batch()
        self._write(step.records)
        for message in step.replies:
            self._send(message)

    def _write(self, records: tuple[WorkerRecord | ParentGone, ...]) -> None:
        if self.trace.enabled:
            self.trace.write(records, epoch=self.core.epoch if self.core is not None else self.config.epoch)

    def close(self) -> None:
        self.trace.close()
        self.trace = NULL_TRACE

    @property
    def hard_exit_required(self) -> bool:
        """Whether the rank must leave by `os._exit`: its backend cannot be finalized, or a
        weight-group rendezvous thread is still blocked inside torch."""
        return (self.backend is not None and self.backend.hard_exit_required) or self.receiver.blocked_joins > 0


# What a rank does for each command its core takes by the generic template (`CommandEffect`,
# fsm/worker_table.py's WORKER_CALLS): one entry per command, (runner, command, the rank's
# core, read only: its rank and weights version) -> output.
COMMAND_HANDLERS: dict[type[Command], Callable[[ModelRunner, Any, WorkerCore], Any]] = {
    ResetPrefixCache: lambda runner, command, core: runner.reset_prefix_cache(),
    SaveWeights: lambda runner, command, core: save_rank(
        runner, command, SavedRank(core.rank, core.weights_version, runner.weights_origin())
    ),
    TransferOut: lambda runner, command, core: transfer_out(runner, command),
    TransferIn: lambda runner, command, core: transfer_in(runner, command),
    TransferRelease: lambda runner, command, core: transfer_release(runner, command),
}


def _shares(effect: Effect) -> bool:
    """A generic call whose output is the buckets it holds, which its Ack lists (P-22)."""
    if not isinstance(effect, CommandEffect):
        return False
    row = WORKER_CALLS.get(type(effect.command))
    return row is not None and row.shares


def _rank_secret(secret_hex: str | None) -> bytes | None:
    if not secret_hex:
        return None
    try:
        return bytes.fromhex(secret_hex)
    except ValueError:
        raise SystemExit(
            f"{RANK_SECRET_ENV} must be hex (the engine sets it); got {len(secret_hex)} characters that are not"
        ) from None


def _unmeasured(pools: dict[str, int], command: str) -> MemoryReport:
    """The report of a command that moves no memory: its pools as read once, no process figure."""
    return MemoryReport(
        pool_bytes_before=pools,
        pool_bytes_after=pools,
        process_bytes_source=f"none: {command} moves no memory, so none was measured",
    )


def _source(before: MemoryFigure | None, after: MemoryFigure) -> str:
    if before is None or before.source == after.source:
        return after.source
    return f"before: {before.source}; after: {after.source}"


def run_worker(config: WorkerConfig, *, parent_pid: int | None = None) -> int:
    """Run one worker until Shutdown. Usable as a multiprocessing spawn target.

    Returns 0 after a clean Shutdown. Any other end raises SystemExit with the code
    (1: Shutdown's release failed, 3: the parent process died), so that a multiprocessing
    child's `exitcode` tells the two apart. The process whose death ends the worker
    (config.exit_with_parent) is config.parent_pid, else `parent_pid`, else the parent at
    entry: a parent that dies before the worker reads its ppid goes unnoticed unless named.
    """
    if config.parent_pid is not None:
        parent_pid = config.parent_pid
    elif parent_pid is None:
        parent_pid = os.getppid()
    if not logging.getLogger().handlers:
        logging.basicConfig(
            level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
        )
        if os.environ.get(LOG_FORMAT_ENV):  # under `omni-core serve`: its format (--log-json: JSON)
            formatter = formatter_for(os.environ[LOG_FORMAT_ENV])
            if formatter is not None:
                logging.getLogger().handlers[0].setFormatter(formatter)
    # The secret leaves the environment at once, so nothing the runner spawns inherits it.
    rank_secret = _rank_secret(os.environ.pop(RANK_SECRET_ENV, None))
    ctx = zmq.Context()
    # A random suffix: a stranger cannot connect first under this rank's identity.
    identity = f"{config.stage}/{config.rank}/{secrets.token_hex(8)}".encode()
    sock = make_dealer(
        ctx,
        config.address,
        identity=identity,
        hwm=config.recv_queue_limit,
        curve=curve_client_keys(config.curve_server_key),
    )
    worker = WorkerProcess(config, sock, identity=identity, rank_secret=rank_secret)
    code = EXIT_OK
    loop_ended = None
    if config.exit_with_parent:
        set_death_signal(parent_pid)
        what = f"worker {config.stage}/{config.rank}"
        loop_ended = watch_parent(parent_pid, config.parent_check_interval_s, what, EXIT_PARENT_GONE)
    try:
        worker.start()
        code = worker.serve(parent_pid)
    finally:
        if loop_ended is not None:
            loop_ended.set()
        worker.close()
        sock.close(linger=FINAL_FLUSH_MS)  # deliver the Shutdown Ack before leaving
        ctx.term()
    if worker.hard_exit_required:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code != EXIT_OK:
        raise SystemExit(code)
    return code
