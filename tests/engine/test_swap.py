"""Engine.swap on CPU: two stages on one simulated device (P-16). The incoming stage maps only
what the device has free, so the two never hold more than its capacity together; when the
memory never frees up the swap fails naming who holds it, and both stages are exactly where
the error says."""

from __future__ import annotations

import os
import threading

import pytest

from omni_core.engine import Engine, InvalidArgumentError, NoMemoryError, SwapFailedError
from omni_core.engine.errors import TaskAbandonedError
from omni_core.formal import trace_check
from omni_core.formal.tlc import TlcNotFoundError
from omni_core.fsm.trace_records import ENGINE_RANK, StageIssued, TaskEnded
from omni_core.trace import read_trace
from omni_core.workers.simulated_device import SimulatedDevice

from .conftest import PROBE, MiB, in_thread, small_spec, wait_for

# Level 1 keeps 2 MiB of weights per stage on the host; the device fits one stage and a half.
STAGE_BYTES_BOUND = 3 * MiB  # each stage's resident bytes stay below this (weights, KV, buffers)


class Sampler:
    """Reads the simulated device's used bytes in a loop until stopped; keeps the largest."""

    def __init__(self, device: SimulatedDevice) -> None:
        self.device, self.peak_bytes, self.samples = device, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, self.device.used_bytes())
            self.samples += 1

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _used_by(device: SimulatedDevice, stage: str) -> int:
    return sum(h.nbytes for h in device.read()[0] if h.label.startswith(f"stage {stage} "))


@pytest.fixture
def device(tmp_path) -> SimulatedDevice:
    # Both stages load ACTIVE before the test puts one to sleep: the capacity only binds wakes.
    return SimulatedDevice(str(tmp_path / "gpu0"), int(1.5 * STAGE_BYTES_BOUND))


def test_swap_moves_the_device_from_one_stage_to_the_other_within_its_capacity(device):
    specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs) as engine:
        decoder_output = engine.execute("decoder", PROBE)
        engine.sleep("decoder")
        talker_output = engine.execute("talker", PROBE)
        talker_bytes = _used_by(device, "talker")
        assert 0 < talker_bytes < STAGE_BYTES_BOUND and device.used_bytes() == talker_bytes
        with Sampler(device) as sampler:
            report = engine.swap("talker", "decoder", task_id="swap-1")
        assert sampler.samples > 0 and sampler.peak_bytes <= device.capacity_bytes
        assert (report.outgoing.state, report.incoming.state) == ("SLEEPING", "RUNNING")
        assert report.outgoing.task_id == "swap-1/out" and report.incoming.task_id == "swap-1/in"
        assert report.duration_s >= max(report.outgoing.duration_s, report.incoming.duration_s) * 0.5
        assert _used_by(device, "talker") == 0 and _used_by(device, "decoder") > 0
        assert engine.execute("decoder", PROBE) == decoder_output  # restored bit-exact

        # And back, twice: the device changes hands each time, outputs unchanged.
        for k in range(2):
            with Sampler(device) as sampler:
                engine.swap("decoder", "talker", task_id=f"back-{k}")
            assert sampler.peak_bytes <= device.capacity_bytes
            assert engine.execute("talker", PROBE) == talker_output
            engine.swap("talker", "decoder", task_id=f"forth-{k}")
            assert engine.execute("decoder", PROBE) == decoder_output

        # The same task id again: both recorded outcomes, nothing sent.
        again = engine.swap("talker", "decoder", task_id="swap-1")
        assert (again.outgoing, again.incoming) == (report.outgoing, report.incoming)


