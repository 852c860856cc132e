"""The embedded Python API: `Engine` (blocking, thread-safe) and `AsyncEngine` (asyncio).

Every call validates its arguments on the orchestrator thread before anything is sent and
raises `InvalidArgumentError` for an unknown stage, a level other than 1/2, an unknown tag
or a command the stage's state forbids. Every call is bounded: the orchestrator enforces
the deadline (P-9); the caller's wait adds a grace period on top so that even a broken
orchestrator cannot hang it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar, overload

import msgspec

from omni_core.engine.adapter_calls import AdapterCalls
from omni_core.engine.calls import LifecycleCall, ReportCall, ShutdownCall, StatusQuery, SwapRequest
from omni_core.engine.errors import EngineClosedError, InvalidArgumentError, OmniCoreError, SwapFailedError
from omni_core.engine.launch import LocalLauncher, RankLauncher
from omni_core.engine.orchestrator import Orchestrator
from omni_core.engine.pipeline import PipelineResult, PipelineStage, run_pipeline
from omni_core.engine.rendezvous import DEFAULT_WEIGHT_GROUP_HOSTS, RendezvousPolicy
from omni_core.engine.report import ExecuteResult, LifecycleReport, ProfileReport, RestartReport, SwapReport
from omni_core.engine.spec import StageSpec
from omni_core.engine.start_plan import check_start_plan
from omni_core.fsm.admission import AdmissionPolicy
from omni_core.fsm.inputs import (
    CommandCall,
    PauseCall,
    ProfileCall,
    ReloadCall,
    Restart,
    ResumeCall,
    SetAdmission,
    ShareCall,
    SleepCall,
    Start,
    Submit,
    UpdateCall,
    WakeCall,
    WeightGroupCall,
)
from omni_core.fsm.stage import memory_wait_problem
from omni_core.protocol import MAX_MEMORY_WAIT_S, DiskSource, ResetPrefixCache, SaveWeights, new_version_problem
from omni_core.protocol.messages import DEFAULT_SAVE_FILE_BYTES
from omni_core.protocol.weights import WeightSource

WAIT_GRACE_S = 10.0  # beyond the orchestrator's own deadline, before a caller gives up
# A swap's incoming ranks wait for memory this share of the deadline by default: the rest
# is theirs to map and copy, and for a refusal to arrive before the deadline.
SWAP_MEMORY_WAIT_SHARE = 0.5
SHUTDOWN_TIMEOUT_S = 15.0

T = TypeVar("T")


def _tags(tags: Iterable[str] | str | None) -> tuple[str, ...] | None:
    if tags is None:
        return None
    if isinstance(tags, str):
        return (tags,)
    return tuple(tags)


class Engine(AdapterCalls):
    """Starts every stage's ranks and waits until all are RUNNING (or raises).

    `transport`: "ipc" (a private Unix socket, default) or "tcp" bound on `host`; tcp on an
    address that leaves the host is encrypted and authenticated with CURVE (`curve=None`
    decides so; `curve=True` forces it on loopback too). Every rank proves in its Hello that
    the engine spawned it, whatever the transport (specs/protocol.md, threat model).

    `launcher`: "local" (child processes, default), "ray" (one Ray actor per rank on the
    cluster at `ray_address`, placed by each StageSpec's `placement`; tcp + CURVE on the
    interface Ray reports for this node: docs/ray.md) or a `RankLauncher` object.

    `allowed_weight_group_hosts`: where `init_weight_group` may make the ranks connect
    (addresses, CIDR blocks, host names; loopback by default): the operator's choice, checked
    before anything is sent (engine/rendezvous.py).
    """

    def __init__(
        self,
        specs: Iterable[StageSpec],
        *,
        transport: str | None = None,
        host: str | None = None,
        curve: bool | None = None,
        trace_path: str | None = None,
        launcher: RankLauncher | str | None = None,
        ray_address: str | None = "auto",
        ray_namespace: str | None = None,
        allowed_weight_group_hosts: Iterable[str] = DEFAULT_WEIGHT_GROUP_HOSTS,
    ) -> None:
        self._specs = {s.name: s for s in specs}
        self.rendezvous = RendezvousPolicy(
            (allowed_weight_group_hosts,) if isinstance(allowed_weight_group_hosts, str) else allowed_weight_group_hosts
        )
        ranks_launcher = make_launcher(launcher, ray_address, ray_namespace)
        if isinstance(ranks_launcher, LocalLauncher):  # Ray places ranks on nodes chosen later
            problem = check_start_plan(self._specs.values(), os.environ.get("CUDA_VISIBLE_DEVICES"))
            if problem:
                raise InvalidArgumentError(problem)
        self._orch = Orchestrator(
            self._specs.values(),
            transport=transport,
            host=host,
            curve=curve,
            trace_path=trace_path,
            launcher=ranks_launcher,
        )
        try:
            futures = [self._orch.submit(name, Start(spec.start_deadline_s)) for name, spec in self._specs.items()]
            for name, future in zip(self._specs, futures, strict=True):
                self._wait(future, self._specs[name].start_deadline_s)
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def address(self) -> str:
        return self._orch.address

    # ------------------------------------------------------------------ requests

    def submit(
        self,
        stage: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        with_version: bool = False,
        adapter: str | None = None,
    ) -> Future[Any]:
        """Send a request without waiting; the future holds rank 0's output (an `ExecuteResult`
        naming the weights version too, and the adapter's, `with_version`) or the error (this
        call raises none). `adapter`: the LoRA adapter to run it with (P-20), refused naming
        it when a rank does not hold it loaded."""
        try:
            spec = self._spec(stage)
            budget_s = spec.request_timeout_s if timeout_s is None else float(timeout_s)
        except (InvalidArgumentError, TypeError, ValueError) as exc:
            refused: Future[Any] = Future()
            refused.set_exception(exc)
            return refused
        answered = self._orch.submit(stage, Submit(self._orch.new_request_id(stage), payload, budget_s, adapter))
        return answered if with_version else _output_of(answered)

    def execute(
        self,
        stage: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        with_version: bool = False,
        adapter: str | None = None,
    ) -> Any | ExecuteResult:
        """Rank 0's output; with `with_version`, an `ExecuteResult`: the output and the weights
        version that produced it (every rank computed it on that version), and the adapter
        and adapter version it ran with (`adapter`, P-20)."""
        spec = self._spec(stage)
        return self._wait(
            self.submit(stage, payload, timeout_s=timeout_s, with_version=with_version, adapter=adapter),
            timeout_s if timeout_s is not None else spec.request_timeout_s,
        )

    # ------------------------------------------------------------------ lifecycle

    def sleep(
        self,
        stage: str,
        level: int = 1,
        tags: Iterable[str] | str | None = None,
        *,
        task_id: str | None = None,
        timeout_s: float | None = None,
        abort_in_flight: bool = False,
    ) -> LifecycleReport:
        """Close admission, drain (or abort) in-flight requests, sleep every rank."""
        tid, deadline_s = self._task(stage, "sleep", task_id, timeout_s)
        return self._lifecycle(stage, SleepCall(tid, level, _tags(tags), deadline_s, abort_in_flight))

    def wake(
        self,
        stage: str,
        tags: Iterable[str] | str | None = None,
        *,
        task_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LifecycleReport:
        tid, deadline_s = self._task(stage, "wake", task_id, timeout_s)
        return self._lifecycle(stage, WakeCall(tid, _tags(tags), deadline_s))

    def pause(
        self,
        stage: str,
        mode: str = "wait",
        *,
        task_id: str | None = None,
        timeout_s: float | None = None,
        clear_cache: bool = False,
    ) -> LifecycleReport:
        """Close admission keeping the memory (vLLM's pause_generation): no request starts until
        resume(); requests queue, or are refused under the policy 'reject'. In-flight requests
        finish first (mode "wait", as a sleep drains), or their callers get RequestFailedError
        "aborted" at once ("abort", vLLM's default), or ("keep") they are frozen where they are
        on every rank, their KV kept, so update_weights() can run before resume() lets them go
        on under the new weights: each result then names which version computed which tokens
        (`ExecuteResult.version_spans`). A runner that cannot freeze its requests finishes
        them first, as "wait". `clear_cache` (with "keep") drops their KV instead: each
        restarts from its prompt at resume (`ExecuteResult.discarded_tokens`). The report comes
        once none is in flight or every rank holds them (state PAUSED), or ALREADY.
        `timeout_s` bounds that drain: past it the pause is abandoned."""
        tid, deadline_s = self._task(stage, "pause", task_id, timeout_s)
        return self._lifecycle(stage, PauseCall(tid, mode, deadline_s, clear_cache))

    def resume(self, stage: str, *, task_id: str | None = None, timeout_s: float | None = None) -> LifecycleReport:
        """Open a PAUSED stage's admission again; its queued requests run. ALREADY when RUNNING.
        `timeout_s` (default: the stage's deadline_s) bounds the wait for the answer."""
        tid, deadline_s = self._task(stage, "resume", task_id, timeout_s)
        return self._lifecycle(stage, ResumeCall(tid, deadline_s))

    def is_paused(self, stage: str) -> bool:
        """Whether a pause holds the stage until resume(): PAUSED, or asleep after it slept
        while paused (a pause's drain, DRAINING, is not yet)."""
        self._spec(stage)
        return bool(self.status()[stage]["paused"])

    def swap(
        self,
        out_stage: str,
        in_stage: str,
        *,
        level: int = 1,
        tags: Iterable[str] | str | None = None,
        task_id: str | None = None,
        timeout_s: float | None = None,
        memory_wait_s: float | None = None,
    ) -> SwapReport:
        """Put `out_stage` to sleep (`level`, `tags`) and wake `in_stage` at the same time, so
        the host link carries both directions at once (P-16). Each incoming rank maps an
        allocation only once its device has that much free memory, waiting up to
        `memory_wait_s` (default: half the deadline) for the outgoing stage to release it; a
        stage never allocates past the device, whatever the sizes. Task ids are
        `{task_id}/out` and `{task_id}/in`: a repeated swap gets both recorded outcomes. One
        incoming wake per device at a time: while another swap's incoming stage is waking
        on a device `in_stage` runs on, this swap waits for that wake to end (`status()`
        lists it under `swaps_waiting`), then goes out with what is left of its deadline;
        it raises `TaskAbandonedError`, nothing sent, when its deadline passes first or 16
        swaps wait already.

        Raises `SwapFailedError` unless both halves complete; its `outgoing`/`incoming` hold
        each half's report or error (`NoMemoryError` names who holds the memory: the
        incoming stage is then exactly where it was)."""
        if out_stage == in_stage:
            raise InvalidArgumentError(f"a swap needs two stages; got {out_stage!r} twice (use sleep or wake)")
        out_spec, in_spec = self._spec(out_stage), self._spec(in_stage)
        deadline_s = self._deadline_s(max(out_spec.deadline_s, in_spec.deadline_s), timeout_s)
        default_s = min(SWAP_MEMORY_WAIT_SHARE * deadline_s, MAX_MEMORY_WAIT_S)
        wait_s = default_s if memory_wait_s is None else memory_wait_s
        problem = memory_wait_problem(wait_s, deadline_s)  # the core's rule, asked before the sleep goes out
        if problem is not None:
            raise InvalidArgumentError(f"swap into {in_stage!r}: {problem}")
        swap_id = task_id or self._orch.new_task_id("swap", f"{out_stage}-{in_stage}")
        sleep = SleepCall(f"{swap_id}/out", level, _tags(tags), deadline_s)
        wake = WakeCall(f"{swap_id}/in", None, deadline_s, float(wait_s))
        out_future: Future[LifecycleReport] = Future()
        in_future: Future[LifecycleReport] = Future()
        started = time.perf_counter()
        issued = self._orch.submit(None, SwapRequest(out_stage, sleep, out_future, in_stage, wake, in_future))
        budget_s = deadline_s + max(out_spec.request_timeout_s, in_spec.request_timeout_s)
        # Raises when the sleep was refused, or the swap waited for its incoming stage's device
        # past its deadline (one incoming wake per device at a time): then nothing was sent.
        self._wait(issued, deadline_s)
        halves: dict[str, LifecycleReport | OmniCoreError] = {}
        for name, future in (("outgoing", out_future), ("incoming", in_future)):
            try:
                halves[name] = self._wait(future, budget_s)
            except OmniCoreError as exc:
                halves[name] = exc
        duration_s = time.perf_counter() - started
        out, into = halves["outgoing"], halves["incoming"]
        if isinstance(out, LifecycleReport) and isinstance(into, LifecycleReport):
            return SwapReport(swap_id, out, into, duration_s)
        said = [
            f"{what} stage {stage!r}: "
            + (
                f"{half.state} ({half.status})"
                if isinstance(half, LifecycleReport)
                else f"{type(half).__name__}: {half}"
            )
            for what, stage, half in (("outgoing", out_stage, out), ("incoming", in_stage, into))
        ]
        raise SwapFailedError(
            f"swap {swap_id!r} did not complete: " + "; ".join(said), out, into, out_stage=out_stage, in_stage=in_stage
        )

    def reload_weights(
        self, stage: str, source: str | None = None, *, task_id: str | None = None, timeout_s: float | None = None
    ) -> LifecycleReport:
        if source is not None and (not isinstance(source, str) or "\x00" in source):
            raise InvalidArgumentError(
                f"the reload source must be a path string without NUL characters, got {source!r:.200}; nothing was sent"
            )
        tid, deadline_s = self._task(stage, "reload", task_id, timeout_s)
        return self._lifecycle(stage, ReloadCall(tid, source, deadline_s))

    def update_weights(
        self,
        stage: str,
        source: WeightSource | str,
        *,
        version: int,
        task_id: str | None = None,
        timeout_s: float | None = None,
        flush_cache: bool = True,
    ) -> LifecycleReport:
        """Replace the stage's weights with `source` as weights `version` (P-17): a checkpoint
        directory (a str, or `DiskSource`), or what `omni_core.weights_sender.WeightSender`
        shares (`ShmSource`, `IpcSource`, `CollectiveSource`). `version` must be above the
        stage's (its `weights_version` in `status()`). In RUNNING the stage drains first
        (requests queue or are refused per its admission policy) and commits only once every
        rank holds the new version. Raises `InvalidArgumentError` when refused (nothing was
        written, the version unchanged), `WeightUpdateFailedError` when every rank failed once
        writing began (the stage is NEEDS_RELOAD at its old version), `StageFailedError` when
        the ranks ended apart. The sender's buckets must stay alive until this returns.

        Before the ranks ACK, each drops its runner's weight-derived caches (vLLM's prefix KV
        blocks; each rank's `caches_dropped` in the report); `flush_cache=False` keeps those keyed
        by version and is refused (InvalidArgumentError, nothing written) when the runner holds
        one keyed by prompt alone."""
        problem = new_version_problem(version)
        if problem is not None:
            raise InvalidArgumentError(problem)
        checked = _checked_source(DiskSource(path=source) if isinstance(source, str) else source)
        tid, deadline_s = self._task(stage, "update", task_id, timeout_s)
        return self._lifecycle(stage, UpdateCall(tid, version, checked, deadline_s, flush_cache))

    def init_weight_group(
        self,
        stage: str,
        *,
        address: str,
        port: int,
        world_size: int,
        rank_offset: int = 1,
        backend: str = "gloo",
        group: str = "weights",
        group_timeout_s: float = 300.0,
        task_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LifecycleReport:
        """Every rank of `stage` joins the trainer's weight group (the trainer is group rank 0 and
        serves the rendezvous at address:port: `WeightSender.init_group`, called meanwhile); rank r
        is group rank `rank_offset + r`. Then `update_weights(stage, CollectiveSource(...))`.
        `group_timeout_s` bounds each later broadcast: a trainer that vanishes mid-broadcast
        fails the update (UPDATE_FAILED) after at most that long. The rendezvous is bounded by
        this call's deadline too: one that fails or does not complete in time is refused
        (`InvalidArgumentError`, the stage stays where it was, the ranks join no group).
        `address` must be in the engine's `allowed_weight_group_hosts` (refused before any rank
        connects); the ranks connect to the address it resolves to here."""
        destination = self.rendezvous.destination(address, port)
        tid, deadline_s = self._task(stage, "weight-group", task_id, timeout_s)
        return self._lifecycle(
            stage,
            WeightGroupCall(
                tid, group, destination, port, world_size, rank_offset, backend, deadline_s, group_timeout_s
            ),
        )

    def transfer_weights(
        self,
        from_stage: str,
        to_stage: str,
        *,
        version: int,
        task_id: str | None = None,
        timeout_s: float | None = None,
        bucket_bytes: int = 256 << 20,
    ) -> LifecycleReport:
        """The trainer is a stage: its rank 0 shares its weights (ShareWeights, host shared memory
        or CUDA IPC on its node) and `to_stage` takes them as weights `version`, as
        `update_weights` does. Both stages on one node; the trainer's weights awake (RUNNING, or
        PARTIAL with 'weights' awake), the rollout's resident. Task ids `{task_id}/share` and
        `{task_id}/update`: a repeated transfer gets both recorded outcomes. The trainer keeps the
        buckets until its next share (refilled in place when the layout is the same)."""
        if from_stage == to_stage:
            raise InvalidArgumentError(f"a transfer needs two stages; got {from_stage!r} twice")
        self._spec(to_stage)
        status = self.status()
        nodes = {stage: {r["node"] for r in status[stage]["ranks"].values()} for stage in (from_stage, to_stage)}
        if len(nodes[from_stage] | nodes[to_stage]) > 1:
            raise InvalidArgumentError(
                f"stages {from_stage!r} (nodes {sorted(nodes[from_stage])}) and {to_stage!r} "
                f"(nodes {sorted(nodes[to_stage])}) are not on one node; shared buckets do "
                "not cross nodes: use a weight group (init_weight_group, collective)"
            )
        tid = task_id or self._orch.new_task_id("transfer", f"{from_stage}-{to_stage}")
        share_id, deadline_s = self._task(from_stage, "share", f"{tid}/share", timeout_s)
        shared = self._lifecycle(from_stage, ShareCall(share_id, bucket_bytes, deadline_s))
        source = shared.ranks[0].shared if 0 in shared.ranks else None
        if source is None:
            raise OmniCoreError(f"stage {from_stage!r} rank 0 shared no weights for task {tid!r}/share")
        return self.update_weights(to_stage, source, version=version, task_id=f"{tid}/update", timeout_s=timeout_s)

    def profile(
        self,
        stage: str,
        start: bool = True,
        prefix: str | None = None,
        *,
        task_id: str | None = None,
        timeout_s: float | None = None,
        wait_s: float | None = None,
    ) -> ProfileReport:
        """Start (`start=True`) or stop the profiler on every rank of `stage`; its state never
        changes, so a profile may span sleeps and wakes. A stop's report lists each rank's
        trace (`{stage}-rank{r}-{prefix}-{time}.json.gz` in the stage's `profile_dir`); the
        ranks compress them after answering. `wait_s`: also wait up to that long until every
        listed file exists (ranks on this host), else raise naming the missing ones. Ranks
        that refuse raise `ProfileRefusedError` (the others' paths in its `report`)."""
        if type(start) is not bool:
            raise InvalidArgumentError(f"profile start must be True or False, got {start!r}")
        if wait_s is not None and not (isinstance(wait_s, (int, float)) and wait_s >= 0):
            raise InvalidArgumentError(f"wait_s must be a number of seconds >= 0 or None, got {wait_s!r}")
        tid, deadline_s = self._task(stage, "profile", task_id, timeout_s)
        report = self._lifecycle(stage, ProfileCall(tid, start, prefix, deadline_s))
        if wait_s is not None:
            missing = report.wait_for_files(wait_s)
            if missing:
                raise OmniCoreError(
                    f"stage {stage!r}: traces {list(missing)} not written within {wait_s} s "
                    "(their ranks compress them in the background; a rank on another host "
                    "writes them there); wait longer or check the ranks' logs"
                )
        return report

    def reset_prefix_cache(
        self, stage: str, *, task_id: str | None = None, timeout_s: float | None = None
    ) -> LifecycleReport:
        """Every rank drops what its runner caches across requests (vLLM's prefix KV blocks, a
        diffusion runner's prompt embeddings), releasing and remapping nothing: later requests
        compute afresh (after a weight update, say). The state never changes. Legal in RUNNING,
        PAUSED and PARTIAL; elsewhere, or when a rank refuses, InvalidArgumentError."""
        tid, deadline_s = self._task(stage, "reset_prefix_cache", task_id, timeout_s)
        return self._lifecycle(stage, CommandCall(ResetPrefixCache(task_id=tid, epoch=0), deadline_s))

    def save_weights(
        self,
        stage: str,
        directory: str,
        *,
        overwrite: bool = False,
        max_file_bytes: int = DEFAULT_SAVE_FILE_BYTES,
        task_id: str | None = None,
        timeout_s: float | None = None,
    ) -> LifecycleReport:
        """Every rank writes the weights it holds now, at the stage's weights version, to
        `directory` (vLLM's save_sharded_state): a stage of one rank writes a checkpoint its runner
        loads (safetensors files of at most `max_file_bytes`, the model's config, an index naming
        the version and the checkpoint it derives from); of several, each rank writes
        `directory/rank-<r>`. Each rank writes beside the target and renames its directory in
        last: a save that fails leaves nothing under that name. An existing `directory` is
        refused unless `overwrite`. Legal where valid weights are awake (RUNNING, PAUSED,
        PARTIAL with 'weights' awake): asleep, InvalidArgumentError, nothing written; the
        state never changes. Once every rank saved, the stage's version lives in `directory`:
        a `restart` reloads it and comes back at that version (status: weights_source 'disk').
        A rank whose runner cannot save refuses UNSUPPORTED (InvalidArgumentError naming it).
        The path is the caller's: the HTTP server holds it to allowed_reload_sources first."""
        if not isinstance(directory, str) or "\x00" in directory or not os.path.isabs(directory):
            raise InvalidArgumentError(
                f"the save directory must be an absolute path without NUL characters, got {directory!r:.200}; "
                "nothing was sent"
            )
        if type(overwrite) is not bool:
            raise InvalidArgumentError(f"overwrite must be True or False, got {overwrite!r}")
        ranks = self._spec(stage).ranks
        tid, deadline_s = self._task(stage, "save_weights", task_id, timeout_s)
        command = SaveWeights(
            task_id=tid,
            epoch=0,
            directory=os.path.normpath(directory),
            ranks=ranks,
            max_file_bytes=max_file_bytes,
            overwrite=overwrite,
        )
        return self._lifecycle(stage, CommandCall(command, deadline_s))

    def pipeline(
        self, stages: Sequence[PipelineStage], *, request_id: str | None = None, timeout_s: float | None = None
    ) -> PipelineResult:
        """One request across `stages` in order (P-22): each stage's `export` moves to the next
        by a transfer over its ranks' buckets, each stage admitted by its own policy (a sleeping
        one queued or woken, a paused one queued); the last stage's output, with each hop's
        producer weights version. `omni_core.engine.pipeline` says how."""
        rid = request_id or self._orch.new_task_id("pipeline", stages[0].stage if stages else "-")
        return run_pipeline(self, stages, rid, timeout_s)

    def restart(self, stage: str, *, from_checkpoint: bool = False) -> RestartReport:
        """Replace the stage's rank processes with fresh ones under a new epoch, at the version
        the stage held: the fresh ranks reload the directory that version came from (a disk
        update's, a reload's source) and the stage comes back RUNNING at it. A version that
        came from memory (shm, CUDA IPC, a collective, a transfer) cannot come back: the stage
        comes back NEEDS_RELOAD with `version_floor` set, refusing requests until an update at
        or above the floor. `from_checkpoint=True` starts over from the checkpoint at version 0
        and says so (`version_reset_from`, the log, status)."""
        if type(from_checkpoint) is not bool:
            raise InvalidArgumentError(f"from_checkpoint must be True or False, got {from_checkpoint!r}")
        spec = self._spec(stage)
        call = Restart(spec.start_deadline_s, from_checkpoint=from_checkpoint)
        return self._wait(self._orch.submit(stage, call), spec.start_deadline_s)

    def set_admission(self, stage: str, policy: AdmissionPolicy | str) -> None:
        """Change what requests do while the stage is not RUNNING (queue, reject, wake)."""
        self._spec(stage)
        try:
            chosen = AdmissionPolicy(policy)
        except ValueError:
            raise InvalidArgumentError(
                f"admission {policy!r} is not one of {[p.value for p in AdmissionPolicy]}"
            ) from None
        self._wait(self._orch.submit(stage, SetAdmission(chosen)), 5.0)

    def status(self) -> dict[str, Any]:
        return self._wait(self._orch.submit(None, StatusQuery()), 5.0)

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Tell every rank to shut down, then stop the orchestrator. Safe to call twice."""
        if self._orch.closed:
            return
        future = self._orch.submit(None, ShutdownCall(timeout_s))
        with contextlib.suppress(EngineClosedError, FutureTimeout):
            future.result(timeout_s + WAIT_GRACE_S)
        self._orch.join(timeout_s + WAIT_GRACE_S)

    # ------------------------------------------------------------------ internals

    def _spec(self, stage: str) -> StageSpec:
        try:
            return self._specs[stage]
        except KeyError:
            raise InvalidArgumentError(f"unknown stage {stage!r}; stages are {sorted(self._specs)}") from None

    def _task(self, stage: str, kind: str, task_id: str | None, timeout_s: float | None) -> tuple[str, float]:
        """A lifecycle call's task id (the caller's, else a fresh one) and deadline."""
        spec = self._spec(stage)
        deadline_s = self._deadline_s(spec.deadline_s, timeout_s)
        return task_id or self._orch.new_task_id(kind, stage), deadline_s

    @overload
    def _lifecycle(self, stage: str, event: ReportCall) -> LifecycleReport: ...
    @overload
    def _lifecycle(self, stage: str, event: ProfileCall) -> ProfileReport: ...
    def _lifecycle(self, stage: str, event: LifecycleCall) -> LifecycleReport | ProfileReport:
        """Queue the typed input for the stage's core and wait for its outcome."""
        return self._wait(self._orch.submit(stage, event), event.deadline_s + self._specs[stage].request_timeout_s)

    @staticmethod
    def _deadline_s(default_s: float, timeout_s: float | None) -> float:
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise InvalidArgumentError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        return default_s if timeout_s is None else float(timeout_s)

    def _wait(self, future: Future[T], budget_s: float) -> T:
        try:
            return future.result(budget_s + WAIT_GRACE_S)
        except FutureTimeout:
            raise OmniCoreError(
                f"no answer from the orchestrator within {budget_s + WAIT_GRACE_S:.1f} s; "
                "its deadlines should have fired: this is a bug, please report it"
            ) from None


def _checked_source(source: object) -> WeightSource:
    """The source as the wire will carry it: every bound checked here, so a bad one is the
    caller's InvalidArgumentError and never a rank's BAD_MESSAGE."""
    try:
        probe = msgspec.convert(msgspec.to_builtins({"source": source}), _SourceProbe)
    except (msgspec.ValidationError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"weight source {type(source).__name__}: {exc}; build it with "
            "omni_core.weights_sender.WeightSender or DiskSource(path=...)"
        ) from None
    return probe.source


class _SourceProbe(msgspec.Struct, forbid_unknown_fields=True):
    source: WeightSource


def make_launcher(
    launcher: RankLauncher | str | None, ray_address: str | None = "auto", ray_namespace: str | None = None
) -> RankLauncher:
    if launcher is None or launcher == "local":
        return LocalLauncher()
    if launcher == "ray":
        from omni_core.engine.ray_launcher import RayLauncher  # Ray is an optional extra

        return RayLauncher(ray_address, namespace=ray_namespace)
    if isinstance(launcher, str):
        raise InvalidArgumentError(f"launcher {launcher!r} is not 'local' or 'ray' (or a RankLauncher object)")
    return launcher


class AsyncEngine:
    """`Engine` for asyncio: `async with AsyncEngine(specs) as engine: await engine.sleep(...)`."""

    def __init__(self, specs: Iterable[StageSpec], **engine_kwargs: Any) -> None:
        self._specs = list(specs)
        self._kwargs = engine_kwargs  # Engine's keyword arguments, checked when it starts
        self._engine: Engine | None = None

    async def __aenter__(self) -> AsyncEngine:
        self._engine = await asyncio.to_thread(Engine, self._specs, **self._kwargs)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise EngineClosedError("use `async with AsyncEngine(specs) as engine:` to start it")
        return self._engine

    async def execute(
        self,
        stage: str,
        payload: Any = None,
        *,
        timeout_s: float | None = None,
        with_version: bool = False,
        adapter: str | None = None,
    ) -> Any | ExecuteResult:
        future = self.engine.submit(stage, payload, timeout_s=timeout_s, with_version=with_version, adapter=adapter)
        return await asyncio.wrap_future(future)

    async def sleep(
        self, stage: str, level: int = 1, tags: Iterable[str] | str | None = None, **kwargs: Any
    ) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.sleep, stage, level, tags, **kwargs)

    async def wake(self, stage: str, tags: Iterable[str] | str | None = None, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.wake, stage, tags, **kwargs)

    async def pause(self, stage: str, mode: str = "wait", **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.pause, stage, mode, **kwargs)

    async def resume(self, stage: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.resume, stage, **kwargs)

    async def is_paused(self, stage: str) -> bool:
        return await asyncio.to_thread(self.engine.is_paused, stage)

    async def swap(self, out_stage: str, in_stage: str, **kwargs: Any) -> SwapReport:
        return await asyncio.to_thread(self.engine.swap, out_stage, in_stage, **kwargs)

    async def reload_weights(self, stage: str, source: str | None = None, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.reload_weights, stage, source, **kwargs)

    async def update_weights(self, stage: str, source: WeightSource | str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.update_weights, stage, source, **kwargs)

    async def transfer_weights(self, from_stage: str, to_stage: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.transfer_weights, from_stage, to_stage, **kwargs)

    async def init_weight_group(self, stage: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.init_weight_group, stage, **kwargs)

    async def profile(self, stage: str, start: bool = True, prefix: str | None = None, **kwargs: Any) -> ProfileReport:
        return await asyncio.to_thread(self.engine.profile, stage, start, prefix, **kwargs)

    async def reset_prefix_cache(self, stage: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.reset_prefix_cache, stage, **kwargs)

    async def save_weights(self, stage: str, directory: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.save_weights, stage, directory, **kwargs)

    async def add_adapter(self, stage: str, name: str, source: str | None = None, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.add_adapter, stage, name, source, **kwargs)

    async def remove_adapter(self, stage: str, name: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.remove_adapter, stage, name, **kwargs)

    async def pin_adapter(self, stage: str, name: str, pinned: bool = True, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.pin_adapter, stage, name, pinned, **kwargs)

    async def list_adapters(self, stage: str, **kwargs: Any) -> LifecycleReport:
        return await asyncio.to_thread(self.engine.list_adapters, stage, **kwargs)

    async def restart(self, stage: str, *, from_checkpoint: bool = False) -> RestartReport:
        return await asyncio.to_thread(self.engine.restart, stage, from_checkpoint=from_checkpoint)

    async def set_admission(self, stage: str, policy: AdmissionPolicy | str) -> None:
        await asyncio.to_thread(self.engine.set_admission, stage, policy)

    async def status(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.engine.status)

    async def shutdown(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.shutdown)


def _output_of(answered: Future[ExecuteResult]) -> Future[Any]:
    """A future of the request's output alone, from one of its `ExecuteResult`."""
    output: Future[Any] = Future()

    def done(settled: Future[ExecuteResult]) -> None:
        if output.done():
            return  # the caller cancelled its future: nobody waits for the output
        error = settled.exception()
        if error is not None:
            output.set_exception(error)
        else:
            output.set_result(settled.result().output)

    answered.add_done_callback(done)
    return output
