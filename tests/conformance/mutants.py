"""Deliberately broken workers: this project's worker with one fault each (and a correct
variant that declares fewer capabilities).

The suite must catch every one, over the wire, with the requirement named in `MUTANTS`.
Each is started exactly as a third party's worker would be, through a factory:

    python tests/conformance/mutants.py NAME --address ADDR --rank R --epoch E
    python tests/conformance/mutants.py --score     # the mutation-score table of docs/conformance.md

and the module-level factories (`no_reply_cache`, ...) are what the suite is given, by
import path or as a callable. This module imports no worker code at import time (only in
the child process), so the suite sees the mutant only as a process on a socket.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

# name -> (requirement that must catch it, what is broken)
MUTANTS: dict[str, tuple[str, str]] = {
    "no_reply_cache": ("P-2", "no reply cache: a repeated task_id is executed again"),
    "ack_before_release": ("P-12", "Sleep is acknowledged before the memory is released"),
    "rank0_only": ("P-1", "only rank 0 replies; other ranks act silently"),
    "crash_on_second_sleep": ("P-4", "a Sleep to a sleeping worker kills the process (torch_memory_saver)"),
    "execute_while_sleeping": ("P-7", "Execute is handed to the model in any state"),
    "garbage_kills_loop": ("P-10", "undecodable bytes end the loop and the process"),
    "stale_epoch_accepted": ("P-6", "commands from older epochs are served"),
    "level2_wakes_active": ("P-8", "a Wake after a level-2 sleep says ACTIVE (weights not marked invalid)"),
    "wrong_version_accepted": ("P-3", "messages of another protocol version are served"),
    "double_reply": ("P-1", "every reply is sent twice"),
    "unknown_tag_half_applied": ("P-11", "a Sleep naming an unknown tag sleeps the known ones, then refuses"),
    # The escapes of the issue-17 audit, and more plausible slips.
    "ack_from_plan": ("P-12", "the Sleep Ack reports the plan's empty pools; the release waits for the next command"),
    "nvml_on_cpu": ("P-12", "the host's used memory reported as the process's own NVML figure"),
    "status_clears_cache": ("P-2", "a Status empties the reply cache"),
    "tiny_reply_cache": ("P-2", "a reply cache of 4 entries"),
    "crash_on_shutdown_asleep": ("P-11", "Shutdown while asleep kills the process (only ever tried in ACTIVE)"),
    "wake_unknown_tag_already": ("P-11", "a Wake drops tags it does not know; of nothing known, it ACKs ALREADY"),
    "status_wakes": ("P-11", "a Status of a sleeping worker wakes it first, to report fresh figures"),
    "invalid_utf8_detail": ("P-10", "a BAD_MESSAGE refusal echoes the bad bytes in its detail (invalid UTF-8)"),
    "silent_sleep_already": ("P-4", "a Sleep of tags all asleep is dropped without a reply"),
    "execute_in_partial": ("P-7", "Execute runs whenever the weights are resident, PARTIAL included"),
    "newer_epoch_not_adopted": ("P-6", "a newer epoch is served but not adopted"),
    "no_epoch_window": ("P-13", "any epoch ahead is adopted, however far"),
    "bad_source_fails": ("P-13", "an unusable reload source fails the worker instead of being refused"),
    "task_id_reuse_served": ("P-2", "the reply cache keys on task_id alone: another command gets the old reply"),
    "no_hello_proof": ("P-14", "the Hello carries no proof"),
    "bad_message_no_task_id": ("P-10", "BAD_MESSAGE refusals never name the task, even when it is readable"),
    "shutdown_exits_nonzero": ("P-4", "the process exits with status 1 after acknowledging Shutdown"),
    "status_without_memory": ("P-12", "the Status Ack carries no memory report"),
    "version_detail_one_version": ("P-3", "UNSUPPORTED_VERSION's detail names only the worker's own version"),
    # The swap's wake (P-16), run on a simulated device the suite fills (pressure() below).
    "wake_ignores_free_memory": ("P-16", "a Wake maps without asking the device: full, the map fails, FAILED"),
    "swap_refuses_wait": ("P-16", "declares 'swap' but refuses every Wake with memory_wait_s > 0 (UNSUPPORTED)"),
    "no_memory_left_restoring": ("P-16", "the NO_MEMORY refusal is sent, but the worker stays RESTORING"),
    "no_memory_not_cached": ("P-16", "a NO_MEMORY refusal is not kept: a copy sent once memory is free wakes"),
    "no_memory_keeps_mapped": ("P-16", "a refused wake leaves what it mapped mapped (no rollback)"),
    # The conformance escapes of the issue-25 audit.
    "reload_refused_zeroes": ("P-13", "a refused bad-source reload in ACTIVE zeroes the weights first"),
    "hello_other_pid": ("P-14", "the Hello names its parent's pid, with a valid proof over that pid"),
    "profile_wakes": ("P-15", "a Profile start while asleep wakes the worker first"),
    "no_memory_early": ("P-16", "a wake that may wait under 1 s gives up after 10 ms"),
    "epoch_window_5000": ("P-13", "an epoch up to 5000 ahead is adopted (the window is 64)"),
    "stale_version_accepted": ("P-17", "an UpdateWeights to a version not above the held one is applied"),
    # The weight-version escapes of the issue-37 audit, and the rules beside them.
    "update_refused_partial": ("P-17", "UpdateWeights refused in PARTIAL although 'weights' is awake"),
    "update_refused_needs_reload": ("P-17", "UpdateWeights refused in NEEDS_RELOAD (only a reload leaves it)"),
    "update_weights_asleep": ("P-17", "UpdateWeights accepted in PARTIAL with 'weights' asleep"),
    "reload_keeps_version": ("P-17", "a reload reports the last update's version instead of 0"),
    "stale_host_copy": ("P-17", "a level-1 wake after an update restores the host copy of the old weights"),
    "result_version_zero": ("P-17", "Results carry weights version 0 after an update"),
    "nack_version_zero": ("P-17", "Nacks carry weights version 0 after an update"),
    "hello_claims_version": ("P-17", "the Hello of a worker just started claims weights version 7"),
    "update_unchecked_names": ("P-17", "an update's tensor names, shapes and dtypes are not checked before writing"),
    "share_while_asleep": ("P-17", "ShareWeights is attempted with the weights asleep"),
    "links_without_multi_path": ("P-18", "a Sleep or Wake with links is obeyed (on its own link) without 'multi_path'"),
    "reset_refused_partial": ("P-19", "ResetPrefixCache refused in PARTIAL"),
    "adapter_ignored": ("P-20", "an Execute naming an adapter not held runs without it"),
    "adapter_any_base": ("P-20", "an adapter made for other base weights is loaded as if rebound"),
    "adapter_tensors_unchecked": ("P-20", "an adapter's tensors are written without checking that every one is sent"),
    # Pause mode keep (P-23).
    "hold_anywhere": ("P-23", "a HoldRequests outside ACTIVE is acknowledged: nothing runs there, nothing to hold"),
    "hold_never_already": ("P-23", "a second hold (or release) is acknowledged OK, never ALREADY"),
    "held_result_start_version": (
        "P-23",
        "a request held through an update names the version it started under, and no spans",
    ),
    "held_requests_stepped": ("P-23", "the rank's loop steps held requests on (it never asks whether they are held)"),
}
# Mutants whose fault shows only where the runner really freezes its requests: started with the
# runner of tests/conformance/hold_runner.py and its token payload.
HELD_RUNNER_MUTANTS = {"held_result_start_version", "held_requests_stepped"}

# The same faults in a worker written in another language (node_worker/worker.js, --bug NAME),
# started over `cmd:` like any third party's: the suite knows nothing of its insides.
NODE_MUTANTS: dict[str, tuple[str, str]] = {
    "node_tiny_reply_cache": ("P-2", "JavaScript worker: a reply cache of 4 entries"),
    "node_wake_unknown_tag_already": ("P-11", "JavaScript worker: a Wake of an unknown tag ACKs ALREADY"),
    "node_crash_on_shutdown_asleep": ("P-11", "JavaScript worker: Shutdown while asleep kills the process"),
}
MUTANTS.update(NODE_MUTANTS)
NODE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "node_worker", "worker.js")
NODE_ARGS = "--address {address} --rank {rank} --epoch {epoch}"


def node_target(bug: str = "", *, fail_start: bool = False) -> str:
    """The JavaScript worker as a `cmd:` target (node on PATH)."""
    extra = (f" --bug {bug}" if bug else "") + (" --fail-start" if fail_start else "")
    return f"cmd:node {NODE_WORKER} {NODE_ARGS}{extra}"


def target(name: str) -> Any:
    """What the suite is given for mutant `name`: a factory, or a `cmd:` string."""
    if name in NODE_MUTANTS:
        return node_target(name.removeprefix("node_"))
    return factory(name)


# Correct workers with fewer features: the suite must pass them, reporting skips.
VARIANTS: dict[str, str] = {
    "no_capabilities": "declares no capabilities (no level2, no partial_wake) and refuses what they cover",
}

MUTANT_SCRIPT = os.path.abspath(__file__)
CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(MUTANT_SCRIPT)))


def _hold_runner() -> Any:
    """tests/conformance/hold_runner.py, imported from the checkout (this module may run as a
    script, whose path is its own folder)."""
    if CHECKOUT not in sys.path:
        sys.path.insert(0, CHECKOUT)
    import importlib

    return importlib.import_module("tests.conformance.hold_runner")


def pressure(name: str) -> Callable[[], Any]:
    """The memory-pressure hooks for mutant `name`: the mutant, started on a simulated device
    the suite fills (as the built-in hook does for the reference worker)."""
    from omni_core.conformance.pressure import SimulatedPressure

    start = factory(name)

    def on_device(address: str, rank: int, epoch: int, device: Any) -> list[str]:
        return [
            *start(address, rank, epoch),
            "--simulated-device",
            device.directory,
            "--capacity-bytes",
            str(device.capacity_bytes),
        ]

    return lambda: SimulatedPressure(on_device)


def options(name: str, **fields: Any) -> Any:
    """The suite's options for mutant `name`: its own memory-pressure hook where it has one."""
    from omni_core.conformance import SuiteOptions

    if name not in NODE_MUTANTS:
        fields.setdefault("memory_pressure", pressure(name))
    if name in HELD_RUNNER_MUTANTS:
        fields.setdefault("execute_payload", _hold_runner().HOLD_PAYLOAD)
    return SuiteOptions(**fields)


