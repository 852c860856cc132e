"""The start plan: stages' shares of each GPU added up before any rank starts, refused naming
the stages and the bytes (fake NVML tables; no GPU needed)."""

from __future__ import annotations

import os

import pytest

from omni_core.engine import Engine, StageSpec
from omni_core.engine import api as engine_api
from omni_core.engine.errors import InvalidArgumentError
from omni_core.engine.start_plan import plan_devices, start_plan_problem
from omni_core.workers.device_ledger import gpu_ledger_directory
from omni_core.workers.ledger_files import ENV_LEDGER_DIR
from omni_core.workers.simulated_device import SimulatedDevice
from tests.workers.test_accounting import GPU0, GPU1, FakeDevice, FakeNvml

GiB = 1 << 30


@pytest.fixture(autouse=True)
def ledger_dir(tmp_path, monkeypatch):
    """Every plan reads the GPUs' node ledgers: the test's own, never the machine's."""
    monkeypatch.setenv(ENV_LEDGER_DIR, str(tmp_path / "ledgers"))
    return tmp_path / "ledgers"


def other_engine_holds(uuid: str, nbytes: int, stage: str = "trainer") -> int:
    """A rank of another engine registered on the GPU's ledger: our parent process plays it
    (alive, and not this engine's own pid)."""
    pid = os.getppid()
    SimulatedDevice(gpu_ledger_directory(uuid), 80 * GiB).write(stage, 0, pid, nbytes)
    return pid


def cuda_stage(name: str, fraction: float, ranks: int = 1, devices: tuple[str, ...] | None = None) -> StageSpec:
    return StageSpec(name, ranks=ranks, device="cuda", gpu_memory_fraction=fraction, devices=devices)


def test_shares_of_one_device_entry_must_not_exceed_it() -> None:
    specs = [cuda_stage("llm", 0.6, devices=("0",)), cuda_stage("dit", 0.5, devices=("0",))]
    problem = start_plan_problem(specs, None, None)
    assert "CUDA_VISIBLE_DEVICES entry '0': gpu_memory_fraction adds up to 1.1" in problem
    assert "llm rank 0 (0.6)" in problem and "dit rank 0 (0.5)" in problem
    assert (
        start_plan_problem([cuda_stage("llm", 0.6, devices=("0",)), cuda_stage("dit", 0.4, devices=("1",))], None, None)
        == ""
    )


def test_an_index_and_a_uuid_of_one_gpu_are_one_device_through_nvml() -> None:
    nvml = FakeNvml([FakeDevice(GPU0), FakeDevice(GPU1)])
    specs = [cuda_stage("a", 0.7, devices=("0",)), cuda_stage("b", 0.4, devices=(GPU0,))]
    [device] = plan_devices(specs, None, nvml)
    assert device.name == GPU0 and [s.stage for s in device.shares] == ["a", "b"]
    assert "adds up to 1.1" in start_plan_problem(specs, None, nvml)


def test_what_other_processes_hold_counts_against_the_device() -> None:
    nvml = FakeNvml([FakeDevice(GPU0, processes={999: 30 * GiB})])
    problem = start_plan_problem([cuda_stage("rollout", 0.7)], None, nvml)
    assert "rollout rank 0 (0.7) want 56.0 GiB of 80.0 GiB" in problem
    assert "other processes hold 30.0 GiB there (free 50.0 GiB)" in problem
    assert start_plan_problem([cuda_stage("rollout", 0.6)], None, nvml) == ""


def test_tensor_parallel_ranks_open_their_local_rank_of_the_inherited_devices() -> None:
    nvml = FakeNvml([FakeDevice(GPU0), FakeDevice(GPU1)])
    planned = plan_devices([cuda_stage("tp", 0.9, ranks=2), cuda_stage("small", 0.2)], "0,1", nvml)
    assert {d.name: [(s.stage, s.rank) for s in d.shares] for d in planned} == {
        GPU0: [("tp", 0), ("small", 0)],
        GPU1: [("tp", 1)],
    }
    assert "tp rank 0 (0.9), small rank 0 (0.2)" in start_plan_problem(
        [cuda_stage("tp", 0.9, ranks=2), cuda_stage("small", 0.2)], "0,1", nvml
    )


def test_stages_without_a_fraction_and_cpu_stages_are_not_planned() -> None:
    assert plan_devices([StageSpec("cpu"), StageSpec("gpu", device="cuda")], None, None) == []


def test_the_engine_refuses_a_plan_before_any_rank_starts(monkeypatch) -> None:
    monkeypatch.setattr(engine_api, "check_start_plan", lambda specs, visible: "the stages do not fit their GPUs: x")
    monkeypatch.setattr(engine_api, "Orchestrator", pytest.fail)  # reached only if the plan let it through
    with pytest.raises(InvalidArgumentError, match="do not fit their GPUs"):
        Engine([StageSpec("s")])


def test_other_engines_holdings_in_the_ledger_count_where_nvml_lists_no_process() -> None:
    nvml = FakeNvml([FakeDevice(GPU0)])  # a PID namespace: NVML lists nobody
    pid = other_engine_holds(GPU0, 30 * GiB)
    problem = start_plan_problem([cuda_stage("rollout", 0.7)], None, nvml)
    assert "rollout rank 0 (0.7) want 56.0 GiB of 80.0 GiB" in problem
    assert "other processes hold 30.0 GiB there (free 50.0 GiB)" in problem
    assert f"stage trainer rank 0, pid {pid} (engine pid " in problem  # named: engine, stage, rank, pid, bytes
    assert f"{30 * GiB} bytes" in problem and "the node ledger's figures" in problem
    assert start_plan_problem([cuda_stage("rollout", 0.6)], None, nvml) == ""


def test_nvml_and_the_ledger_are_not_added_up_and_nvml_pids_get_the_ledger_names() -> None:
    pid = other_engine_holds(GPU0, 20 * GiB)  # the pool bytes; NVML sees the whole process
    nvml = FakeNvml([FakeDevice(GPU0, processes={pid: 22 * GiB, 4242: 8 * GiB})])
    [device] = plan_devices([cuda_stage("rollout", 0.7)], None, nvml)
    assert device.others_bytes == 30 * GiB  # NVML's 22 + 8, not 22 + 8 + 20
    problem = device.problem()
    assert f"stage trainer rank 0, pid {pid} (engine pid " in problem and "pid 4242: " in problem


def test_an_unreadable_ledger_leaves_nvml_figures_and_says_so(ledger_dir) -> None:
    ledger_dir.mkdir(mode=0o777)
    ledger_dir.chmod(0o777)
    nvml = FakeNvml([FakeDevice(GPU0, processes={4242: 30 * GiB})])
    problem = start_plan_problem([cuda_stage("rollout", 0.7)], None, nvml)
    assert "other processes hold 30.0 GiB" in problem and "pid 4242" in problem
    assert "the node ledger is unreadable" in problem and "writable by group or others" in problem