def test_a_swap_whose_memory_never_frees_fails_naming_the_holder_and_leaves_both_stages_exact(device):
    specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs) as engine:
        engine.sleep("decoder")
        # A third process holds almost the whole device: the talker leaving is not enough.
        device.write("trainer", 0, os.getpid(), device.capacity_bytes - MiB // 2)
        try:
            with pytest.raises(SwapFailedError) as caught:
                engine.swap("talker", "decoder", task_id="swap-x", memory_wait_s=0.5)
        finally:
            device.remove("trainer", 0, os.getpid())
        error = caught.value
        assert isinstance(error.incoming, NoMemoryError) and set(error.incoming.refusals) == {0}
        assert f"stage trainer rank 0, pid {os.getpid()}" in str(error.incoming)
        assert "To fix: free what the holders keep" in str(error.incoming)  # and what to type
        assert error.outgoing.state == "SLEEPING"
        assert "incoming stage 'decoder'" in str(error) and "stays SLEEPING" in str(error)
        status = engine.status()
        assert status["talker"]["state"] == status["decoder"]["state"] == "SLEEPING"
        assert _used_by(device, "decoder") == 0  # what its wake mapped was unmapped again
        # Once the memory is free the decoder wakes; nothing was lost.
        assert engine.wake("decoder").state == "RUNNING"
        engine.execute("decoder", PROBE)


def test_a_plain_wake_refused_for_memory_leaves_the_stage_asleep_at_its_version_then_wakes(device):
    """A wake with no wait (memory_wait_s 0, the default) that every rank refuses NO_MEMORY after
    rolling back changed nothing: the stage is SLEEPING at its version, the refusal names the
    holder, and the same wake succeeds once the memory is free, on the weights it slept with."""
    with Engine([small_spec("talker", simulated_device=device)]) as engine:
        assert engine.update_weights("talker", "seed:9", version=3).weights_version == 3
        before = engine.execute("talker", PROBE)
        engine.sleep("talker")
        device.write("trainer", 0, os.getpid(), device.capacity_bytes - MiB // 2)
        try:
            for tags in (None, ["weights"]):
                with pytest.raises(NoMemoryError) as caught:
                    engine.wake("talker", tags)
                assert set(caught.value.refusals) == {0}
                assert f"stage trainer rank 0, pid {os.getpid()}" in str(caught.value)
                status = engine.status()["talker"]
                assert (status["state"], status["weights_version"], status["failure"]) == ("SLEEPING", 3, "")
                assert _used_by(device, "talker") == 0
        finally:
            device.remove("trainer", 0, os.getpid())
        report = engine.wake("talker")
        assert (report.state, report.weights_version) == ("RUNNING", 3)
        assert engine.execute("talker", PROBE) == before


def test_swap_arguments_are_checked_before_anything_is_sent(device):
    specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs) as engine:
        for args, kwargs, what in [
            (("talker", "talker"), {}, "two stages"),
            (("talker", "nobody"), {}, "unknown stage"),
            (("talker", "decoder"), {"level": 3}, "level"),
            (("talker", "decoder"), {"timeout_s": 10.0, "memory_wait_s": 10.0}, "memory_wait_s"),
            (("talker", "decoder"), {"memory_wait_s": float("nan")}, "memory_wait_s"),
            # Below the deadline but past the protocol's limit: still named as the caller's parameter.
            (("talker", "decoder"), {"timeout_s": 10_000.0, "memory_wait_s": 4000.0}, "memory_wait_s must be"),
        ]:
            with pytest.raises(InvalidArgumentError, match=what):
                engine.swap(*args, **kwargs)
        status = engine.status()
        assert status["talker"]["state"] == status["decoder"]["state"] == "RUNNING"
        # An incoming stage that is already awake: its half is ALREADY, the other sleeps. A long
        # deadline's default memory wait (half of it) is capped at the protocol's limit.
        report = engine.swap("talker", "decoder", timeout_s=10_000.0)
        assert (report.outgoing.state, report.incoming.status) == ("SLEEPING", "ALREADY")


def test_two_swaps_into_one_device_take_turns_one_incoming_wake_at_a_time(device, tmp_path):
    """Two incoming wakes on one device can both hold part of themselves and both be refused
    (tla/OmniSwap.tla, NotBothRefused): the second swap waits until the first's wake ended."""
    trace = tmp_path / "trace.jsonl"
    specs = [small_spec(name, simulated_device=device) for name in ("talker", "decoder")]
    with Engine(specs, trace_path=str(trace)) as engine:
        talker_output = engine.execute("talker", PROBE)
        engine.sleep("decoder")
        # A third process holds the device: the first swap's incoming wake waits, in flight.
        device.write("trainer", 0, os.getpid(), device.capacity_bytes - MiB // 2)
        try:
            first = in_thread(
                lambda: engine.swap("talker", "decoder", task_id="swap-1", timeout_s=60.0, memory_wait_s=30.0)
            )
            wait_for(lambda: engine.status()["decoder"]["task_id"] == "swap-1/in", what="the first swap's wake")
            # A swap into the same device waits for it, and is refused at its own deadline
            # naming the swap it waited for; nothing of it was sent.
            with pytest.raises(
                TaskAbandonedError,
                match=r"swap 'swap-late' did not start within its deadline .*"
                r"incoming wake of swap 'swap-1' into stage 'decoder'",
            ):
                engine.swap("decoder", "talker", task_id="swap-late", timeout_s=1.0)
            second = in_thread(lambda: engine.swap("decoder", "talker", task_id="swap-2", timeout_s=60.0))
            wait_for(
                lambda: [w["swap"] for w in engine.status()["talker"]["swaps_waiting"]] == ["swap-2"],
                what="the second swap waiting for the device",
            )
            assert not first.done() and not second.done()
        finally:
            device.remove("trainer", 0, os.getpid())
        one, two = first.result(90), second.result(90)
        assert (one.outgoing.state, one.incoming.state) == ("SLEEPING", "RUNNING")  # the device held the decoder
        assert (two.outgoing.state, two.incoming.state) == ("SLEEPING", "RUNNING")  # then the talker
        assert engine.status()["talker"]["swaps_waiting"] == []
        assert engine.execute("talker", PROBE) == talker_output
    engine_lines = [line for line in read_trace(trace) if line.rank == ENGINE_RANK]
    order = [
        (type(line.record).__name__, line.record.task_id)
        for line in engine_lines
        if isinstance(line.record, (StageIssued, TaskEnded)) and line.record.task_id.startswith("swap")
    ]
    assert not any(task.startswith("swap-late") for _, task in order)  # never issued
    assert order.index(("TaskEnded", "swap-1/in")) < order.index(("StageIssued", "swap-2/out"))
    # The second swap went out with what was left of its deadline: the trace checker (TLC)
    # accepts every stage's replay, the late issue's deadline included.
    try:
        verdicts = trace_check.validate_records(read_trace(trace))
    except TlcNotFoundError as exc:
        pytest.skip(str(exc))
    assert verdicts and all(v.accepted for v in verdicts), [v.line() for v in verdicts]