def factory(name: str) -> Callable[[str, int, int], list[str]]:
    """How the suite starts mutant `name`: an argv, like any third-party worker."""
    if name in NODE_MUTANTS or (name not in MUTANTS and name not in VARIANTS):
        raise ValueError(f"unknown mutant {name!r}; known: {sorted(MUTANTS) + sorted(VARIANTS)}")

    def start(address: str, rank: int, epoch: int) -> list[str]:
        return [sys.executable, MUTANT_SCRIPT, name, "--address", address, "--rank", str(rank), "--epoch", str(epoch)]

    start.__qualname__ = f"mutant {name}"
    return start


no_reply_cache = factory("no_reply_cache")
ack_before_release = factory("ack_before_release")
rank0_only = factory("rank0_only")
crash_on_second_sleep = factory("crash_on_second_sleep")
execute_while_sleeping = factory("execute_while_sleeping")
garbage_kills_loop = factory("garbage_kills_loop")
stale_epoch_accepted = factory("stale_epoch_accepted")
level2_wakes_active = factory("level2_wakes_active")
wrong_version_accepted = factory("wrong_version_accepted")
double_reply = factory("double_reply")
unknown_tag_half_applied = factory("unknown_tag_half_applied")
no_capabilities = factory("no_capabilities")
tiny_reply_cache = factory("tiny_reply_cache")


# ---------------------------------------------------------------- the faults (child process only)


def _install(name: str) -> None:
    """Replace the worker's core or process class in this process by a faulty subclass."""
    import msgspec

    from omni_core.fsm import worker as fsm_worker
    from omni_core.fsm.effects import ExecuteEffect, SleepEffect
    from omni_core.fsm.worker import BadFrame, CommandReceived, EffectCompleted
    from omni_core.protocol import Hello, MemoryReport, NackReason, ProtocolError, Sleep, WorkerState, encode
    from omni_core.protocol.codec import decode_command
    from omni_core.protocol.messages import AnyCommand
    from omni_core.workers import process

    core_cls, process_cls = process.WorkerCore, process.WorkerProcess

    class _NoCache:
        max_entries = 1024
        max_bytes = 16 << 20
        size_bytes = 0

        def get(self, key: Any) -> None:
            return None

        def put(self, key: Any, value: Any, size_bytes: int = 0) -> None:
            return None

        def __contains__(self, key: object) -> bool:
            return False

        def __len__(self) -> int:
            return 0

    class NoReplyCacheCore(core_cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cache = _NoCache()

    class ExecuteAnywhereCore(core_cls):
        def _on_execute(self, command: Any) -> Any:
            self.work.begin(fsm_worker.PendingEffect(command))
            return fsm_worker.WorkerStep(effect=ExecuteEffect(command.task_id, command.payload))

        def _check_invariants(self) -> None:
            return None  # the real core would catch its own fault

    class StaleEpochCore(core_cls):
        def _on_command(self, command: Any) -> Any:
            if command.epoch < self.epoch:
                command = msgspec.structs.replace(command, epoch=self.epoch)
            return super()._on_command(command)

    class Level2ActiveCore(core_cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            residency = self.residency

            def apply_sleep(plan: Any) -> None:  # forgets that level 2 discarded the weights
                residency.asleep |= plan.offload | plan.discard

            residency.apply_sleep = apply_sleep

    class AckBeforeReleaseProcess(process_cls):
        def _perform(self, effect: Any) -> None:
            if not isinstance(effect, SleepEffect):
                return super()._perform(effect)
            usage = self._usage()
            memory = MemoryReport(
                pool_bytes_before=usage, pool_bytes_after=dict(usage), process_bytes_source="none: mutant"
            )
            self._send_all(self.core.step(EffectCompleted(effect.task_id, memory=memory)))
            self._apply(effect)  # the release happens only now
            return None

    class Rank0OnlyProcess(process_cls):
        def _send(self, message: Any) -> None:
            if self.config.rank == 0 or isinstance(message, Hello):
                super()._send(message)

    class DoubleReplyProcess(process_cls):
        def _send(self, message: Any) -> None:
            super()._send(message)
            if not isinstance(message, Hello):
                super()._send(message)

    class CrashOnSecondSleepProcess(process_cls):
        def handle(self, data: bytes) -> None:
            try:
                command = decode_command(data)
            except ProtocolError:
                command = None
            if isinstance(command, Sleep) and self.core.state is WorkerState.SLEEPING:
                os._exit(134)  # what torch_memory_saver does on a second pause
            super().handle(data)

    class GarbageKillsLoopProcess(process_cls):
        def handle(self, data: bytes) -> None:
            try:
                decode_command(data)
            except ProtocolError as err:
                raise SystemExit(f"cannot decode a message: {err}") from None
            super().handle(data)

    lenient = msgspec.msgpack.Decoder(AnyCommand)

    class WrongVersionProcess(process_cls):
        def handle(self, data: bytes) -> None:
            try:
                decode_command(data)
            except ProtocolError as err:
                if err.reason is NackReason.UNSUPPORTED_VERSION:
                    command = lenient.decode(data)
                    step = self.core.step(CommandReceived(command))
                    self._send_all(step)
                    if step.effect is not None:
                        self._perform(step.effect)
                    return
            super().handle(data)

    class HalfAppliedProcess(process_cls):
        muted = False

        def _send_all(self, step: Any) -> None:
            if not self.muted:
                super()._send_all(step)

        def handle(self, data: bytes) -> None:
            try:
                command = decode_command(data)
            except ProtocolError:
                command = None
            if isinstance(command, Sleep) and command.tags and set(command.tags) - set(self.config.tags):
                known = tuple(t for t in command.tags if t in self.config.tags)
                if known:
                    inner = msgspec.structs.replace(command, task_id=command.task_id[:100] + "-inner", tags=known)
                    self.muted = True
                    try:
                        step = self.core.step(CommandReceived(inner))
                        if step.effect is not None:
                            self._perform(step.effect)
                    finally:
                        self.muted = False
            super().handle(data)

    # ------------------------------------------------ the issue-17 audit's escapes, and more

    from omni_core.fsm.effects import ShutdownEffect, StatusEffect
    from omni_core.fsm.reply_cache import BoundedCache
    from omni_core.protocol import AckStatus, Nack, Shutdown, Status, Wake
    from omni_core.runners.base import RunnerArgumentError
    from omni_core.workers.accounting import MemoryFigure

    asleep_states = (WorkerState.SLEEPING, WorkerState.PARTIAL, WorkerState.NEEDS_RELOAD)

    def decoded(data: bytes) -> Any:
        try:
            return decode_command(data)
        except ProtocolError:
            return None

    class AckFromPlanProcess(process_cls):
        deferred: Any = None  # a release "in flight" that nothing waits for

        def _perform(self, effect: Any) -> None:
            if isinstance(effect, SleepEffect):
                usage = self._usage()
                gone = effect.offload | effect.discard
                planned = {t: 0 if t in gone else b for t, b in usage.items()}
                memory = MemoryReport(
                    pool_bytes_before=usage, pool_bytes_after=planned, process_bytes_source=self._figure().source
                )
                self.deferred = effect
                self._send_all(self.core.step(EffectCompleted(effect.task_id, memory=memory)))
                return None
            if self.deferred is not None and not isinstance(effect, StatusEffect):
                self._apply(self.deferred)
                self.deferred = None
            return super()._perform(effect)

    class NvmlOnCpuProcess(process_cls):
        def _figure(self) -> Any:
            with open("/proc/meminfo") as f:
                info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
            return MemoryFigure(info["MemTotal"] - info["MemAvailable"], "nvml")  # whole host, NVML's name

    class StatusClearsCacheCore(core_cls):
        def _on_status(self, command: Any) -> Any:
            self.cache = BoundedCache(self.cache.max_entries, self.cache.max_bytes)
            return super()._on_status(command)

    class TinyCacheCore(core_cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "reply_cache_entries": 4})

    class CrashOnShutdownAsleepProcess(process_cls):
        def handle(self, data: bytes) -> None:
            if isinstance(decoded(data), Shutdown) and self.core.state in asleep_states:
                os._exit(139)  # frees the host copy of the weights a second time
            super().handle(data)

    class WakeKnownTagsCore(core_cls):
        def _on_wake(self, command: Any) -> Any:
            if command.tags is not None:
                command = msgspec.structs.replace(command, tags=tuple(t for t in command.tags if t in self.tags))
            return super()._on_wake(command)

    class MutedProcess(process_cls):
        """Runs an inner command of its own whose replies nobody sees."""

        muted = False

        def _send_all(self, step: Any) -> None:
            if not self.muted:
                super()._send_all(step)

        def run_silently(self, command: Any) -> None:
            self.muted = True
            try:
                step = self.core.step(CommandReceived(command))
                if step.effect is not None:
                    self._perform(step.effect)
            finally:
                self.muted = False

    class StatusWakesProcess(MutedProcess):
        def handle(self, data: bytes) -> None:
            command = decoded(data)
            if isinstance(command, Status) and self.core.state in asleep_states and not self.core.busy:
                self.run_silently(Wake(task_id=command.task_id[:100] + "-refresh", epoch=command.epoch))
            super().handle(data)

    class InvalidUtf8DetailProcess(process_cls):
        marker = "@@not-utf8@@"

        def _send(self, message: Any) -> None:
            if isinstance(message, Nack) and message.reason is NackReason.BAD_MESSAGE:
                data = encode(msgspec.structs.replace(message, detail=self.marker))
                self.sock.send(data.replace(self.marker.encode(), b"\xff\xfe" + b"?" * (len(self.marker) - 2)))
                return
            super()._send(message)

    class SilentSleepAlreadyCore(core_cls):
        def _on_sleep(self, command: Any) -> Any:
            step = super()._on_sleep(command)
            replies = step.replies
            if replies and getattr(replies[0], "status", None) is AckStatus.ALREADY:
                return fsm_worker.WorkerStep()  # "nothing to do", so nothing said
            return step

    class ExecuteInPartialCore(core_cls):
        def _on_execute(self, command: Any) -> Any:
            if self.state is WorkerState.PARTIAL and "weights" not in self.residency.asleep:
                self.work.begin(fsm_worker.PendingEffect(command))
                return fsm_worker.WorkerStep(effect=ExecuteEffect(command.task_id, command.payload))
            return super()._on_execute(command)

        def _check_invariants(self) -> None:
            return None  # the real core would catch its own fault

    class EpochNotAdoptedCore(core_cls):
        def _on_command(self, command: Any) -> Any:
            epoch = self.epoch
            step = super()._on_command(command)
            self.epoch = epoch
            return step

    class BadSourceFailsProcess(process_cls):
        def _on_effect_error(self, effect: Any, exc: Exception) -> Any:
            if isinstance(exc, RunnerArgumentError):
                exc = RuntimeError(f"reload failed: {exc}")
            return super()._on_effect_error(effect, exc)

    class NoProofProcess(process_cls):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.rank_secret = None

    class NoTaskIdCore(core_cls):
        def _on_bad_message(self, error: Any) -> Any:
            error.task_id = None
            return super()._on_bad_message(error)

    class ExitsNonzeroProcess(process_cls):
        def _perform(self, effect: Any) -> None:
            super()._perform(effect)
            if isinstance(effect, ShutdownEffect):
                self.exit_code = 1

    class StatusWithoutMemoryProcess(process_cls):
        def _perform(self, effect: Any) -> None:
            if isinstance(effect, StatusEffect):
                self._send_all(self.core.step(EffectCompleted(effect.task_id)))
                return None
            return super()._perform(effect)

    class OneVersionProcess(process_cls):
        def handle(self, data: bytes) -> None:
            try:
                decode_command(data)
            except ProtocolError as err:
                if err.reason is NackReason.UNSUPPORTED_VERSION:
                    err.detail = "this protocol version is not supported"
                    self._send_all(self.core.step(BadFrame(err)))
                    return
            super().handle(data)

    # ------------------------------------------------ the swap's wake (P-16)

    from omni_core.fsm.effects import WakeEffect
    from omni_core.workers.backends.portable import PortableBackend
    from omni_core.workers.memory_gate import MemoryWaitExpired, WakeRefused

    class NoGateProcess(process_cls):
        def _gate(self, memory_wait_s: float) -> Any:
            return None  # "the device has room": never asked

    class RefusesWaitCore(core_cls):
        def _on_wake(self, command: Any) -> Any:
            if command.memory_wait_s > 0:
                return self._refuse(command, NackReason.UNSUPPORTED, "waiting for memory is not implemented")
            return super()._on_wake(command)

    class LeftRestoringProcess(process_cls):
        def _on_effect_error(self, effect: Any, exc: Exception) -> Any:
            if isinstance(exc, WakeRefused) and isinstance(effect, WakeEffect):
                # The answer is sent, the core never told: it stays RESTORING, its task pending.
                return fsm_worker.WorkerStep(
                    replies=(self.core._nack(self.core.work.pending.command, NackReason.NO_MEMORY, str(exc)),)
                )
            return super()._on_effect_error(effect, exc)

    class RefusalNotCachedCore(core_cls):
        def _remember(self, command: Any, reply: Any) -> None:
            if not (isinstance(reply, Nack) and reply.reason is NackReason.NO_MEMORY):
                super()._remember(command, reply)

    class StaleVersionCore(core_cls):
        def _on_update_weights(self, command: Any) -> Any:
            # The version fence forgotten: the check sees version 0, every update goes ahead.
            held, self.weights_version = self.weights_version, 0
            try:
                return super()._on_update_weights(command)
            finally:
                self.weights_version = held

        def _check_invariants(self) -> None:
            return None  # the real core would catch its own fault

    # ------------------------------------------------ the weight-version escapes (P-17) and P-18, P-19

    from omni_core.fsm.effects import ReloadEffect
    from omni_core.protocol import AddAdapter, ReloadWeights, ResetPrefixCache, Result
    from omni_core.workers import weight_receiver

    class UpdateRefusedPartialCore(core_cls):
        def _on_update_weights(self, command: Any) -> Any:
            if self.state is WorkerState.PARTIAL:
                return self._refuse_state(command, "UpdateWeights needs ACTIVE or NEEDS_RELOAD")
            return super()._on_update_weights(command)

    class UpdateRefusedNeedsReloadCore(core_cls):
        def _on_update_weights(self, command: Any) -> Any:
            if self.state is WorkerState.NEEDS_RELOAD:
                return self._refuse_state(command, "reload first: UpdateWeights needs ACTIVE or PARTIAL")
            return super()._on_update_weights(command)

    class WeightsLookAwakeCore(core_cls):
        """Residency asked of the wrong set: 'weights' looks awake whatever sleeps."""

        def _as_if_awake(self, handler: Any, command: Any) -> Any:
            asleep = self.residency.asleep
            self.residency.asleep = asleep - {"weights"}
            try:
                return handler(command)
            finally:
                self.residency.asleep = asleep

        def _check_invariants(self) -> None:
            return None  # the real core would catch its own fault

    class UpdateWeightsAsleepCore(WeightsLookAwakeCore):
        def _on_update_weights(self, command: Any) -> Any:
            return self._as_if_awake(super()._on_update_weights, command)

    class ShareWhileAsleepCore(WeightsLookAwakeCore):
        def _on_share_weights(self, command: Any) -> Any:
            return self._as_if_awake(super()._on_share_weights, command)

    class ReloadKeepsVersionCore(core_cls):
        def _settle(self, pending: Any, *settled: Any) -> None:
            held = self.weights_version
            super()._settle(pending, *settled)
            if isinstance(pending.command, ReloadWeights):
                self.weights_version = held  # "the weights were replaced": the last version stands

    class LinksObeyedCore(core_cls):
        def _on_sleep(self, command: Any) -> Any:
            return super()._on_sleep(msgspec.structs.replace(command, links=()))

        def _on_wake(self, command: Any) -> Any:
            return super()._on_wake(msgspec.structs.replace(command, links=()))

    class ResetRefusedPartialCore(core_cls):
        def _on_call(self, command: Any) -> Any:
            if isinstance(command, ResetPrefixCache) and self.state is WorkerState.PARTIAL:
                return self._refuse_state(command, "ResetPrefixCache needs ACTIVE")
            return super()._on_call(command)

    class AdapterIgnoredCore(core_cls):
        def _on_execute(self, command: Any) -> Any:
            return super()._on_execute(msgspec.structs.replace(command, adapter=None))

    class AdapterAnyBaseCore(core_cls):
        def _on_adapter(self, command: Any) -> Any:
            if isinstance(command, AddAdapter):
                command = msgspec.structs.replace(command, rebind=True)
            return super()._on_adapter(command)

    class StaleHostCopyProcess(process_cls):
        """A host copy of the weights made at the first sleep, reused at every wake, dropped by a
        reload but not by an update (the fast backend's clean copy, not invalidated)."""

        clean: list[Any] | None = None

        def _apply(self, effect: Any) -> Any:
            import torch

            weights = self.runner.weights if self.runner is not None else []
            if isinstance(effect, SleepEffect) and "weights" in effect.offload and self.clean is None:
                self.clean = [w.detach().clone() for w in weights]
            if isinstance(effect, ReloadEffect):
                self.clean = None
            result = super()._apply(effect)
            if isinstance(effect, WakeEffect) and "weights" in effect.tags and self.clean is not None:
                with torch.no_grad():
                    for w, copy in zip(weights, self.clean, strict=True):
                        w.copy_(copy)
            return result

    class VersionZeroProcess(process_cls):
        kinds: tuple[type, ...] = ()

        def _send(self, message: Any) -> None:
            if isinstance(message, self.kinds):
                message = msgspec.structs.replace(message, weights_version=0)
            super()._send(message)

    class ResultVersionZeroProcess(VersionZeroProcess):
        kinds = (Result,)

    class NackVersionZeroProcess(VersionZeroProcess):
        kinds = (Nack,)

    class HelloClaimsVersionProcess(process_cls):
        def _send(self, message: Any) -> None:
            if isinstance(message, Hello):
                message = msgspec.structs.replace(message, weights_version=7)
            super()._send(message)

    def wake_keeping_mapped(self: Any, tags: frozenset[str], gate: Any = None) -> None:
        try:
            original_wake(self, tags, gate)
        except MemoryWaitExpired:
            # "Rolled back" in the books only: the first allocation it mapped stays mapped.
            first = next(e for tag in sorted(tags) for e in self._storages.get(tag, {}).values())
            first.storage.resize_(first.nbytes)
            self._report(self._resident_total())
            raise

    # ------------------------------------------------ the issue-25 audit's escapes

    from omni_core.protocol import Profile
    from omni_core.protocol.auth import hello_proof

    class ReloadZeroesProcess(process_cls):
        def _apply(self, effect: Any) -> Any:
            if isinstance(effect, ReloadEffect) and self.runner is not None:
                for tensor in self.runner.weights:  # the synthetic runner's weight matrices
                    tensor.zero_()  # "cleared for the new weights", before the source was checked
            return super()._apply(effect)

    class HelloOtherPidProcess(process_cls):
        def _send(self, message: Any) -> None:
            if isinstance(message, Hello) and self.rank_secret is not None:
                cfg, pid = self.config, os.getppid()
                proof = hello_proof(
                    self.rank_secret, stage=cfg.stage, rank=cfg.rank, epoch=cfg.epoch, pid=pid, identity=self.identity
                )
                message = msgspec.structs.replace(message, pid=pid, proof=proof)
            super()._send(message)

    class ProfileWakesProcess(MutedProcess):
        def handle(self, data: bytes) -> None:
            command = decoded(data)
            if (
                isinstance(command, Profile)
                and command.start
                and self.core.state in asleep_states
                and not self.core.busy
            ):
                self.run_silently(Wake(task_id=command.task_id[:100] + "-warm", epoch=command.epoch))
            super().handle(data)

    class NoMemoryEarlyProcess(process_cls):
        def _gate(self, memory_wait_s: float) -> Any:
            # Short waits only: a long one still waits (and passes the suite's silence check).
            return super()._gate(0.01 if memory_wait_s < 1.0 else memory_wait_s)

    from omni_core.protocol import HoldRequests

    class HoldAnywhereCore(core_cls):
        def _on_hold(self, command: Any) -> Any:
            if not self.lifecycle.allows("hold_requests"):  # "no request runs here: nothing to hold"
                reply = self._ack(command, AckStatus.OK)
                self._remember(command, reply)
                return fsm_worker.WorkerStep(replies=(reply,))
            return super()._on_hold(command)

    class HoldNeverAlreadyCore(core_cls):
        def _already(self, command: Any, trigger: str) -> Any:
            if not isinstance(command, HoldRequests):
                return super()._already(command, trigger)
            self.lifecycle.fire(trigger)
            reply = self._ack(command, AckStatus.OK)  # "held (or released) as asked"
            self._remember(command, reply)
            return fsm_worker.WorkerStep(replies=(reply,))

    class HeldResultStartVersionProcess(process_cls):
        def _send(self, message: Any) -> None:
            if isinstance(message, Result) and message.version_spans:
                first = message.version_spans[0].weights_version  # the version it started under
                message = msgspec.structs.replace(message, weights_version=first, version_spans=())
            super()._send(message)

    class HeldSteppedProcess(process_cls):
        """Its loop never asks whether the requests are held: once the hold is acknowledged,
        they are stepped to their end, before any later frame is read."""

        def _frozen(self) -> bool:
            return False

        def _after_hold(self) -> None:
            super()._after_hold()
            self._finish_running(below=1)

    if name == "epoch_window_5000":
        fsm_worker.MAX_EPOCH_AHEAD = 5000
        return
    if name == "no_memory_keeps_mapped":
        original_wake = PortableBackend._wake
        PortableBackend._wake = wake_keeping_mapped
        return
    if name == "no_epoch_window":
        fsm_worker.MAX_EPOCH_AHEAD = 2**64
        return
    if name == "update_unchecked_names":
        weight_receiver.check_specs = lambda runner, specs: None  # every bucket written as it comes
        return
    if name == "adapter_tensors_unchecked":
        weight_receiver.check_adapter_specs = lambda runner, command, specs: None  # what comes is written
        return
    if name == "task_id_reuse_served":
        fsm_worker.command_digest = lambda command: b"task id only"
        return

    cores = {
        "no_reply_cache": NoReplyCacheCore,
        "execute_while_sleeping": ExecuteAnywhereCore,
        "stale_epoch_accepted": StaleEpochCore,
        "level2_wakes_active": Level2ActiveCore,
        "status_clears_cache": StatusClearsCacheCore,
        "tiny_reply_cache": TinyCacheCore,
        "wake_unknown_tag_already": WakeKnownTagsCore,
        "silent_sleep_already": SilentSleepAlreadyCore,
        "execute_in_partial": ExecuteInPartialCore,
        "newer_epoch_not_adopted": EpochNotAdoptedCore,
        "bad_message_no_task_id": NoTaskIdCore,
        "swap_refuses_wait": RefusesWaitCore,
        "no_memory_not_cached": RefusalNotCachedCore,
        "stale_version_accepted": StaleVersionCore,
        "update_refused_partial": UpdateRefusedPartialCore,
        "update_refused_needs_reload": UpdateRefusedNeedsReloadCore,
        "update_weights_asleep": UpdateWeightsAsleepCore,
        "share_while_asleep": ShareWhileAsleepCore,
        "reload_keeps_version": ReloadKeepsVersionCore,
        "links_without_multi_path": LinksObeyedCore,
        "reset_refused_partial": ResetRefusedPartialCore,
        "adapter_ignored": AdapterIgnoredCore,
        "adapter_any_base": AdapterAnyBaseCore,
        "hold_anywhere": HoldAnywhereCore,
        "hold_never_already": HoldNeverAlreadyCore,
    }
    processes = {
        "ack_before_release": AckBeforeReleaseProcess,
        "rank0_only": Rank0OnlyProcess,
        "double_reply": DoubleReplyProcess,
        "crash_on_second_sleep": CrashOnSecondSleepProcess,
        "garbage_kills_loop": GarbageKillsLoopProcess,
        "wrong_version_accepted": WrongVersionProcess,
        "unknown_tag_half_applied": HalfAppliedProcess,
        "ack_from_plan": AckFromPlanProcess,
        "nvml_on_cpu": NvmlOnCpuProcess,
        "crash_on_shutdown_asleep": CrashOnShutdownAsleepProcess,
        "status_wakes": StatusWakesProcess,
        "invalid_utf8_detail": InvalidUtf8DetailProcess,
        "bad_source_fails": BadSourceFailsProcess,
        "no_hello_proof": NoProofProcess,
        "shutdown_exits_nonzero": ExitsNonzeroProcess,
        "status_without_memory": StatusWithoutMemoryProcess,
        "version_detail_one_version": OneVersionProcess,
        "wake_ignores_free_memory": NoGateProcess,
        "no_memory_left_restoring": LeftRestoringProcess,
        "reload_refused_zeroes": ReloadZeroesProcess,
        "hello_other_pid": HelloOtherPidProcess,
        "profile_wakes": ProfileWakesProcess,
        "no_memory_early": NoMemoryEarlyProcess,
        "stale_host_copy": StaleHostCopyProcess,
        "result_version_zero": ResultVersionZeroProcess,
        "nack_version_zero": NackVersionZeroProcess,
        "hello_claims_version": HelloClaimsVersionProcess,
        "held_result_start_version": HeldResultStartVersionProcess,
        "held_requests_stepped": HeldSteppedProcess,
    }
    if name == "no_capabilities":
        PortableBackend.capabilities = ()
        PortableBackend.supports_memory_gate = False  # so no 'swap' either
    elif name in cores:
        process.WorkerCore = cores[name]
    elif name in processes:
        process.WorkerProcess = processes[name]
    else:  # pragma: no cover - MUTANTS and the tables above list the same names
        raise ValueError(f"no fault installed for {name!r}")


def score(parallel: int = 4) -> str:
    """Run the whole suite against every mutant and render the mutation-score table of
    docs/conformance.md: which cases catch each one (all of them, not only the named one)."""
    from concurrent.futures import ThreadPoolExecutor

    from omni_core.conformance import run_suite

    def one(name: str) -> tuple[str, list[str]]:
        # Its token requests wait for a hold: the other requirements' cases would wait them out.
        only = [MUTANTS[name][0]] if name in HELD_RUNNER_MUTANTS else None
        report = run_suite(target(name), only=only, options=options(name, reply_timeout_s=5.0))
        return name, [r.case.id for r in report.results if r.outcome == "fail"]

    with ThreadPoolExecutor(parallel) as pool:
        caught = dict(pool.map(one, MUTANTS))
    killed = sum(1 for cases in caught.values() if cases)
    lines = [
        f"Mutation score: **{killed} of {len(MUTANTS)}** mutants caught "
        f"({100 * killed / len(MUTANTS):.0f} %), each by the whole suite:",
        "",
        "| mutant | fault | failing cases (whole suite) | held to |",
        "|---|---|---|---|",
    ]
    for name, (req, fault) in MUTANTS.items():
        cases = ", ".join(f"`{c}`" for c in caught[name]) or "**not caught**"
        lines.append(f"| `{name}` | {fault} | {cases} | {req} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--score"]:
        print(score())
        return 0
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("name", choices=sorted(set(MUTANTS) - set(NODE_MUTANTS)) + sorted(VARIANTS))
    parser.add_argument("--address", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--epoch", type=int, default=0)
    parser.add_argument("--simulated-device", metavar="DIR", help="run on a simulated device in DIR (P-16)")
    parser.add_argument("--capacity-bytes", type=int, default=0, help="the simulated device's capacity")
    args = parser.parse_args(argv)

    from omni_core.conformance.targets import reference_worker
    from omni_core.workers.config import WorkerConfig
    from omni_core.workers.process import run_worker
    from omni_core.workers.simulated_device import SimulatedDevice

    _install(args.name)
    fields = reference_worker(args.address, args.rank, args.epoch)
    if args.name in HELD_RUNNER_MUTANTS:
        fields["runner"] = _hold_runner().RUNNER
    if args.simulated_device:
        fields["simulated_device"] = SimulatedDevice(args.simulated_device, args.capacity_bytes)
    config = WorkerConfig(**fields)
    return run_worker(config)


if __name__ == "__main__":
    sys.exit(main())
